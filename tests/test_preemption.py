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
import pathlib
import re
import signal
import subprocess
import sys
import time
import warnings

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
        [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--ps", str(ps),
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


# The uninterrupted runs the tests compare against: made once per test run
# (shared by the xdist workers: conftest's `made_once`).
def _one_device_run(out):
    out = pathlib.Path(out)
    assert finish(train(out)) == 0


def _multiworker_run(out):
    out = pathlib.Path(out)
    reference_run = launch(out, ps=0)
    assert finish(reference_run) == 0, log(reference_run)[-3000:]


@pytest.fixture(scope="module")
def one_device_reference(made_once):
    """An uninterrupted one-process run of the script."""
    return result(made_once("preemption_one_device", _one_device_run))


@pytest.fixture(scope="module")
def multiworker_reference(made_once):
    """An uninterrupted job under `keras-dist-run --workers 2` (MultiWorkerMirrored),
    the reference of the tests that preempt the same job."""
    return result(made_once("preemption_multiworker", _multiworker_run))


def _sigterm_mid_epoch(out, strategy, at):
    """Runs the script (`strategy`: "auto" or "mirrored"), SIGTERMs it once
    it reported progress `at` and checks it backed up at the step after the
    signal and exited 75 promptly; returns its log and `(epoch, step)` of
    the backup in force."""
    proc = train(out, *([] if strategy == "auto" else [strategy]))
    try:
        wait_for(out, *at, proc)
        seen = progress(out)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
    finally:
        code = finish(proc, 60)
    exited_in = time.monotonic() - signalled
    assert code == 75, (strategy, code)
    assert exited_in < 20, (strategy, exited_in)  # the next step, a save and out: no grace period
    with open(out / "backup" / "latest.json") as f:
        name = json.load(f)["directory"]
    epoch, step = (int(n) for n in name.split("-")[1:])
    assert epoch == at[0] and seen[1] <= step <= seen[1] + 2, (strategy, name, seen)
    logs = sorted(out.glob("log-*.txt"), key=lambda p: int(p.stem[4:]))
    return logs[-1].read_text(), (epoch, step)


@pytest.mark.multiprocess
def test_sigterm_mid_epoch_saves_exits_75_and_the_reruns_match_an_uninterrupted_run(
        tmp_path, one_device_reference):
    """One process SIGTERMed mid-epoch 2 (of 3) backs up at the next step and
    exits 75; rerun under Mirrored (2 logical CPUs) it resumes there, and
    SIGTERMed mid-epoch 3 does the same; rerun on one device again it
    finishes with the weights, optimizer state and History of an
    uninterrupted run (up to Mirrored's float reassociation: its two
    replicas' gradients are summed)."""
    _, first = _sigterm_mid_epoch(tmp_path, "auto", (1, 5))
    log, second = _sigterm_mid_epoch(tmp_path, "mirrored", (2, 5))
    assert f"resuming from {tmp_path / 'backup'}/backup-{first[0]:06d}-{first[1]:09d} at " \
           f"epoch {first[0] + 1}, step {first[1]}" in log, log[-3000:]
    assert finish(train(tmp_path)) == 0
    resumed = result(tmp_path)
    assert (resumed["restored_epoch"], resumed["restored_step"]) == second
    assert resumed["epochs"] == [2]
    assert_same_run(resumed, one_device_reference, atol=1e-5)


@pytest.mark.multiprocess
def test_parameter_server_job_sigtermed_backs_up_exits_75_and_the_rerun_counts_every_update(
        tmp_path):
    """SIGTERM to `keras-dist-run --workers 2 --ps 1`, which passes it to
    every task at once, as Kubernetes does when it preempts a whole Job.
    The ps and the workers serve on until the chief has drained what was
    in flight and backed up (they used to stop at once, and the chief died
    on an UnavailableError with no backup); every task exits 75 and so does
    the launcher. The rerun resumes there and applies every update once.
    (The chief alone SIGTERMed: test_k8s_cluster's preempted chief pod.)"""
    proc = launch(tmp_path, ps=1)
    try:
        wait_for(tmp_path, 1, 5, proc)
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        code = finish(proc)
    took = time.monotonic() - signalled
    text = log(proc)
    assert code == 75, text[-3000:]
    assert took < 30, took
    assert re.search(r"\[chief:0\] keras_dist: SIGTERM: backed up at epoch 2, step \d+ in ",
                     text), text[-3000:]
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[{task}] keras_dist: {task} stops serving: the chief is done; exiting with " \
               "code 75 (preempted)" in text, text[-3000:]
    assert "UnavailableError" not in text, text[-3000:]
    rerun = launch(tmp_path, ps=1)
    assert finish(rerun) == 0, log(rerun)[-3000:]
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


def latest_pids(proc, roles):
    """{task: pid} of the tasks of `roles` as the launcher last started them."""
    found = {}
    for task, pid in re.findall(r"started ((?:\w+):\d+) \(pid (\d+)\)", log(proc)):
        if task.split(":")[0] in roles:
            found[task] = int(pid)
    return found


@pytest.mark.multiprocess
def test_multiworker_job_sigkilled_then_sigtermed_restarts_and_matches_an_uninterrupted_job(
        tmp_path, multiworker_reference):
    """`keras-dist-run --workers 2 --max-restarts 10` (MultiWorkerMirrored):
    worker 1 SIGKILLed (no warning, no save) in epoch 1, then, in epoch 2 of
    the restarted job, SIGTERM to every task at once, as a scheduler taking
    the nodes back. The launcher restarts the job each time: first from the
    newest periodic backup (save_freq 10), then from the one the workers
    wrote on SIGTERM at the step they agreed on. The job ends by itself with
    the weights, optimizer state and History of an uninterrupted job."""
    run = tmp_path / "preempted"
    proc = launch(run, ps=0, max_restarts=10)
    try:
        wait_for(run, 0, 15, proc)
        os.kill(latest_pids(proc, ("worker",))["worker:1"], signal.SIGKILL)
        wait_for(run, 1, 5, proc)  # the restarted job, in epoch 2 (1-based)
        for pid in latest_pids(proc, ("worker",)).values():
            os.kill(pid, signal.SIGTERM)
    finally:
        code = finish(proc)
    text = log(proc)
    assert code == 0, text[-3000:]
    restarts = re.findall(r"\[keras-dist-run\] (\w+:\d) (.*); restarting the job \((\d+)/10\), "
                          r"resuming from \S*/backup-(\d{6})-(\d{9})\n", text)
    assert len(restarts) == 2, text[-3000:]
    # The kill: from the newest periodic backup (SIGKILL after step 15: the
    # one of step 10, or of step 20 if training got there before the signal).
    assert restarts[0][:4] == ("worker:1", "was killed by SIGKILL", "1", "000000"), restarts
    assert restarts[0][4] in ("000000010", "000000020"), restarts
    # The preemption: from the backup the workers wrote at the step after
    # the signal (whichever worker the launcher saw exit first).
    task, why, count, epoch, step = restarts[1]
    assert task in ("worker:0", "worker:1"), restarts
    assert (why, count, epoch) == ("was preempted (saved a backup, exit code 75)", "2",
                                   "000001"), restarts
    resumed = result(run)
    assert (resumed["restored_epoch"], resumed["restored_step"]) == (1, int(step)), restarts
    assert resumed["restored_step"] >= 5
    assert_same_run(resumed, multiworker_reference)


@pytest.mark.multiprocess
def test_ps_then_each_worker_sigkilled_under_parameter_servers_the_job_finishes_by_itself(
        tmp_path):
    """`keras-dist-run --workers 2 --ps 1 --max-restarts 10`: SIGKILL (no
    warning, no save) to the ps in epoch 1, to worker 0 in epoch 2 and to
    worker 1 in epoch 3. The killed ps restarts the job, which resumes from
    the newest backup (save_freq 10); a killed worker is restarted alone
    while training goes on (TensorFlow reruns its steps on the other
    worker). The job ends by itself, every update counted, and it learned."""
    run = tmp_path / "killed"
    proc = launch(run, ps=1, max_restarts=10)
    try:
        for point, task in [((0, 18), "ps:0"), ((1, 10), "worker:0"), ((2, 5), "worker:1")]:
            wait_for(run, *point, proc)
            os.kill(latest_pids(proc, ("ps", "worker"))[task], signal.SIGKILL)
    finally:
        code = finish(proc, timeout=300)
    text = log(proc)
    assert code == 0, text[-3000:]
    # The ps: the whole job restarted, once, from the newest backup ...
    restarts = re.findall(r"\[keras-dist-run\] (\w+:\d) (.*); restarting the job \((\d+)/10\), "
                          r"resuming from \S*/backup-(\d{6})-(\d{9})\n", text)
    assert [r[:3] for r in restarts] == [("ps:0", "was killed by SIGKILL", "1")], text[-3000:]
    # ... each worker alone, once.
    for task in ("worker:0", "worker:1"):
        assert f"[keras-dist-run] {task} exited with code -9; restarting it (1/10)\n" in text, \
            text[-3000:]
    assert text.count("; restarting the job (") == 1, text[-3000:]
    assert text.count("; restarting it (") == 2, text[-3000:]
    resumed = result(run)
    # The job after the restart resumed from that backup, one from before
    # the kill (after step 18; one every 10 updates).
    epoch, step = int(restarts[0][3]), int(restarts[0][4])
    assert (resumed["restored_epoch"], resumed["restored_step"]) == (epoch, step), restarts
    assert epoch * STEPS + step >= 10, restarts
    # At least once: TF reruns a step whose worker died after it applied its
    # update; a backup is a snapshot taken while updates go on.
    assert 0 <= resumed["version"] - EPOCHS * STEPS <= 12, resumed["version"]
    history = full_history(resumed)
    assert len(history["loss"]) == EPOCHS and history["loss"][-1] < history["loss"][0], history


def _writes(backup):
    """The temporary directories of the backups being written in `backup`."""
    try:
        return {n for n in os.listdir(backup) if n.startswith(".writing-")}
    except FileNotFoundError:
        return set()


def _stopped(pid):
    """Whether every thread of process `pid` is stopped (SIGSTOP)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        except OSError:  # a thread that just ended
            pass
    return True


def _stop_mid_write(proc, backup, deadline):
    """Stops `proc`'s process group with SIGSTOP at a moment it is writing
    a backup (the write's temporary directory is there, and still is once
    every thread has stopped); returns that directory's name."""
    stale = _writes(backup)  # left by an earlier process
    while time.monotonic() < deadline:
        if _writes(backup) - stale:
            os.killpg(proc.pid, signal.SIGSTOP)
            stop_by = time.monotonic() + 30  # a thread in fsync stops once it returns
            while not _stopped(proc.pid):
                assert time.monotonic() < stop_by, "SIGSTOP did not stop the process"
                time.sleep(0.001)
            writing = _writes(backup) - stale
            if writing:
                return writing.pop()
            os.killpg(proc.pid, signal.SIGCONT)  # it had just finished: the next one
        assert proc.poll() is None, f"ended early with {proc.returncode}"
        time.sleep(0.001)
    raise AssertionError("no backup write seen in progress")


@pytest.mark.multiprocess
def test_sigkill_during_backup_writes_leaves_a_whole_backup_in_force(
        tmp_path, one_device_reference):
    """A backup after every step (much of the time is spent writing); the
    process is SIGKILLed twice: first in the middle of a write (seen from
    outside: the write's temporary directory is there while the process is
    stopped), then at a random moment. Each time the backup in force is
    whole (no damaged-file warning), the torn write stays out of force, and
    the run finished from the last one equals an uninterrupted one.

    Before the second kill, a job of this process asking for the same
    backup directory is refused (it is in use by the running one); after
    it, the killed job's lock file is still there and the run finished
    from the backup takes the directory: the lock died with its process."""
    from keras_dist.callbacks import BackupAndRestore

    backup = tmp_path / "backup"
    rng = np.random.default_rng(7)
    for mid_write in (True, False):
        before = progress(tmp_path)
        proc = train(tmp_path, save_freq=1)
        try:
            deadline = time.monotonic() + 60
            while (progress(tmp_path) <= before or not (backup / "latest.json").exists()) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            assert progress(tmp_path) > before and (backup / "latest.json").exists()
            if mid_write:
                torn = _stop_mid_write(proc, backup, deadline)
            else:
                with pytest.raises(ValueError, match=(
                        rf"backup_dir='{re.escape(str(backup))}' is in use by another running "
                        rf"job \(pid {proc.pid} on ")):
                    _tiny(tmp_path)(epochs=1)
                time.sleep(rng.uniform(0.1, 0.6))
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            finish(proc, 30)
        if mid_write:
            assert torn in _writes(backup), os.listdir(backup)  # it died mid-write
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a damaged backup in force would warn
            latest = BackupAndRestore(backup).latest()
        assert latest is not None
    assert os.path.exists(backup / ".lock")  # the killed job's lock file, no longer held
    assert finish(train(tmp_path, save_freq=1)) == 0
    assert_same_run(result(tmp_path), one_device_reference)


@pytest.mark.multiprocess
def test_a_multiworker_backup_resumes_in_one_process(tmp_path, one_device_reference):
    """Written by 2 MultiWorkerMirrored workers, resumed by one process on
    one device: the same global batches from the same position, so the same
    run up to the all-reduce's float reassociation."""
    proc = launch(tmp_path, ps=0, max_restarts=0)
    try:
        wait_for(tmp_path, 1, 5, proc)
        for pid in pids(proc, ("worker",), 2):
            os.kill(pid, signal.SIGTERM)
    finally:
        code = finish(proc)
    assert code == 75, log(proc)[-3000:]  # the job's exit says: preempted
    assert finish(train(tmp_path)) == 0
    resumed = result(tmp_path)
    assert resumed["restored_epoch"] == 1 and resumed["restored_step"] >= 5
    assert_same_run(resumed, one_device_reference, atol=1e-5)


# ------------------------------------------------------------ bad input
def _tiny_fit(callbacks, epochs):
    """`kd.fit` of a one-layer model on 64 examples, 8 steps an epoch."""
    import keras

    import keras_dist as kd

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        return model

    x = np.random.default_rng(0).normal(size=(64, 4))
    return kd.fit(build, x, x.sum(axis=1, keepdims=True), batch_size=8, epochs=epochs,
                  verbose=0, callbacks=callbacks)


def _tiny(tmp_path, **backup_kwargs):
    from keras_dist.callbacks import BackupAndRestore

    return lambda epochs: _tiny_fit(
        [BackupAndRestore(tmp_path / "backup", **backup_kwargs)], epochs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(save_freq=0), r"`save_freq` must be \"epoch\" or an integer number of steps >= 1\. "
                        r"Received: save_freq=0"),
    (dict(save_freq="hour"), r"Received: save_freq='hour'"),
    (dict(save_freq=2.5), r"Received: save_freq=2\.5"),
    (dict(grace_period=0), r"`grace_period` must be a number of seconds > 0 .*Received: "
                           r"grace_period=0"),
    (dict(grace_period=-30), r"Received: grace_period=-30"),
    (dict(keep=0), r"`keep` must be an integer >= 1"),
])
def test_bad_backup_settings_are_refused_naming_the_value(tmp_path, kwargs, message):
    from keras_dist.callbacks import BackupAndRestore

    with pytest.raises(ValueError, match=message):
        BackupAndRestore(tmp_path, **kwargs)


