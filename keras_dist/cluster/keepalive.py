"""The gRPC keepalive settings keras_dist gives TensorFlow's cluster channels.

Imports nothing heavy: `import keras_dist` applies them (`configure_grpc`)
before anything can open a channel.
"""

import os

GRPC_KEEPALIVE = ",".join([
    # A connection with calls in flight is pinged after 5 s without news.
    # A cut link or a dead host leaves the ping's bytes unacknowledged:
    # gRPC's TCP_USER_TIMEOUT (the keepalive timeout) fails the connection
    # within ~10 s.
    "grpc.keepalive_time_ms=5000",
    "grpc.keepalive_timeout_ms=5000",
    # A stopped process (SIGSTOP, a long GC pause, a VM migration) still
    # acknowledges TCP; only the ping's answer is missing, and gRPC waits
    # this long for it (default 60 s) before it fails the connection: a
    # paused worker is declared lost after ~10 s. This also bounds how long
    # training can wait on a worker stopped while the chief copies one of
    # its results (steps_per_execution > 1, local steps).
    "grpc.http2.ping_timeout_ms=5000",
    # When a worker is declared lost, TensorFlow frees the failed call's
    # results on it through the chief's default executor, which every
    # scheduled function waits for; connecting to a stopped process never
    # completes, so gRPC's connect timeout (default 20 s) bounds how long
    # all training waits then (measured at steps_per_execution 10: 20 s;
    # ~3.5 s with 3 s, ~1.5 s with this).
    "grpc.min_reconnect_backoff_ms=1000",
    # TensorFlow's servers take none of these options (TF_GRPC_DEFAULT_OPTIONS
    # is read for channels only), so they keep gRPC's server defaults: a
    # ping within 5 min of the last one, with no data sent back between, is
    # a strike, and a third strike is answered with GOAWAY "too_many_pings"
    # (seen here 14 times in a minute of an idle cluster). So: no pings on
    # a connection without calls, and at most 2 pings after each message
    # this side sends: an idle cluster collects no strikes.
    "grpc.keepalive_permit_without_calls=0",
    "grpc.http2.max_pings_without_data=2",
])
"""gRPC options keras_dist gives TensorFlow (`TF_GRPC_DEFAULT_OPTIONS`).

Without keepalive, a task whose network link is cut (packets dropped, no
connection reset) is never noticed: the coordinator's calls to it wait
forever and asynchronous training stalls until the link returns (seen in
tests/test_multihost.py before this was set). With it, the connection to a
cut-off or stopped worker is declared dead within about 10 s; TensorFlow's coordinator re-runs the worker's step elsewhere and
uses the worker again once it answers."""


def configure_grpc(environ=None):
    """Sets `TF_GRPC_DEFAULT_OPTIONS` to `GRPC_KEEPALIVE` unless already set.

    To opt out, set the variable yourself (any gRPC option, e.g.
    `grpc.keepalive_time_ms=7200000`, gRPC's own default).

    Must run before this process creates its first gRPC channel (TensorFlow
    reads it then), and before TensorFlow's threads read the environment
    (writing it while they do can crash the process): `import keras_dist`
    calls it, once, and nothing else in keras_dist writes the environment.
    Returns the value in force.

    Example:

    >>> from keras_dist.cluster.keepalive import configure_grpc
    >>> env = {}
    >>> configure_grpc(env).split(",")[0]
    'grpc.keepalive_time_ms=5000'
    >>> configure_grpc({"TF_GRPC_DEFAULT_OPTIONS": "grpc.keepalive_time_ms=60000"})
    'grpc.keepalive_time_ms=60000'
    """
    environ = os.environ if environ is None else environ
    if not environ.get("TF_GRPC_DEFAULT_OPTIONS"):  # unset or empty
        environ["TF_GRPC_DEFAULT_OPTIONS"] = GRPC_KEEPALIVE
    return environ["TF_GRPC_DEFAULT_OPTIONS"]
