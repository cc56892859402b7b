"""keras-dist-run: arguments, output, exit codes, and no orphan processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from procs import REPO

LAUNCH = [sys.executable, "-m", "keras_dist.launch"]


def launch(args, timeout=120):
    return subprocess.run(LAUNCH + args, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def pids_with_marker(marker):
    """PIDs of live processes whose command line contains `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split()[2] != "Z":
                            found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("args, message", [
    (["--workers", "0", "--", "python", "x.py"], "--workers must be at least 1. Received: --workers 0"),
    (["--ps", "-1", "--", "python", "x.py"], "--ps must be 0 or more"),
    (["--workers", "2"], "no command given. Put it after --"),
    (["--max-restarts", "-1", "--", "python", "x.py"], "--max-restarts must be 0 or more"),
    (["--", sys.executable, "does/not/exist.py"], "script 'does/not/exist.py' does not exist"),
    (["--", "no-such-program-kd"], "command 'no-such-program-kd' not found"),
])
def test_bad_arguments_fail_fast_with_a_clear_message(args, message):
    proc = launch(args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_prefixes_output_and_returns_the_leaders_exit_code(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "print('hello from', task['type'], task['index'])\n"
        "sys.exit(3 if task['type'] == 'worker' and task['index'] == 0 else 0)\n")
    proc = launch(["--workers", "2", "--", sys.executable, str(script)])
    assert proc.returncode == 3
    assert "[worker:0] hello from worker 0" in proc.stdout
    assert "[worker:1] hello from worker 1" in proc.stdout


def test_stops_serving_tasks_when_the_chief_ends(tmp_path):
    marker = f"kd-marker-{os.getpid()}-serve"
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "if task['type'] != 'chief':\n"
        "    time.sleep(600)  # a server that never ends by itself\n"
        "print('chief done')\n")
    start = time.monotonic()
    proc = launch(["--workers", "2", "--ps", "1", "--", sys.executable, str(script), marker])
    assert proc.returncode == 0
    assert "[chief:0] chief done" in proc.stdout
    assert time.monotonic() - start < 60
    assert pids_with_marker(marker) == []


def test_killing_the_launcher_leaves_no_process_behind(tmp_path):
    marker = f"kd-marker-{os.getpid()}-kill"
    script = tmp_path / "task.py"
    # Each task also starts a grandchild, which must die with it.
    script.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n")
    launcher = subprocess.Popen(
        LAUNCH + ["--workers", "2", "--ps", "1", "--", sys.executable, str(script), marker],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def tasks():
        return [p for p in pids_with_marker(marker) if p != launcher.pid]

    try:
        deadline = time.monotonic() + 60
        while len(tasks()) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)  # 4 tasks + 4 grandchildren
        assert len(tasks()) == 8
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
        assert launcher.returncode == 130
        time.sleep(0.5)
        assert pids_with_marker(marker) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids_with_marker(marker):
            os.kill(pid, signal.SIGKILL)
