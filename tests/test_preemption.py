"""Preemption from outside: SIGTERM and SIGKILL to real training processes.

tests/scripts/preempt_train.py trains digits deterministically with
kd.callbacks.BackupAndRestore(save_freq=10 steps) and writes its progress
after every batch. A test signals the processes mid-epoch, as a scheduler
does, and reruns (or lets keras-dist-run restart the job). A resumed
synchronous run must end with the weights, optimizer state and History of
an uninterrupted one; asynchronous training with the parameter version
counting every update once.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from procs import REPO

SCRIPT = os.path.join(REPO, "tests/scripts/preempt_train.py")
EPOCHS = 3
STEPS = 23  # digits' 1437 training examples in batches of 64


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",
                                                            "KERAS_DIST_STRATEGY")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    return env


def train(out, *extra, epochs=EPOCHS, save_freq=10):
    """Starts the script in one process; returns the Popen."""
    os.makedirs(out, exist_ok=True)
    output = open(os.path.join(out, f"log-{time.monotonic_ns()}.txt"), "w")
    return subprocess.Popen(
        [sys.executable, SCRIPT, str(out), str(out / "backup"), str(epochs), str(save_freq),
         *extra], cwd=REPO, env=_env(), stdout=output, stderr=subprocess.STDOUT,
        start_new_session=True)


def launch(out, *, ps, max_restarts=2, epochs=EPOCHS, save_freq=10):
    """Starts keras-dist-run; its output goes to out/launcher.txt (`log`)."""
    os.makedirs(out, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.launch", "--workers", "2", "--ps", str(ps),
         "--max-restarts", str(max_restarts), "--", sys.executable, SCRIPT, str(out),
         str(out / "backup"), str(epochs), str(save_freq)],
        cwd=REPO, env=_env(), stdout=open(out / "launcher.txt", "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    proc.out = out
    return proc


def log(proc):
    return (proc.out / "launcher.txt").read_text()


def finish(proc, timeout=240):
    """Waits for `proc` (killing its group on timeout); returns its code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"did not finish in {timeout} s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def progress(out):
    """`(epoch, steps done)` the chief reported last, or `(-1, 0)`."""
    try:
        epoch, step = (out / "progress").read_text().split()
        return int(epoch), int(step)
    except (OSError, ValueError):
        return -1, 0


def wait_for(out, epoch, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while progress(out) < (epoch, step):
        assert proc.poll() is None, f"ended early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no progress to {(epoch, step)}: {progress(out)}"
        time.sleep(0.01)


def result(out):
    with open(out / "result.json") as f:
        res = json.load(f)
    with np.load(out / "final.npz") as f:
        res["arrays"] = [f[k] for k in f.files]
    return res


def full_history(res):
    """The History of the whole run: the epochs before the restored backup,
    then those this process trained."""
    before = res["restored_history"] or {}
    return {k: list(before.get(k, [])) + list(v) for k, v in res["history"].items()}


def assert_same_run(resumed, reference, atol=1e-6):
    assert len(resumed["arrays"]) == len(reference["arrays"])
    for a, b in zip(resumed["arrays"], reference["arrays"]):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    ours, theirs = full_history(resumed), full_history(reference)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], atol=atol, rtol=0,
                                   err_msg=name)


def pids(proc, roles, count):
    """The pids of the first `count` tasks of `roles` the launcher started."""
    deadline = time.monotonic() + 60
    while True:
        found = [int(p) for role, p in re.findall(r"started (\w+):\d+ \(pid (\d+)\)",
                                                  log(proc)) if role in roles]
        if len(found) >= count or time.monotonic() > deadline:
            return found[:count]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def one_device_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert finish(train(out)) == 0
    return result(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["auto", "mirrored"], ids=["one-device", "mirrored"])
def test_sigterm_mid_epoch_saves_exits_75_and_the_rerun_matches_an_uninterrupted_run(
        tmp_path, strategy, one_device_reference):
    extra = [] if strategy == "auto" else [strategy]
    proc = train(tmp_path, *extra)
    try:
        wait_for(tmp_path, 1, 5, proc)  # epoch 2 (1-based) of 3, after its step 5
        at = progress(tmp_path)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
    finally:
        code = finish(proc, 60)
    exited_in = time.monotonic() - signalled
    assert code == 75, code
    assert exited_in < 20, exited_in  # the next step, a save and out: not a grace period
    with open(tmp_path / "backup" / "latest.json") as f:
        name = json.load(f)["directory"]
    epoch, step = (int(n) for n in name.split("-")[1:])
    assert epoch == 1 and at[1] <= step <= at[1] + 2, (name, at)  # the step after the signal
    assert finish(train(tmp_path, *extra)) == 0
    resumed = result(tmp_path)
    assert (resumed["restored_epoch"], resumed["restored_step"]) == (epoch, step)
    assert resumed["epochs"] == [1, 2]
    # Mirrored sums two replicas' gradients: the same run up to reassociation.
    assert_same_run(resumed, one_device_reference, atol=1e-6 if strategy == "auto" else 1e-5)


@pytest.mark.multiprocess
def test_multiworker_job_sigtermed_on_every_task_restarts_and_matches_an_uninterrupted_job(
        tmp_path):
    reference_run = launch(tmp_path / "reference", ps=0)
    assert finish(reference_run) == 0, log(reference_run)[-3000:]
    reference = result(tmp_path / "reference")
    run = tmp_path / "preempted"
    proc = launch(run, ps=0)
    try:
        wait_for(run, 1, 5, proc)
        # Like a scheduler taking the nodes back: every task at once.
        for pid in pids(proc, ("worker",), 2):
            os.kill(pid, signal.SIGTERM)
    finally:
        code = finish(proc)
    text = log(proc)
    assert code == 0, text[-3000:]
    assert re.search(r"worker:\d was preempted \(saved a backup, exit code 75\); restarting "
                     r"the job \(1/2\), resuming from .*backup-000001-0000000\d\d", text), \
        text[-3000:]
    resumed = result(run)
    assert resumed["restored_epoch"] == 1 and resumed["restored_step"] >= 5
    assert_same_run(resumed, reference)


@pytest.mark.multiprocess
def test_parameter_server_chief_sigtermed_drains_saves_and_the_job_counts_every_update(
        tmp_path):
    proc = launch(tmp_path, ps=1)
    try:
        wait_for(tmp_path, 1, 5, proc)
        chief = pids(proc, ("chief",), 1)
        os.kill(chief[0], signal.SIGTERM)
    finally:
        code = finish(proc)
    text = log(proc)
    assert code == 0, text[-3000:]
    assert "chief:0 was preempted (saved a backup, exit code 75); restarting the job " \
           "(1/2), resuming from" in text, text[-3000:]
    resumed = result(tmp_path)
    assert resumed["restored_epoch"] == 1
    # What was in flight finished before the backup: every update counted
    # once, none repeated (no worker failed here).
    assert resumed["version"] == EPOCHS * STEPS, resumed["version"]
    counts = resumed["step_counts"]
    assert counts["scheduled"] == counts["finished"] == EPOCHS * STEPS - (
        STEPS + resumed["restored_step"]), counts
    history = full_history(resumed)
    assert len(history["loss"]) == EPOCHS and history["loss"][-1] < history["loss"][0]
