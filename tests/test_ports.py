"""A task whose port another program holds: one line saying so, and new ports.

Each test starts a real second program that listens on a task's port (not a
hook of ours), then runs real TensorFlow servers: keras-dist's own entry
points must fail with one line naming the task, the port and "in use" before
TensorFlow's `Could not start gRPC server`, and `keras-dist-run` must restart
the job on new ports (or, without restarts left, stop saying why).
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from keras_dist.cluster import ports
from keras_dist.cluster.config import free_ports
from procs import ASYNC_LEARNS, REPO, stop_squatter

pytestmark = pytest.mark.multiprocess

LAUNCH = [sys.executable, "-m", "keras_dist.cluster.launch"]


@pytest.fixture
def holder():
    """A listening socket on a free loopback port: another program's port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_port_in_use_sees_a_listener_on_loopback_and_not_a_closed_port(holder):
    port = holder.getsockname()[1]
    assert ports.port_in_use(port)
    holder.close()
    assert not ports.port_in_use(port)


def test_port_in_use_sees_a_listener_on_every_interface():
    sock = socket.socket(socket.AF_INET6)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", 0))
    sock.listen()
    try:
        assert ports.port_in_use(sock.getsockname()[1])
    finally:
        sock.close()


# What each entry point is given; {port} is the taken one, the others are free.
ENTRIES = {
    # A worker of a parameter-server cluster: kd.resolve_strategy starts its server.
    "ps-worker": ({"chief": ["{a}"], "worker": ["{port}"], "ps": ["{b}"]}, ("worker", 0)),
    # The chief: its coordinator's server binds the chief's port.
    "ps-chief": ({"chief": ["{port}"], "worker": ["{a}"], "ps": ["{b}"]}, ("chief", 0)),
    # A MultiWorkerMirrored worker: TF's collective server binds it.
    "multi-worker": ({"worker": ["{port}", "{a}"]}, ("worker", 0)),
    # kd.serve, the serving loop of worker and ps tasks.
    "serve": ({"chief": ["{a}"], "worker": ["{b}"], "ps": ["{port}"]}, ("ps", 0)),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_each_entry_point_fails_with_one_line_naming_task_port_and_in_use(entry, holder):
    port = holder.getsockname()[1]
    a, b = free_ports(2)
    cluster, (role, index) = ENTRIES[entry]
    cluster = {r: [x.format(port=f"127.0.0.1:{port}", a=f"127.0.0.1:{a}",
                            b=f"127.0.0.1:{b}") for x in addresses]
               for r, addresses in cluster.items()}
    call = "kd.serve()" if entry == "serve" else "kd.resolve_strategy(connect_timeout=60)"
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": role, "index": index}}))
    proc = subprocess.run([sys.executable, "-c", f"import keras_dist as kd; {call}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    said = [line for line in output.splitlines() if "in use" in line]
    assert said == [
        f"keras_dist.cluster.ports.PortInUseError: {role}:{index} cannot start its "
        f"TensorFlow server: port {port} is in use by another program. Stop that "
        f"program, or give {role}:{index} another port in the cluster description "
        "(keras-dist-run picks new ports when it restarts the job)"], output
    # Said before TensorFlow tried: no gRPC error, and nobody waited on peers.
    assert "Could not start gRPC server" not in output, output


def _serving_ports(output, task):
    return [int(p) for p in re.findall(
        rf"\[{task}\] keras_dist: {task} serving at 127\.0\.0\.1:(\d+)", output)]


@pytest.mark.timeout(600)
def test_the_launcher_restarts_the_job_on_new_ports_and_training_is_exact(tmp_path):
    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir()
    out.mkdir()
    command = [sys.executable, "tests/scripts/squat_port.py", "worker:0", str(state),
               "tests/scripts/ps_train.py", str(out)]
    try:
        proc = subprocess.run(LAUNCH + ["--workers", "1", "--ps", "1", "--", *command],
                              cwd=REPO, capture_output=True, text=True, timeout=540)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
        taken = re.search(r"\[worker:0\] squat_port: another program now listens on port "
                          r"(\d+)", output)
        assert taken, output[-6000:]
        port = int(taken.group(1))
        # The task says it in one line; the launcher says it once and restarts
        # the job (not the worker alone, which would need the same port).
        assert f"[worker:0] keras_dist.cluster.ports.PortInUseError: worker:0 cannot start " \
               f"its TensorFlow server: port {port} is in use" in output, output[-6000:]
        restarts = [line for line in output.splitlines()
                    if line.startswith("[keras-dist-run]") and "restart" in line]
        assert restarts == [
            f"[keras-dist-run] worker:0 could not listen on port {port}: it is in use by "
            "another program; restarting the job on new ports (1/3), no backup in force: "
            "starting afresh"], output[-6000:]
        # The second job's worker serves on another port; the squatter kept its own.
        assert _serving_ports(output, "worker:0") and port not in _serving_ports(
            output, "worker:0"), output[-6000:]
        with open(out / "result.json") as f:
            result = json.load(f)
        assert result["iterations"] == result["version"] == result["scheduled_steps"]
        assert result["test_accuracy"] >= ASYNC_LEARNS, result
    finally:
        stop_squatter(state)


@pytest.mark.timeout(300)
def test_without_restarts_the_launcher_stops_naming_the_port(tmp_path):
    # The task is plain TensorFlow (no keras-dist): the launcher still sees why.
    command = [sys.executable, "tests/scripts/squat_port.py", "worker:0", str(tmp_path),
               "tests/scripts/serve_forever.py"]
    try:
        proc = subprocess.run(LAUNCH + ["--workers", "1", "--ps", "1", "--max-restarts", "0",
                                        "--", *command],
                              cwd=REPO, capture_output=True, text=True, timeout=240)
        output = proc.stdout + proc.stderr
        port = int(re.search(r"another program now listens on port (\d+)", output).group(1))
        assert proc.returncode != 0, output
        assert f"[keras-dist-run] worker:0 could not listen on port {port}: it is in use by " \
               "another program; stopping the cluster" in output, output
    finally:
        stop_squatter(tmp_path)
