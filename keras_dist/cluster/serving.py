"""Serving roles: `serve()` for worker / ps tasks, and waiting for a cluster.

In parameter-server training only the chief runs the script's training code;
`worker` and `ps` tasks run a `tf.distribute.Server` that executes what the
chief schedules. The same script runs on every task: on worker and ps tasks
`keras_dist.fit` (or an explicit `serve()`) serves and never returns.
"""

import logging
import os
import signal
import socket
import sys
import threading
import time

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.cluster.config import DEFAULT_GRACE_PERIOD, PREEMPTED_EXIT_CODE, ClusterConfig
from keras_dist.cluster.keepalive import GRPC_KEEPALIVE  # noqa: F401  (kept at this path too)
from keras_dist.cluster.ports import check_own_port

logger = logging.getLogger("keras_dist")

_SERVERS = {}



def start_server(cluster):
    """Starts (once per process) the `tf.distribute.Server` of this task.

    Gives the server `inter_op_parallelism_threads >= workers + 1`: fewer
    deadlock small machines (TensorFlow's parameter-server tutorial warns of
    it; seen here on 2 cores).

    Returns:
        The running `tf.distribute.Server`.

    Raises:
        PortInUseError: when another program holds this task's port.
    """
    if cluster.task_type is None:
        raise ValueError(
            "This process has no task in the cluster (TF_CONFIG has no 'task'). "
            "Set TF_CONFIG's 'task' to this process's role and index.")
    key = cluster.address
    if key not in _SERVERS:
        check_own_port(cluster)
        config = tf.compat.v1.ConfigProto()
        config.inter_op_parallelism_threads = max(4, cluster.num_workers + 1)
        _SERVERS[key] = tf.distribute.Server(
            cluster.cluster_spec(), job_name=cluster.task_type,
            task_index=cluster.task_index, protocol=cluster.rpc_layer,
            config=config, start=True)
        logger.info("keras_dist: %s:%d serving at %s", cluster.task_type,
                    cluster.task_index, cluster.address)
    return _SERVERS[key]


def serve(cluster=None, grace_period=None):
    """Serves this worker / ps task until the process is stopped.

    Call it on `worker` and `ps` tasks of a parameter-server cluster (the
    launcher or the scheduler stops them when the chief is done).
    `keras_dist.fit` and `AsyncModel.fit` call it for you on those tasks.

    SIGTERM (preemption: a scheduler, Kubernetes or `keras-dist-run`
    signals every task of the job at once) does not stop the serving at
    once: the chief still needs this task to finish the steps in flight and
    to read the variables for its backup. The task serves on until the
    chief has exited (its port stops answering) or until 80% of
    `grace_period` has passed, then exits with code 75 ("preempted"), like
    the chief after its backup; when the chief is gone already (the job
    is over), SIGTERM ends it at once, as by default. SIGKILL and Ctrl-C
    end it at once too.

    Args:
        cluster: `ClusterConfig` or `None` to read `TF_CONFIG` / SLURM.
        grace_period: Seconds between the scheduler's SIGTERM and its
            SIGKILL (Kubernetes' `terminationGracePeriodSeconds`); `None`
            for 30, Kubernetes' default. `keras_dist.fit` passes the
            `grace_period` of the `BackupAndRestore` in its callbacks.

    Example:

    >>> import keras_dist as kd
    >>> config = kd.ClusterConfig.local(workers=1, ps=1).for_task("chief")
    >>> kd.serve(config)
    Traceback (most recent call last):
    ...
    ValueError: keras_dist.serve() runs worker and ps tasks; this process is chief:0, which coordinates: call keras_dist.fit (or AsyncModel.fit) instead.

    Raises:
        ValueError: when there is no cluster, or this task is the chief.
        PortInUseError: when another program holds this task's port.
    """
    cluster = cluster or ClusterConfig.from_env()
    if cluster is None:
        raise ValueError(
            "keras_dist.serve() needs a cluster: set TF_CONFIG (or use "
            "keras-dist-run) so this process knows its role.")
    if cluster.task_type not in ("worker", "ps"):
        raise ValueError(
            f"keras_dist.serve() runs worker and ps tasks; this process is "
            f"{cluster.task_type}:{cluster.task_index}, which coordinates: call "
            "keras_dist.fit (or AsyncModel.fit) instead.")
    grace_period = _check_grace_period(grace_period)
    start_server(cluster)
    _serve_until_preempted(cluster, grace_period)


def _check_grace_period(grace_period):
    if grace_period is None:
        return DEFAULT_GRACE_PERIOD
    if (isinstance(grace_period, bool) or not isinstance(grace_period, (int, float))
            or not grace_period > 0):
        raise ValueError(
            "keras_dist.serve(): `grace_period` must be a number of seconds > 0 (the "
            f"scheduler's time between SIGTERM and SIGKILL; default 30). Received: "
            f"grace_period={grace_period!r}.")
    return float(grace_period)


