"""A task's own port: is it free for TensorFlow's server, and if not, say so.

TensorFlow's gRPC server listens on every interface, `0.0.0.0:<port>` (gRPC
makes that a dual-stack `[::]:<port>` where IPv6 exists), whatever host the
cluster spec gives the task: `GrpcServer::Init` in TensorFlow's
`tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc` builds the
listening address from the port alone, and neither `tf.distribute.Server`
nor `tf.train.ServerDef` has a field for the host. When another program
holds the port, TensorFlow's only words are `UnknownError: Could not start
gRPC server`. Here a task probes its port the way the server will bind it,
before the server starts, and fails with one line naming the task, the port
and "in use"; `keras-dist-run` probes a failed task's port the same way and
restarts the job on new ports.

Plain Python: the launcher imports it without TensorFlow.
"""

import errno
import socket

__all__ = ["PortInUseError", "check_own_port", "port_in_use"]


class PortInUseError(OSError):
    """This task's TensorFlow server cannot listen: its port is in use.

    An `OSError` with `errno.EADDRINUSE`, raised before TensorFlow tries
    (and fails with `Could not start gRPC server`). `task` is `"role:index"`
    and `port` the port number.

    Example:

    >>> from keras_dist.cluster.ports import PortInUseError
    >>> error = PortInUseError("worker:1", 2222)
    >>> error.errno == __import__("errno").EADDRINUSE, error.task, error.port
    (True, 'worker:1', 2222)
    """

    def __init__(self, task, port):
        super().__init__(
            errno.EADDRINUSE,
            f"{task} cannot start its TensorFlow server: port {port} is in use by "
            f"another program. Stop that program, or give {task} another port in "
            "the cluster description (keras-dist-run picks new ports when it "
            "restarts the job)")
        self.task, self.port = task, port

    def __str__(self):
        return self.strerror  # one line, without "[Errno 98]"


def port_in_use(port):
    """Whether TensorFlow's server could not bind `port` here right now.

    Binds the port the way gRPC does (every interface, dual-stack IPv6 where
    the machine has it, `SO_REUSEADDR`, so a port in `TIME_WAIT` counts as
    free) and releases it at once.

    Args:
        port: Integer. The TCP port.

    Returns:
        `True` when the bind fails with `EADDRINUSE`, else `False`.

    Example:

    >>> import socket
    >>> from keras_dist.cluster.ports import port_in_use
    >>> holder = socket.socket()
    >>> holder.bind(("127.0.0.1", 0))
    >>> holder.listen()
    >>> port = holder.getsockname()[1]
    >>> port_in_use(port)
    True
    >>> holder.close()
    >>> port_in_use(port)
    False
    """
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine: gRPC falls back to IPv4 too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
                if family == socket.AF_INET6:
                    continue  # IPv6 present but unusable here: probe IPv4
                raise
            return False
    return False


def check_own_port(cluster):
    """Raises `PortInUseError` when this task's port is taken.

    Call it once, before this process starts its TensorFlow server (not
    after: the server then holds the port itself).

    Args:
        cluster: A `ClusterConfig` with its task set.

    Raises:
        PortInUseError: naming the task and the port.
    """
    address = cluster.address
    if address is None:
        return
    port = int(address.rpartition(":")[2])
    if port and port_in_use(port):
        raise PortInUseError(f"{cluster.task_type}:{cluster.task_index}", port)
