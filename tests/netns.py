"""Virtual hosts for multi-host tests: Linux network namespaces on a private switch.

`VirtualHosts(n)` builds n hosts, each a network namespace with its own
address (10.<net>.0.<i+1>/24) on a veth link to a bridge that lives in a
namespace of its own (the "switch"). Nothing is attached to the machine's
real network: traffic between the hosts never leaves these namespaces.
`cut(i)` takes host i's link down (its packets are dropped silently, like a
pulled cable) and `restore(i)` brings it back. Everything is deleted on exit,
processes first. Needs root and `ip` (iproute2); `available()` says why not.
"""

import os
import shutil
import subprocess
import sys
import uuid

from procs import kill_groups


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available():
    """`None` if virtual hosts can be built here, else the reason why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and veth links)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    probe = f"kdprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class VirtualHosts:
    """n hosts on one private switch; a context manager."""

    def __init__(self, count):
        self.tag = uuid.uuid4().hex[:5]
        self.count = count
        self.net = 100 + int(self.tag, 16) % 100
        self.switch = f"kdsw{self.tag}"
        self.names = [f"kdh{i}{self.tag}" for i in range(count)]
        self.addresses = [f"10.{self.net}.0.{i + 1}" for i in range(count)]
        self.procs = []

    def __enter__(self):
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                host_end, switch_end = f"h{i}{self.tag}", f"s{i}{self.tag}"
                # Created inside the host namespace, the switch end moved out.
                _ip("-n", ns, "link", "add", host_end, "type", "veth", "peer", "name",
                    switch_end)
                _ip("-n", ns, "link", "set", switch_end, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
                _ip("-n", self.switch, "link", "set", switch_end, "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", host_end)
                _ip("-n", ns, "link", "set", host_end, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, host, args, **kwargs):
        """Runs `args` in host's namespace (blocking); returns CompletedProcess."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *args], **kwargs)

    def start(self, host, args, env=None, log_path=None):
        """Starts `args` in host's namespace, in its own process group."""
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc.log_path = log_path
        self.procs.append(proc)
        return proc

    def cut(self, host):
        """Drops host's link (switch side): its packets vanish silently."""
        _ip("-n", self.switch, "link", "set", f"s{host}{self.tag}", "down")

    def restore(self, host):
        _ip("-n", self.switch, "link", "set", f"s{host}{self.tag}", "up")

    def close(self):
        kill_groups(self.procs)
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns, check=False)


if __name__ == "__main__":  # a quick manual check: ping between two hosts
    with VirtualHosts(2) as hosts:
        print(hosts.run(0, ["ping", "-c", "1", "-W", "1", hosts.addresses[1]],
                        capture_output=True, text=True).stdout)
        hosts.cut(1)
        print(hosts.run(0, ["ping", "-c", "1", "-W", "1", hosts.addresses[1]],
                        capture_output=True, text=True).returncode)
    sys.exit(0)
