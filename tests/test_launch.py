"""keras-dist-run: arguments, output, exit codes, and no orphan processes."""

import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from procs import REPO

LAUNCH = [sys.executable, "-m", "keras_dist.cluster.launch"]


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


def process_states(marker):
    """Every process whose command line contains `marker`, zombies included:
    pid, state, parent and command line, one per line (for failure messages)."""
    lines = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if marker.encode() not in cmdline:
                continue
            with open(f"/proc/{pid}/stat") as s:
                fields = s.read().rsplit(")", 1)[1].split()
            lines.append(f"pid {pid} state {fields[0]} parent {fields[1]}: "
                         + cmdline.replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return "\nprocesses with the marker:\n" + "\n".join(lines)


BAD_TASK_ARGUMENTS = [
    # Refused the same way by keras-dist-run and python -m keras_dist.ray.
    (["--workers", "0", "--", "python", "x.py"], "--workers must be at least 1. Received: --workers 0"),
    (["--ps", "-1", "--", "python", "x.py"], "--ps must be 0 or more"),
    (["--workers", "2"], "no command given. Put it after --"),
    (["--max-restarts", "-1", "--", "python", "x.py"], "--max-restarts must be 0 or more"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, message", BAD_TASK_ARGUMENTS + [
    (["--", sys.executable, "does/not/exist.py"], "script 'does/not/exist.py' does not exist"),
    (["--", "no-such-program-kd"], "command 'no-such-program-kd' not found"),
])
def test_bad_arguments_fail_fast_with_a_clear_message(args, message):
    proc = launch(args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.multiprocess
def test_prefixes_output_and_returns_the_leaders_exit_code(tmp_path):
    script = tmp_path / "task.py"
    # Worker 0's error stops the cluster at once, so it waits until worker 1
    # has printed (a file says so): else a slow start loses worker 1's line.
    script.write_text(
        "import json, os, sys, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "print('hello from', task['type'], task['index'], flush=True)\n"
        f"said = {str(tmp_path / 'worker1-said')!r}\n"
        "if task['index'] == 1:\n"
        "    open(said, 'w').close()\n"
        "    sys.exit(0)\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(said) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n")
    proc = launch(["--workers", "2", "--", sys.executable, str(script)])
    assert proc.returncode == 3
    assert "[keras-dist-run] worker:0 exited with code 3; stopping the cluster\n" in \
        proc.stdout, proc.stdout
    assert "[worker:0] hello from worker 0" in proc.stdout
    assert "[worker:1] hello from worker 1" in proc.stdout


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
def test_help_answers_without_importing_tensorflow():
    # The launcher only starts processes: TensorFlow loads in the tasks, not here.
    code = ("import sys\n"
            "from keras_dist.cluster import launch\n"
            "try:\n"
            "    launch.main(['--help'])\n"
            "except SystemExit as exit:\n"
            "    assert exit.code == 0, exit.code\n"
            "loaded = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
            "print('loaded:', loaded)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: keras-dist-run" in proc.stdout
    assert "loaded: []" in proc.stdout


@pytest.mark.multiprocess
def test_the_earlier_module_path_still_launches():
    """`python -m keras_dist.launch` (the path before issue 33) is the same launcher."""
    proc = subprocess.run([sys.executable, "-m", "keras_dist.launch", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: keras-dist-run" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_tensorflow_noise_is_dropped_unless_the_user_asks_for_it(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(
        "import sys\n"
        "print('I0000 00:00:1796316248.923044    4647 port.cc:153] oneDNN custom operations')\n"
        "print('W0000 00:00:1796316248.9    4647 dataset.cc:997] Input of GeneratorDatasetOp')\n"
        "print('E0000 00:00:1796316250.8    4647 cuda_platform.cc:52] failed call to cuInit: '\n"
        "      'INTERNAL: CUDA error')\n"
        "print('WARNING: All log messages before absl::InitializeLog() is called are '\n"
        "      'written to STDERR')\n"
        "print('I1203 16:44:16.240616 140114470738816 train.py:12] the user logs this')\n"
        "print('E0000 00:00:1796316250.8    4647 grpc.cc:1] a real error')\n"
        "print('progress 1/3\\b\\b\\b\\b\\b\\b\\b\\b\\b\\b\\b\\b\\r\\x1b[1mprogress 3/3\\x1b[0m')\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    quiet = subprocess.run(LAUNCH + ["--workers", "1", "--", sys.executable, str(script)],
                           cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    task_lines = [l for l in quiet.stdout.splitlines() if l.startswith("[worker:0]")]
    assert task_lines == [
        "[worker:0] I1203 16:44:16.240616 140114470738816 train.py:12] the user logs this",
        "[worker:0] E0000 00:00:1796316250.8    4647 grpc.cc:1] a real error",
        "[worker:0] progress 3/3",  # a redrawn line's final state, without colours
    ]
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    verbose = subprocess.run(LAUNCH + ["--workers", "1", "--", sys.executable, str(script)],
                             cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert "port.cc:153] oneDNN" in verbose.stdout
    assert "failed call to cuInit" in verbose.stdout


def test_a_live_progress_bar_on_a_terminal_stays_one_line():
    from keras_dist.cluster.launch import _Console

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    console = _Console(out)
    console.progress("chief:0", "1/3 [=>  ]")
    console.line("ps:0", "serving")  # another task's line: the bar is cleared, redrawn
    console.progress("chief:0", "2/3 [==> ]")
    console.line("chief:0", "3/3 [====] done")
    shown = out.getvalue()
    assert shown == ("\r\x1b[K[chief:0] 1/3 [=>  ]"
                     "\r\x1b[K[ps:0] serving\n[chief:0] 1/3 [=>  ]"
                     "\r\x1b[K[chief:0] 2/3 [==> ]"
                     "\r\x1b[K[chief:0] 3/3 [====] done\n")
    assert console.live is None


@pytest.mark.multiprocess
def test_a_serving_task_that_exits_cleanly_is_explained(tmp_path):
    # Plain model.fit under --ps: every task trains on its own and ends with 0.
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "if task['type'] == 'chief':\n"
        "    time.sleep(30)\n"
        "print('trained alone')\n")
    start = time.monotonic()
    proc = launch(["--workers", "2", "--ps", "1", "--", sys.executable, str(script)])
    assert proc.returncode == 1
    assert "exited with code 0 before the chief was done" in proc.stdout
    assert "call kd.fit or kd.serve" in proc.stdout
    assert "restarting" not in proc.stdout  # a clean exit is not a crash to retry
    assert time.monotonic() - start < 25


@pytest.mark.multiprocess
def test_a_task_that_cannot_start_stops_the_tasks_already_started():
    """Issue 48, 3: an error other than Ctrl-C or a lost task while the job
    starts (here Popen's real FileNotFoundError for the worker's program)
    left the tasks already started (the ps and worker 0) serving in their
    own sessions. The error reaches the caller and none of them is left."""
    from keras_dist.cluster import jobs, launch
    from keras_dist.cluster.config import ClusterConfig

    marker = f"kd-start-fails-{os.getpid()}"

    class WorkerCannotStart(launch.Cluster):
        def _start_task(self, role, index):
            if (role, index) == ("worker", 1):
                self.command = ["/nonexistent/keras-dist-test-program"]
            super()._start_task(role, index)

    def new_cluster(restarts):
        config = ClusterConfig.local(workers=2, ps=1)
        return WorkerCannotStart(config, [sys.executable, "-c", "import time; time.sleep(600)",
                                          marker], out=open(os.devnull, "w"))

    try:
        with pytest.raises(FileNotFoundError, match="keras-dist-test-program"):
            jobs.run_jobs(new_cluster, max_restarts=2)
        assert pids_with_marker(marker) == [], process_states(marker)
    finally:
        for pid in pids_with_marker(marker):
            os.kill(pid, 9)


@pytest.mark.parametrize("option, value", [("--image", "train:1"), ("--job-name", "digits"),
                                           ("--port", "2345")])
def test_a_recipe_option_without_emit_is_an_error_not_ignored(option, value, capsys):
    from keras_dist.cluster import launch

    with pytest.raises(SystemExit) as exit:
        launch.parse_args(["--workers", "2", option, value, "--", sys.executable, "-c", "1"])
    assert exit.value.code == 2
    assert (f"{option} applies to a recipe (--emit) only; without --emit the tasks run here "
            f"and nothing would use it. Received: {option} {value} and no --emit. Add --emit "
            f"tfjob, k8s or slurm, or drop {option}.") in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_worker_failing_with_its_own_error_under_ps_stops_the_job_once(tmp_path):
    """A Python exception in a worker's script would fail again after a
    restart: the job stops at the first one (it was restarted 3 times, its
    traceback printed 4 times), as a training task's error does without ps.
    The tasks here import no TensorFlow."""
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "if (task['type'], task['index']) == ('worker', 1):\n"
        "    raise RuntimeError('a bug of the script of its own')\n"
        "time.sleep(120)\n")
    start = time.monotonic()
    proc = subprocess.run(LAUNCH + ["--workers", "2", "--ps", "1", "--", sys.executable,
                                    str(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("RuntimeError: a bug of the script of its own") == 1, out
    assert ("[keras-dist-run] worker:1 exited with code 1; stopping the cluster (an error of "
            "the task's own: a restart would fail the same way)") in out, out
    assert "restarting" not in out, out
    assert time.monotonic() - start < 60


def _start_logged(args, log_path):
    """Starts keras-dist-run with `args`, its output in `log_path`."""
    return subprocess.Popen(LAUNCH + args, cwd=REPO, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_text(proc, log_path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text():
        assert proc.poll() is None, f"ended with {proc.returncode}:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"{text!r} not seen:\n{log_path.read_text()}"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_a_parameter_server_killed_from_outside_stops_the_cluster_at_once_with_137(tmp_path):
    """SIGKILL to the ps (its machine is lost) under --max-restarts 0: the
    launcher names the ps, exits with the shell's 128 + 9 at once and leaves
    no process behind. The chief, which watches the ps's port, may have
    failed by then with an error of its own, as TensorFlow's chief does
    (UnavailableError): the ps still counts as what ended the job. The
    tasks import no TensorFlow. (With restarts the job resumes from its
    backup: test_preemption's parameter-server job SIGKILLed three times.)"""
    marker = f"kd-marker-{os.getpid()}-ps-killed"
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, socket, sys, time\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "task = config['task']\n"
        "host, _, port = config['cluster']['ps'][0].rpartition(':')\n"
        "if task['type'] == 'ps':\n"
        "    server = socket.create_server((host, int(port)))\n"
        "    while True:\n"
        "        server.accept()[0].close()\n"
        "if task['type'] == 'chief':\n"
        "    seen = False\n"
        "    while True:\n"
        "        try:\n"
        "            socket.create_connection((host, int(port)), timeout=1).close()\n"
        "        except OSError as error:\n"
        "            if seen:\n"
        "                sys.exit(f'UnavailableError: the ps is gone ({error})')\n"
        "        else:\n"
        "            if not seen:\n"
        "                print('the ps answers', flush=True)\n"
        "            seen = True\n"
        "        time.sleep(0.05)\n"
        "time.sleep(600)\n")
    log_path = tmp_path / "launcher.txt"
    launcher = _start_logged(["--workers", "1", "--ps", "1", "--max-restarts", "0", "--",
                              sys.executable, str(script), marker], log_path)
    try:
        _wait_for_text(launcher, log_path, "[chief:0] the ps answers")
        ps_pid = int(re.search(r"started ps:0 \(pid (\d+)\)", log_path.read_text()).group(1))
        os.kill(ps_pid, signal.SIGKILL)
        killed = time.monotonic()
        code = launcher.wait(60)
        took = time.monotonic() - killed
        out = log_path.read_text()
        assert code == 128 + signal.SIGKILL, out
        assert "[keras-dist-run] ps:0 exited with code -9; stopping the cluster\n" in out, out
        assert "restarting" not in out, out
        assert took < 15, took  # no wait on the dead ps, nor a grace period's worth
        time.sleep(0.5)
        assert pids_with_marker(marker) == [], process_states(marker)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for pid in pids_with_marker(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
def test_the_leader_failing_with_its_own_code_stops_its_live_peers_at_once(tmp_path):
    """Without ps, worker 0 leads: it crashes (exit 3) while worker 1 still
    runs (a MultiWorkerMirrored peer waiting in an all-reduce). The launcher
    does not restart the job for an error of the task's own, stops worker 1
    at once and exits 3, and no process is left."""
    marker = f"kd-marker-{os.getpid()}-leader-fails"
    script = tmp_path / "task.py"
    up = tmp_path / "worker1-up"
    script.write_text(
        "import json, os, sys, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        f"up = {str(up)!r}\n"
        "if task['index'] == 1:\n"
        "    open(up, 'w').close()\n"
        "    time.sleep(600)\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(up) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n")
    log_path = tmp_path / "launcher.txt"
    began = time.monotonic()
    launcher = _start_logged(["--workers", "2", "--", sys.executable, str(script), marker],
                             log_path)
    try:
        code = launcher.wait(60)
        out = log_path.read_text()
        assert code == 3, out
        assert up.exists(), out  # worker 1 was running when worker 0 failed
        assert "[keras-dist-run] worker:0 exited with code 3; stopping the cluster\n" in out, out
        assert "restarting" not in out, out
        assert time.monotonic() - began < 30
        time.sleep(0.5)
        assert pids_with_marker(marker) == [], process_states(marker)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for pid in pids_with_marker(marker):
            os.kill(pid, signal.SIGKILL)
