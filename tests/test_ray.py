"""keras_dist.ray: a keras-dist cluster on a real local Ray, with real TF servers.

The tests marked `ray` start Ray (`ray.init()`: a head node of its own
processes, ~4 s) and whole clusters of TensorFlow tasks on its actors; they
need the `ray` extra and run in `make test-ray`, not in `make test` (about
3 minutes here). The others need neither Ray running nor installed.
"""

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from procs import ASYNC_LEARNS, REPO, stop_squatter
from test_launch import BAD_TASK_ARGUMENTS, pids_with_marker, process_states

RAY = [sys.executable, "-m", "keras_dist.ray"]
ACTOR = "ray::TaskActor"  # what Ray names an actor's process


def ray_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_DIST_STRATEGY")}
    # The worktree's keras_dist on every actor and task, as on the driver.
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", RAY_DISABLE_USAGE_STATS="1")
    env.update(extra)
    return env


def run_cli(args, timeout=300, env=None, **kwargs):
    return subprocess.run(RAY + args, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env or ray_env(), **kwargs)


def assert_nothing_left(marker, but=None):
    """No task process (their command lines hold `marker`; `but` the
    driver's pid) and no task actor."""
    def left():
        return [p for p in pids_with_marker(marker) if p != but], pids_with_marker(ACTOR)

    deadline = time.monotonic() + 30
    while any(left()) and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray reaps a killed actor's process by itself
    assert left() == ([], [])


