"""keras-dist-run's private network namespace keeps TF's open ports private.

TensorFlow's servers listen on every interface (`*:port`) even when the
cluster spec says 127.0.0.1. These tests start real servers through the
launcher and try to reach them from this host's other address.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from keras_dist.cluster import isolation
from procs import REPO

pytestmark = pytest.mark.multiprocess


def host_address():
    """A non-loopback IPv4 address of this machine, or None."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return None
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return match.group(1) if match else None


def reachable(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def listening(port):
    """The local addresses this network namespace listens on at `port`, read
    from /proc/net/tcp and tcp6 (what `ss -ltn` shows): e.g. {"::"}."""
    found = set()
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(host)
                    # The kernel prints each 32-bit word in host (little-endian) order.
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(socket.inet_ntop(
                        socket.AF_INET if width == 8 else socket.AF_INET6, raw))
    return found


def serving_ports(extra_args, tmp_path):
    """Starts a one-task cluster (worker 0: one real TensorFlow server, as
    every task of a cluster starts); returns the launcher, the server's
    ports (one) and the launcher's log."""
    log = open(tmp_path / "launcher.log", "w+")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "1",
         *extra_args, "--", sys.executable, "tests/scripts/serve_forever.py"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    ports = []
    while time.monotonic() < deadline and not ports:
        time.sleep(0.5)
        log.seek(0)
        ports = [int(p) for p in re.findall(r"serving 127\.0\.0\.1:(\d+)", log.read())]
    return launcher, ports, log


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_ports_are_private_only_when_isolated(tmp_path, isolate):
    address = host_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to test from")
    if isolate:
        command, reason = isolation.unshare_command()
        if command is None:
            pytest.skip(f"network namespaces unavailable here: {reason}")
    launcher, ports, log = serving_ports([] if isolate else ["--no-isolate"], tmp_path)
    try:
        log.seek(0)
        assert len(ports) == 1, log.read()[-3000:]
        reached = [reachable(address, port) for port in ports]
        if isolate:
            assert reached == [False]
            assert not any(reachable("127.0.0.1", port) for port in ports)
            # Nothing listens on the host's network at all, on any address.
            assert [listening(port) for port in ports] == [set()]
        else:
            assert reached == [True]  # TF listens on *:port, not 127.0.0.1
            # ...on the wildcard address (dual-stack "::" where IPv6 exists):
            # TensorFlow takes no host to bind (see keras_dist/cluster/ports.py).
            for port in ports:
                assert listening(port) & {"::", "0.0.0.0"}, listening(port)
        log.seek(0)
        text = log.read()
        expected = "private network namespace" if isolate else "--no-isolate"
        assert expected in text
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
        log.close()
    assert not any(reachable("127.0.0.1", port) for port in ports)  # all stopped


def test_isolated_tasks_share_one_namespace_apart_from_the_host(tmp_path):
    if isolation.unshare_command()[0] is None:
        pytest.skip("network namespaces unavailable here")
    script = tmp_path / "ns.py"
    script.write_text("import os\nprint('ns', os.readlink('/proc/self/ns/net'))\n")
    proc = subprocess.run([sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2",
                           "--", sys.executable, str(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    namespaces = set(re.findall(r"ns (net:\[\d+\])", proc.stdout))
    assert len(namespaces) == 1
    assert namespaces != {os.readlink("/proc/self/ns/net")}