def test_a_damaged_newest_backup_falls_back_to_the_previous_one_naming_the_file(tmp_path):
    from keras_dist.callbacks import BackupAndRestore

    fit = _tiny(tmp_path, save_freq=3, delete_checkpoint=False)
    fit(epochs=2)  # 8 steps an epoch: backups at steps 3, 6 | 1, 4, 7 (keep=2)
    backup = BackupAndRestore(tmp_path / "backup")
    newest = backup.latest()
    assert (newest["epoch"], newest["step"]) == (1, 7)
    weights = os.path.join(newest["path"], "variables.npz")
    with open(weights, "r+b") as f:  # a torn write: half the file
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.warns(UserWarning, match=re.escape(
            f"skipping the damaged backup {newest['path']!r}: {weights} is damaged")):
        previous = backup.latest()
    assert (previous["epoch"], previous["step"]) == (1, 4)
    restorer = BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)
    with pytest.warns(UserWarning, match="skipping the damaged backup"):
        history = _tiny_fit([restorer], epochs=2)
    assert (restorer.restored_epoch, restorer.restored_step) == (1, 4)
    assert history.epoch == [1]


def test_mid_epoch_backups_under_keras_own_fit_are_refused_with_the_fix(tmp_path):
    import keras

    from keras_dist.callbacks import BackupAndRestore

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"save_freq=5\): backups within an epoch need "
                                         r"keras_dist's training loop.*keras_dist\.fit"):
        model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0,
                  callbacks=[BackupAndRestore(tmp_path, save_freq=5)])