def _serve_until_preempted(cluster, grace_period, poll=0.2):
    """The server runs on TensorFlow's threads; the main thread waits here
    (not in `Server.join()`, whose C++ wait would keep a Python SIGTERM
    handler from ever running) for SIGTERM, then for the chief to be done."""
    signalled = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: signalled.set())
    else:  # no handler can be installed: SIGTERM keeps its default action
        logger.info("keras_dist: serve() runs outside the main thread; SIGTERM ends "
                    "this task at once (no wait for the chief's backup)")
    while not signalled.wait(1.0):
        pass
    deadline = time.monotonic() + 0.8 * grace_period
    chief = (cluster.cluster.get("chief") or [None])[0]
    name = f"{cluster.task_type}:{cluster.task_index}"
    waited = misses = 0
    while misses < 2 and time.monotonic() < deadline:
        # Twice unanswered: one refused connect is the chief gone, not a blip.
        misses = 0 if chief is not None and _answers(chief) else misses + 1
        if misses == 0 and not waited:
            logger.info("keras_dist: %s got SIGTERM; serving until the chief is done (at "
                        "most %.0f s)", name, 0.8 * grace_period)
        waited += misses == 0
        if misses < 2:
            time.sleep(poll)
    if waited:  # (the end of every job, the chief gone first, says nothing)
        why = ("the chief is done" if misses >= 2 else
               f"{0.8 * grace_period:.0f} s passed (80% of the grace period) and the "
               "chief still runs")
        logger.info("keras_dist: %s stops serving: %s; exiting with code %d (preempted)",
                    name, why, PREEMPTED_EXIT_CODE)
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if not waited:  # as before: ended by SIGTERM, as an uncaught one ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    # At once: TensorFlow's server has no clean shutdown, and nothing here
    # holds anything to save.
    os._exit(PREEMPTED_EXIT_CODE)


def _answers(address, timeout=1.0):
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def meet_peers(cluster, timeout, poll=0.2):
    """Waits until every other training task (chief and workers) of a
    MultiWorkerMirrored cluster is up, before TensorFlow's own wait.

    TensorFlow's MultiWorkerMirroredStrategy waits for its peers inside its
    constructor, in C++, with no limit ("Waiting for 1/2 tasks") and with
    SIGTERM swallowed by its preemption notifier: a lone worker whose peer
    never started hung until SIGKILL. Here each task listens on its own
    port (a plain socket, closed before TensorFlow binds it) and connects to
    every peer's until each has answered once; seeing a peer once is enough
    (after that it answers from its listener or from TensorFlow's server),
    so no two tasks wait for each other. The wait is ordinary Python: SIGTERM
    ends it, and after `timeout` seconds it fails naming the missing tasks.

    Raises:
        TimeoutError: naming every peer that did not answer within `timeout`.
    """
    own = cluster.address
    pending = {f"{role}:{i}": address
               for role in ("chief", "worker")
               for i, address in enumerate(cluster.cluster.get(role, ()))
               if address != own}
    if not pending:
        return
    listener = None
    if own is not None:
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("", int(own.rpartition(":")[2])))
            listener.listen(64)
        except OSError:  # the port is taken (TensorFlow's server already runs)
            if listener is not None:
                listener.close()
            listener = None
    try:
        _wait_for_ports(pending, timeout, poll, lambda missing: (
            f"MultiWorkerMirrored peers did not come up within {timeout:g} s: {missing} "
            f"(this task: {cluster.task_type}:{cluster.task_index}). Start every task of "
            f"the cluster ({cluster.source}; the launcher or scheduler starts them together), or "
            "raise `connect_timeout` in keras_dist.resolve_strategy."))
    finally:
        if listener is not None:
            listener.close()


def wait_for_tasks(cluster, timeout):
    """Waits until every task's port accepts TCP connections.

    TensorFlow itself would wait on a missing task with no message; this
    turns that into an error naming the address after `timeout` seconds.

    Raises:
        TimeoutError: naming every task that did not come up.
    """
    pending = {f"{role}:{i}": address
               for role, addresses in cluster.cluster.items()
               if role in ("worker", "ps")
               for i, address in enumerate(addresses)}
    _wait_for_ports(pending, timeout, 0.2, lambda missing: (
        f"Cluster tasks did not come up within {timeout:g} s: {missing}. Check that they "
        "were started with the same TF_CONFIG cluster, or raise `connect_timeout`."))


def _wait_for_ports(pending, timeout, poll, message):
    """Connects to each `{name: "host:port"}` of `pending` until every one
    has answered once; after `timeout` seconds raises `TimeoutError` with
    `message("name at address, ...")` for those that did not."""
    pending = dict(pending)
    deadline = time.monotonic() + timeout
    while pending:
        for name, address in list(pending.items()):
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
                    del pending[name]
            except OSError:
                pass
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(message(", ".join(f"{n} at {a}" for n, a in pending.items())))
        time.sleep(poll)
