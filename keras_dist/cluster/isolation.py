"""Network isolation for local clusters: a private network namespace.

TensorFlow's gRPC servers have no authentication, and they listen on every
interface (`*:port`) even when the cluster spec says 127.0.0.1, so a local
cluster started naively accepts graph ops from anyone on the network.
`keras-dist-run` therefore runs the whole cluster inside a new Linux network
namespace that has only its own loopback: the tasks reach each other on
127.0.0.1, and nothing outside the namespace can reach them.

The namespace comes from util-linux's `unshare --net` (with
`--map-root-user` when not root, which needs unprivileged user namespaces);
loopback is brought up with one `ioctl`, so no other tool is needed.
"""

import fcntl
import os
import shutil
import socket
import struct
import subprocess

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def unshare_command():
    """The `unshare` prefix that gives a private network namespace here.

    Returns:
        `(command, None)` when it works on this machine, else `(None, reason)`.
    """
    path = shutil.which("unshare")
    if path is None:
        return None, "the `unshare` command (util-linux) is not installed"
    command = [path, "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    try:
        probe = subprocess.run(command + ["true"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"`{' '.join(command)}` failed to start ({error})"
    if probe.returncode != 0:
        reason = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else (
            f"exit code {probe.returncode}")
        return None, (f"`{' '.join(command)}` is not permitted here ({reason}); "
                      "unprivileged user namespaces may be disabled")
    return command, None


def bring_up_loopback():
    """Sets the `lo` interface up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))