def fresh_python(code):
    """Runs `code` in a fresh Python in the clone; returns its stdout."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def drive(args, act, env):
    """Runs `python -m keras_dist.ray ARGS`, calling `act(line, output so
    far)` on each output line until it returns something; returns the
    driver's exit code, its output and what `act` returned."""
    driver = subprocess.Popen(RAY + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, acted = [], None
    try:
        for line in driver.stdout:
            output.append(line)
            if acted is None:
                acted = act(line, "".join(output))
        driver.wait(300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    return driver.returncode, "".join(output), acted


HOLDER = """
import sys
import ray
ray.init(num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it; ray.init's cluster ends with this process
"""


@contextlib.contextmanager
def ray_holder(env):
    """A Ray cluster held by a process of its own (`HOLDER`); yields its
    address, and stops it on the way out."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=REPO, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        address = holder.stdout.readline().strip()
        assert re.fullmatch(r"[\d.]+:\d+", address), address
        yield address, holder
    finally:
        holder.stdin.close()
        try:
            holder.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


@pytest.fixture(scope="module")
def on_one_head():
    """The environment of a job on this module's one Ray cluster
    (`RAY_ADDRESS`: the driver's `ray.init()` connects to it). Starting and
    stopping Ray took ~8 s per test; the tests of what Ray's own start does
    (test_a_function_runs_on_every_task_and_nothing_is_left: a driver that
    starts Ray itself; test_an_existing_ray_cluster_by_address_...: one with
    token authentication, by --address) keep theirs. On a cluster that
    outlives the job nothing of the job is torn down by Ray's own shutdown:
    the checks that no task actor or process is left see what the driver
    stopped itself. (Ray turns token authentication on for a cluster it
    starts; a driver joining one needs the token: here one of our own.)"""
    auth = dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # Its actors run a task's `python` from the PATH the cluster started
    # with (not the driver's): this clone's environment first, as on a node
    # set up for the job.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    with ray_holder(ray_env(PATH=path, **auth)) as (address, _):
        yield ray_env(RAY_ADDRESS=address, PATH=path, **auth)


# ---------------------------------------------------------------- no Ray needed
@pytest.mark.multiprocess
def test_import_keras_dist_and_help_import_neither_ray_nor_tensorflow():
    code = ("import sys\n"
            "import keras_dist\n"
            "assert 'ray' not in sys.modules, 'import keras_dist imported ray'\n"
            "import keras_dist.ray\n"
            "try:\n"
            "    keras_dist.ray.main(['--help'])\n"
            "except SystemExit as exit:\n"
            "    assert exit.code == 0, exit.code\n"
            "print('loaded:', sorted(m for m in ('ray', 'tensorflow', 'keras')"
            " if m in sys.modules))\n")
    out = fresh_python(code)
    assert "usage: python -m keras_dist.ray" in out
    assert "loaded: []" in out


@pytest.mark.multiprocess
def test_without_ray_installed_the_error_names_the_extra():
    code = ("import sys\n"
            "sys.modules['ray'] = None  # as if not installed\n"
            "import keras_dist.ray\n"
            "try:\n"
            "    keras_dist.ray.run(['python', 'train.py'])\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    out = fresh_python(code)
    assert "keras_dist.ray needs Ray, which is not installed here" in out
    assert "Install it with `pip install ray`, or with keras-dist's `ray` extra" in out


@pytest.mark.parametrize("kwargs, message", [
    (dict(target=[]), "`target` must be a command, a non-empty list of strings"),
    (dict(target="python train.py"), "Received: target='python train.py'"),
    (dict(workers=0), "`workers` must be an integer of at least 1. Received: workers=0."),
    (dict(ps=-1), "`ps` must be an integer of at least 0. Received: ps=-1."),
    (dict(max_restarts=True), "Received: max_restarts=True."),
    (dict(env={"A": 1}), "`env` must be a dict of strings to strings"),
    (dict(actor_options=["num_cpus"]), "`actor_options` must be a dict of Ray actor options"),
])
def test_bad_arguments_are_refused_naming_the_value(kwargs, message):
    import keras_dist.ray

    kwargs = {"target": ["python", "train.py"], **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        keras_dist.ray.run(kwargs.pop("target"), **kwargs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, message", BAD_TASK_ARGUMENTS)
def test_bad_command_lines_fail_fast_with_a_clear_message(args, message):
    proc = run_cli(args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


# ------------------------------------------------------------ on a local Ray
@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_multiworker_mirrored_workers_train_in_sync(tmp_path, on_one_head):
    proc = run_cli(["--workers", "2", "--", sys.executable, "tests/scripts/mwms_worker.py",
                    str(tmp_path)], env=on_one_head)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    import numpy as np

    infos = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    weights = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    for info in infos:
        assert info["replicas"] == 2
        assert info["test_accuracy"] >= 0.9, info["test_accuracy"]
        # 4 epochs of ceil(1437 / 64) = 23 steps, each applied once everywhere.
        assert info["version"] == info["iterations"] == 4 * 23
    assert infos[0]["history"] == infos[1]["history"]
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_asynchronous_training_on_actors_survives_a_killed_worker(tmp_path, on_one_head):
    """A chief, 2 workers and 1 ps, each a Ray actor's process, find each
    other at the ports their actors chose; SIGKILL worker 1's process in
    epoch 3, from outside: its actor starts it again at its address and it
    contributes again (as under keras-dist-run: tests/test_preemption.py),
    and every update is counted. (The same launcher code counts exactly
    under keras-dist-run without a kill: tests/test_async.py.)"""
    killed = []

    def kill_worker_1(line, output):
        if not killed and "[chief:0] Epoch 3/" in line:
            killed.append(int(re.findall(r"started worker:1 \(pid (\d+) on ", output)[-1]))
            os.killpg(killed[0], signal.SIGKILL)
        # Once the restarted worker has done an update, the chief stops two
        # epochs later (ps_long.py's stop file).
        back = re.search(r"\[chief:0\] updates after epoch (\d+): .*\"1\": [1-9]", line)
        if killed and back and int(back.group(1)) > 3:
            (tmp_path / "stop").touch()
            return killed[0]

    code, text, killed = drive(["--workers", "2", "--ps", "1", "--", sys.executable,
                                "tests/scripts/ps_long.py", str(tmp_path), "150"], kill_worker_1,
                                on_one_head)
    assert killed is not None and code == 0, text[-3000:]
    assert "worker:1 exited with code -9; restarting it (1/3)" in text
    restarted = re.findall(r"started worker:1 \(pid (\d+) on ([\d.]+)\)", text)
    assert len(restarted) == 2 and int(restarted[1][0]) != killed, restarted
    result = json.loads((tmp_path / "result.json").read_text())
    # TF reruns a step whose worker died after it applied its update: at
    # least once, counted, never lost.
    assert 0 <= result["version"] - result["scheduled"] <= 4, result["version"]
    assert result["test_accuracy"] >= ASYNC_LEARNS
    after_kill = result["updates_per_epoch"][3:]
    assert any(epoch.get("1", 0) > 0 for epoch in after_kill), after_kill
    # Every task's output comes back prefixed; the tasks found each other at
    # the ports their actors chose on the node.
    assert "[keras-dist-ray] cluster: 1 chief, 2 workers, 1 ps from Ray; nodes " in text
    assert "[chief:0] keras_dist: using parameter_server strategy" in text
    served = re.findall(r"\[ps:0\] keras_dist: ps:0 serving at ([\d.]+:\d+)", text)
    assert len(served) == 1 and not served[0].startswith("127."), served
    assert "(pid=" not in text  # not Ray's prefix
    assert_nothing_left(str(tmp_path))


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_function_runs_on_every_task_and_nothing_is_left(tmp_path):
    """The function form, from a fresh driver that starts Ray itself: each
    task runs it in a process of its own; the leader's code is the result;
    serving tasks that never end are stopped with their children."""
    marker = f"kd-ray-{os.getpid()}-fn"
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import json, os, subprocess, sys, time\n"
        "import keras_dist.ray\n"
        "def task():\n"
        "    me = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "    print('hello from', me['type'], me['index'], os.getpid())\n"
        "    if me['type'] != 'chief':\n"
        f"        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
        f"'{marker}'])\n"
        f"        open('{tmp_path}/' + me['type'] + str(me['index']), 'w').close()\n"
        "        time.sleep(600)  # a server that never ends by itself\n"
        f"    while len(os.listdir('{tmp_path}')) < 4:  # the 3 others are up\n"
        "        time.sleep(0.1)\n"
        "    sys.exit(4)\n"
        "sys.exit(keras_dist.ray.run(task, workers=2, ps=1))\n")
    proc = subprocess.run([sys.executable, str(driver)], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=240, env=ray_env())
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    for task in ("chief 0", "worker 0", "worker 1", "ps 0"):
        assert re.search(rf"^\[{task.replace(' ', ':')}\] hello from {task} \d+$", proc.stdout,
                         re.MULTILINE), proc.stdout
    assert_nothing_left(marker)


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_to_the_driver_stops_every_task_and_actor(tmp_path, on_one_head):
    marker = f"kd-ray-{os.getpid()}-term"
    script = tmp_path / "task.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n")
    driver = subprocess.Popen(
        RAY + ["--workers", "2", "--ps", "1", "--", sys.executable, str(script), marker],
        cwd=REPO, env=on_one_head, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    output = []
    try:
        for line in driver.stdout:
            output.append(line)
            if sum("] started" in o and "[keras-dist-ray]" not in o for o in output) == 4:
                break
        # 4 tasks and their 4 children; seen once (CI, stop 52) as 7 right
        # after the fourth "started", so the listing is retried for a while
        # and, if one is still missing, the failure shows each one's state.
        deadline = time.monotonic() + 20
        while True:
            tasks = [p for p in pids_with_marker(marker) if p != driver.pid]
            if len(tasks) == 8 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(tasks) == 8, "".join(output) + process_states(marker)
        driver.send_signal(signal.SIGTERM)
        output.extend(driver.stdout)
        driver.wait(120)
        assert driver.returncode == 130, "".join(output)
        assert "interrupted; stopping every task" in "".join(output)
        assert_nothing_left(marker, but=driver.pid)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        for pid in pids_with_marker(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_lost_chief_actor_restarts_the_job_from_its_backup(tmp_path, on_one_head):
    """SIGKILL the chief's actor (as when its node is lost) mid-epoch: its
    task dies with it, every other task is stopped, and the job starts again
    on new actors, resuming from BackupAndRestore's newest backup; every
    update is counted (at least once, as under keras-dist-run)."""
    epochs, steps = 3, 23
    def kill_the_chiefs_actor(line, output):
        if re.match(r"\[chief:0\] Epoch 2/", line):
            chief = int(re.findall(r"started chief:0 \(pid (\d+) on ", output)[0])
            with open(f"/proc/{chief}/stat") as f:
                actor = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent
            os.kill(actor, signal.SIGKILL)
            return actor

    code, text, actor = drive(["--workers", "2", "--ps", "1", "--", sys.executable,
                               "tests/scripts/preempt_train.py", str(tmp_path),
                               str(tmp_path / "backup"), str(epochs), "10"],
                              kill_the_chiefs_actor, on_one_head)
    assert actor is not None and code == 0, text[-4000:]
    assert re.search(r"chief:0 was killed by SIGKILL; restarting the job \(1/3\), resuming "
                     r"from \S+backup\S*", text), text[-4000:]
    assert len(re.findall(r"cluster: 1 chief, 2 workers, 1 ps from Ray", text)) == 1
    assert len(re.findall(r"started chief:0 ", text)) == 2
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["restored_step"] is not None, result  # the second job resumed
    history = {k: ((result["restored_history"] or {}).get(k, []) + v)
               for k, v in result["history"].items()}
    assert len(history["loss"]) == epochs
    assert 0 <= result["version"] - epochs * steps <= 4, result["version"]
    assert_nothing_left(str(tmp_path))


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_docs_page_examples_run(tmp_path, on_one_head):
    """docs/ray.md's examples, which the docs test leaves to this one (their
    `covered` markers name it: Ray is an extra), run here as pasted: the
    command in a fresh directory beside the clone's examples/, the function
    block as a file of its own."""
    from docblocks import parse_page

    def ours(block):
        return (block.marker("covered") or "").startswith(
            "tests/test_ray.py::test_the_docs_page_examples_run ")

    blocks = [b for b in parse_page("docs/ray.md") if ours(b)]
    assert [b.kind for b in blocks] == ["shell", "python"], blocks
    # docs/where-to-run.md shows the same command, which this test runs.
    elsewhere = [b.code for b in parse_page("docs/where-to-run.md") if ours(b)]
    assert elsewhere == [blocks[0].code], elsewhere
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    (tmp_path / "example.py").write_text(blocks[1].code)
    env = on_one_head  # `python` is this clone's, on the driver and the actors
    for argv, promise in ((["bash", "-eo", "pipefail", "-c", blocks[0].code],
                           "[chief:0] Epoch 2/2"),
                          (["python", "example.py"], "exit code 0")):
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                              timeout=240, env=env)
        assert proc.returncode == 0 and promise in proc.stdout, \
            proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_nothing_left(str(tmp_path))


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_taken_port_restarts_the_job_on_new_actors_and_ports(tmp_path, on_one_head):
    """Another program listens on worker 1's port on its node: the task says
    so in one line, its actor confirms it on that node, and the job restarts
    on new ports (not worker 1 alone on the taken one)."""
    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir()
    out.mkdir()
    try:
        proc = run_cli(["--workers", "2", "--ps", "1", "--", sys.executable,
                        "tests/scripts/squat_port.py", "worker:1", str(state),
                        "tests/scripts/ps_train.py", str(out)], env=on_one_head)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
        port = int(re.search(r"\[worker:1\] squat_port: another program now listens on port "
                             r"(\d+)", output).group(1))
        assert f"[worker:1] keras_dist.cluster.ports.PortInUseError: worker:1 cannot start " \
               f"its TensorFlow server: port {port} is in use" in output, output[-6000:]
        said = [line for line in output.splitlines()
                if line.startswith("[keras-dist-ray]") and "restart" in line]
        assert said == [
            f"[keras-dist-ray] worker:1 could not listen on port {port}: it is in use by "
            "another program; restarting the job on new ports (1/3), no backup in force: "
            "starting afresh"], output[-6000:]
        result = json.loads((out / "result.json").read_text())
        assert result["version"] == result["iterations"] == result["scheduled_steps"] == 180
    finally:
        stop_squatter(state)


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_existing_ray_cluster_by_address_trains_and_is_left_running(tmp_path):
    """A Ray cluster started by another process, reached with --address: the
    job runs there, its actors go, and the cluster stays up for its owner."""
    # A cluster with token authentication, as Ray sets one up once a token
    # exists (~/.ray/auth_token), here with a token of the test's own.
    token = secrets.token_hex(32)
    auth = dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    with ray_holder(ray_env(**auth)) as (address, holder):
        args = ["--address", address, "--workers", "2", "--ps", "1", "--",
                sys.executable, "tests/scripts/ps_train.py", str(tmp_path)]
        # Without the token the driver is refused, and told what to set.
        proc = run_cli(args, env=ray_env(RAY_AUTH_MODE="disabled"))
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"ConnectionError: The Ray cluster at address={address!r} uses token "
            "authentication and refused this process's token. Set RAY_AUTH_MODE=token "
            "here, with the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
            "RAY_AUTH_TOKEN (see https://docs.ray.io/en/latest/ray-security/"
            "token-auth.html), and run again."), proc.stderr[-3000:]
        proc = run_cli(args, env=ray_env(**auth))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["version"] == result["iterations"] == result["scheduled_steps"] == 180
        assert_nothing_left(str(tmp_path))  # no task process, no task actor
        # The cluster is still up for its owner: a fresh driver connects.
        cpus = fresh_python(f"import os\nos.environ.update({auth!r})\n"
                            f"import ray\nray.init(address={address!r})\n"
                            "print(ray.cluster_resources()['CPU'])\n")
        assert cpus.strip().splitlines()[-1] == "2.0", cpus
        assert holder.poll() is None
