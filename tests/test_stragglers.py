"""Straggler detection and per-replica metrics on real local clusters.

The tests run `keras-dist-run` (asynchronous: chief, 2 workers, 1 ps;
synchronous: 2 MultiWorkerMirrored workers) with
tests/scripts/straggler_train.py, one cluster per shape training the cases
in turn (`run_phases`; the CPU-hog case, which pins the workers to cores,
has its own), and slow worker 1 the way real clusters
do, from outside its process: stopped and continued on a duty cycle
(`kd.testing.throttle`, what a container CPU quota does), or sharing its
core with CPU-bound processes (`kd.testing.cpu_hog` + `pin_process`); or
from inside, with the in-graph `KERAS_DIST_SLOW_WORKER` slowdown.

The detector runs with its default threshold (a worker costing 20% of the
job's time) over 50-step windows. In every shape the slowed worker must be
flagged by the time the job has done 2 windows of steps, and the other
never; equal workers, with a CPU hog loading the machine, never.
"""

import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from procs import REPO, check_counts, end_run

# The CPU-hog case took 182 s in a fresh-clone run on a 2-core machine
# whose host was oversubscribed (CI, 2026-12-04): room for a loaded host on top.
RUN_TIMEOUT = 540
# `alone`: a straggler is judged by its share of the job's time, which
# another cluster test on the machine would change.
pytestmark = [pytest.mark.multiprocess, pytest.mark.alone, pytest.mark.timeout(RUN_TIMEOUT + 60)]

WINDOW, THRESHOLD = 50, 0.2


def run(tmp_path, *, ps, epochs=8, outside=None, churn=0, threshold=THRESHOLD,
        batch=64, outside_from_epoch_2=False):
    """Runs the cluster; `outside(pids)` is entered once every task wrote
    its pid (a dict like {"worker1": 1234}), or with `outside_from_epoch_2`
    once the chief has finished its first epoch, and left when the run ends."""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_DIST_SLOW_WORKER"}
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--ps", str(ps),
           "--", sys.executable, "tests/scripts/straggler_train.py", str(tmp_path),
           str(epochs), str(WINDOW), str(threshold), str(churn), str(batch)]
    tasks = 2 + (2 if ps else 0)
    with open(tmp_path / "out.txt", "w") as out, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True) as proc:
        try:
            with contextlib.ExitStack() as stack:
                if outside is not None:
                    pids = _pids(tmp_path, tasks, proc)
                    if outside_from_epoch_2:
                        _wait_for(tmp_path / "progress", proc)
                    stack.enter_context(outside(pids))
                proc.wait(timeout=RUN_TIMEOUT)
        finally:
            _kill(proc, tmp_path)
    output = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, output[-6000:]
    with open(tmp_path / "result.json") as f:
        return json.load(f), output


def _kill(proc, folder):
    """Ends a run still going: the launcher and each task (pids in folder/pid.*)."""
    end_run(proc, [open(p).read() for p in glob.glob(str(folder / "pid.*"))])


def _pids(tmp_path, tasks, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = glob.glob(str(tmp_path / "pid.*"))
        if len(found) == tasks:
            time.sleep(0.1)  # written in one go; let the last one land
            return {os.path.basename(p)[4:]: int(open(p).read()) for p in found}
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-4000:]
        time.sleep(0.05)
    raise AssertionError(f"the tasks did not start within {timeout}s")


def _wait_for(path, proc, timeout=240, log=None):
    log = path.parent / "out.txt" if log is None else log
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.05)


def throttled(name, period, stopped):
    return lambda pids: kd.testing.throttle(pids[name], period=period, stopped=stopped)


@contextlib.contextmanager
def sharing_a_core(pids, name, other, hogs=2):
    """`name` and `hogs` busy processes on CPU 1, `other` alone on CPU 0."""
    kd.testing.pin_process(pids[other], {0})
    kd.testing.pin_process(pids[name], {1})
    with kd.testing.cpu_hog(hogs, cpus={1}):
        yield


# The asynchronous tests train in turn on ONE cluster (chief, 2 workers,
# 1 ps), and so do the MultiWorkerMirrored ones but the CPU-hog case (which
# pins the workers to cores): a cluster's TensorFlow processes cost more CPU
# to start than a phase takes to train. Each phase trains a fresh model
# with a fresh detector (kd.fit builds both), into its own folder; its
# slowdown from outside starts before its training (or after its first
# epoch) and ends with it, so none reaches the next phase.
ASYNC_PHASES = [  # (test, phase for the script, outside, outside_from_epoch_2)
    # A worker 4x slower, in-graph: KERAS_DIST_SLOW_WORKER=1:4 given to the
    # launcher, as docs/stragglers.md shows (the other phases unset it).
    # (10 epochs: the flag must come within two windows of each worker's
    # steps, 2 x 50 x 2 = 200 = 10 x 20.)
    ("test_async_slowed_worker_is_flagged_and_per_worker_metrics_add_up",
     {"name": "slowed", "epochs": 10, "slow": "launcher"}, None, False),
    # Stopped and continued from outside every 100 ms, 60% of it stopped.
    ("test_async_worker_throttled_from_outside_is_flagged",
     {"name": "throttled", "epochs": 12}, throttled("worker1", 0.1, 0.6), False),
    # Equal workers, a CPU hog from the first epoch's end on.
    ("test_equal_workers_on_a_loaded_machine_are_never_flagged[async]",
     {"name": "equal", "epochs": 12, "churn": 20}, lambda pids: kd.testing.cpu_hog(1), True),
]
MULTIWORKER_PHASES = [
    # Replica 1 10x slower, in-graph. 4 epochs of 20 steps, 19 judged each
    # (an epoch's first execution is not): the first full window is judged
    # in epoch 3, slowed all along.
    ("test_multiworker_slowed_replica_is_flagged_and_losses_average_to_keras",
     {"name": "slowed", "epochs": 4, "slow": "1:10"}, None, False),
    # Equal replicas, a CPU hog from the first epoch's end on: 6 epochs.
    ("test_equal_workers_on_a_loaded_machine_are_never_flagged[multiworker]",
     {"name": "equal", "epochs": 6}, lambda pids: kd.testing.cpu_hog(1), True),
    # Worker 1 stopped half of every 100 ms (last: nothing follows it). 2
    # epochs of 80 steps: 158 judged; the flag must come by step 100.
    ("test_multiworker_worker_throttled_from_outside_is_flagged",
     {"name": "throttled", "epochs": 2, "batch": 16}, throttled("worker1", 0.1, 0.5), False),
]


def run_phases(request, root, ps, phases, slow=None):
    """Runs the `phases` (of PHASES lists above) of the tests selected in
    turn on one cluster, the launcher given KERAS_DIST_SLOW_WORKER=`slow`;
    {phase name: (result, what was printed during it, its folder)}."""
    selected = {item.name for item in request.session.items}
    phases = [p for p in phases if p[0] in selected]
    plan = [phase for _, phase, _, _ in phases]
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--ps", str(ps),
           "--", sys.executable, "tests/scripts/straggler_train.py", str(root), "phases",
           str(WINDOW), str(THRESHOLD), json.dumps(plan)]
    env = {k: v for k, v in os.environ.items() if k != "KERAS_DIST_SLOW_WORKER"}
    if slow:
        env["KERAS_DIST_SLOW_WORKER"] = slow
    log = root / "out.txt"
    with open(log, "w") as out, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True) as proc:
        try:
            pids = _pids(root, 4 if ps else 2, proc)
            for _, phase, outside, from_epoch_2 in phases:
                folder = root / phase["name"]
                _wait_for(folder / "ready", proc, log=log)
                with contextlib.ExitStack() as stack:
                    if outside is not None and not from_epoch_2:
                        stack.enter_context(outside(pids))
                    (folder / "go").touch()
                    if outside is not None and from_epoch_2:
                        _wait_for(folder / "progress", proc, log=log)
                        stack.enter_context(outside(pids))
                    _wait_for(folder / "result.json", proc, timeout=RUN_TIMEOUT, log=log)
            proc.wait(timeout=120)
        finally:
            _kill(proc, root)
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    printed, name = {}, None  # the launcher's output, cut at the chief's phase lines
    for line in output.splitlines():
        found = re.match(r"\[(?:chief|worker):0\] \[phase\] (\w+)$", line)
        if found:
            name = found.group(1)
            printed[name] = []
        elif name is not None:
            printed[name].append(line)
    results = {}
    for _, phase, _, _ in phases:
        with open(root / phase["name"] / "result.json") as f:
            results[phase["name"]] = (json.load(f), "\n".join(printed.get(phase["name"], [])),
                                      root / phase["name"])
    return results


@pytest.fixture(scope="module")
def async_phases(request, tmp_path_factory):
    return run_phases(request, tmp_path_factory.mktemp("stragglers_async"), 1, ASYNC_PHASES,
                      slow="1:4")


@pytest.fixture(scope="module")
def multiworker_phases(request, tmp_path_factory):
    return run_phases(request, tmp_path_factory.mktemp("stragglers_multiworker"), 0,
                      MULTIWORKER_PHASES)


def scalars(event_dir):
    """{tag: [values by step]} read back from TensorBoard event files."""
    found = {}
    for path in sorted(glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor)))
    return found


def assert_flags_only(result, straggler, threshold=THRESHOLD):
    """Only `straggler` is flagged, first by the time the job has done two
    windows of steps (asynchronous: two windows per worker)."""
    events = result["events"]
    assert events, f"the slowed worker was never flagged; costs {result['costs']}"
    assert {e["worker"] for e in events} == {straggler}, events
    first = events[0]
    assert first["flagged"] and first["cost"] >= threshold, first
    job_steps = (max(first["counts"].values()) if straggler.startswith("replica")
                 else sum(first["counts"].values()))
    workers = 1 if straggler.startswith("replica") else 2
    assert job_steps <= 2 * WINDOW * workers, first
    return first


def check_tensorboard(tmp_path, history, names):
    """One TensorBoard run per worker, holding the logged scalars per epoch."""
    assert sorted(os.listdir(tmp_path / "tb")) == names
    for name in names:
        found = scalars(tmp_path / "tb" / name)
        assert {"loss", "step_time", "examples_per_sec", "updates"} <= set(found), found
        assert found["updates"] == history[f"{name}/updates"]
        np.testing.assert_allclose(found["loss"], history[f"{name}/loss"], rtol=1e-5)
        np.testing.assert_allclose(found["step_time"], history[f"{name}/step_time"],
                                   rtol=1e-5)


@pytest.mark.compat("callbacks")
def test_async_slowed_worker_is_flagged_and_per_worker_metrics_add_up(async_phases):
    # A worker 4x slower does about 1/5 of the updates, so the job loses
    # ~3/5 of its share: ~30% of the cluster's throughput.
    result, output, tmp_path = async_phases["slowed"]
    assert_flags_only(result, "worker1")
    history, totals = result["history"], result["totals"]
    assert history["straggler_cost/worker1"][-1] >= THRESHOLD / 2  # still flagged
    assert history["straggler_cost/worker0"][-1] == 0.0
    # Its computation explains why: the compute score.
    assert history["straggler_score/worker0"][-1] == 1.0
    assert history["straggler_score/worker1"][-1] < 0.5
    # Its own step time, as the metrics callback measured it, is the longest.
    assert totals["worker1"]["step_time"] > 2 * totals["worker0"]["step_time"]
    # Every update is some worker's: per-worker updates sum to the steps.
    epochs = len(history["loss"])
    assert sum(t["updates"] for t in totals.values()) == result["version"] == epochs * 20
    for epoch in range(epochs):
        assert history["worker0/updates"][epoch] + history["worker1/updates"][epoch] == 20
    # The fast worker did more of them; the slow one's updates were staler.
    assert totals["worker0"]["updates"] > totals["worker1"]["updates"]
    assert totals["worker1"]["staleness_mean"] > totals["worker0"]["staleness_mean"]
    assert max(t["staleness_max"] for t in totals.values()) == max(history["staleness_max"])
    # The chief printed the table.
    assert "[chief:0] " in output and "per-worker training summary" in output
    check_tensorboard(tmp_path, history, ["worker0", "worker1"])
    for name in ("worker0", "worker1"):
        assert {"staleness_mean", "staleness_max"} <= set(scalars(tmp_path / "tb" / name))


def test_multiworker_slowed_replica_is_flagged_and_losses_average_to_keras(
        multiworker_phases):
    result, output, tmp_path = multiworker_phases["slowed"]
    assert_flags_only(result, "replica1")
    history, totals = result["history"], result["totals"]
    assert history["straggler_cost/replica1"][-1] >= THRESHOLD / 2  # still flagged
    assert history["straggler_score/replica0"][-1] == 1.0
    assert totals["replica1"]["step_time"] > 2 * totals["replica0"]["step_time"]
    # Equal batches on both replicas: the mean of their losses is Keras' loss.
    mean = (np.array(history["replica0/loss"]) + np.array(history["replica1/loss"])) / 2
    np.testing.assert_allclose(mean, history["loss"], rtol=1e-5)
    assert history["replica0/loss"] != history["replica1/loss"]
    epochs = len(history["loss"])
    assert history["replica0/updates"] == history["replica1/updates"] == [20] * epochs
    # Only the chief (worker 0) prints the table.
    summaries = [line for line in output.splitlines() if "per-replica training summary" in line]
    assert len(summaries) == 1 and summaries[0].startswith("[worker:0]"), summaries
    check_tensorboard(tmp_path, history, ["replica0", "replica1"])


# ------------------------------------------------- slowdowns from outside
def test_multiworker_worker_throttled_from_outside_is_flagged(multiworker_phases):
    # Stopped and continued from outside: its computation is as fast as
    # ever when it runs, but the other worker waits for it at the all-reduce.
    # Half of every 100 ms: the period of the kernel's CPU quota (CFS), what
    # a container's CPU limit does. 80 steps per epoch: with 20, a third of
    # the wall time is the chief's work between epochs, and a stop that
    # falls there (while nobody waits for worker 1) rightly costs nothing.
    # (A 500 ms cycle, 40% stopped, ran here too until issue 46: the same
    # detector, the same throttle, a cycle no quota uses, 40 s of the
    # suite's `alone` time; at 30% its cost swung between 0.06 and 0.36
    # across 50-step windows, which hold only one or two such cycles.)
    # (MULTIWORKER_PHASES' "throttled".)
    result, _, _ = multiworker_phases["throttled"]
    assert_flags_only(result, "replica1")
    # Worker 0 was never flagged (above); its last window's cost is the
    # noise two equal replicas trade on a shared machine, which the detector
    # documents as under 15%. (This asserted under 10% until a CI run, with
    # an in-process test busy on the other xdist worker, saw 0.102.)
    costs = result["costs"]
    assert costs["replica0"] < 0.15 and costs["replica0"] < costs["replica1"], costs


@pytest.mark.whole_machine  # worker 0's core must be its own (CI: cost 0.07 beside other tests)
def test_multiworker_worker_sharing_its_core_with_cpu_hogs_is_flagged(tmp_path):
    # A worker that mostly waits for the network hardly notices a hog (the
    # scheduler favours a thread that wakes up), and costs the job little:
    # the detector says so. Here the steps are CPU-bound (300 fixed matrix
    # products each), the hogs make worker 1's computation twice as slow,
    # and the job waits for it ~15% of its time: flagged at 10%.
    # 3 epochs of 20 steps: the detector judges every step from step 50 on
    # (its first full window), and stepping beside three hogs is slow (this
    # was the suite's slowest test: 202 s at 8 epochs, 122-181 s at 6, 77 s
    # at 4 in CI). The flag came at step 51, at cost 0.365 against the 0.1
    # threshold, in every run we looked at; the hogs burn a core for as
    # long as the test runs, so one more epoch of margin was cut (issue 46:
    # the assertion's bound, step 100, is past the run's end). The hogs start
    # after the first epoch: starting TensorFlow and tracing beside them took
    # most of the test's time, and the first judged window still has 30
    # slowed steps of its 50.
    result, _ = run(tmp_path, ps=0, epochs=3, churn=300, threshold=0.1,
                    outside=lambda pids: sharing_a_core(pids, "worker1", "worker0", hogs=3),
                    outside_from_epoch_2=True)
    first = assert_flags_only(result, "replica1", threshold=0.1)
    # And its computation says why: it computes slower than the other replica.
    # (Not a fixed bound: with another busy process on the machine, worker 0's
    # core is shared too; a fresh-clone run beside a busy loop saw 0.806
    # where quiet runs see ~0.52.)
    assert first["scores"]["replica1"] < first["scores"]["replica0"], first


def test_async_worker_throttled_from_outside_is_flagged(async_phases):
    # It picks its work up late and does fewer of the updates. (12 epochs:
    # the flag must come within 10, two windows of each worker's steps.)
    result, _, _ = async_phases["throttled"]
    assert_flags_only(result, "worker1")
    totals = result["totals"]
    assert totals["worker0"]["updates"] > 1.5 * totals["worker1"]["updates"]
    # Stopped and continued every 100 ms, no step of it is lost or counted
    # twice (test_stalls' duty cycles check the same with longer executions
    # and local steps).
    assert check_counts(result)["lost"] == 0, result["step_counts"]


@pytest.mark.parametrize("ps", [1, 0], ids=["async", "multiworker"])
def test_equal_workers_on_a_loaded_machine_are_never_flagged(request, ps):
    # A CPU-bound process competes with the cluster on this 2-core machine.
    # Asynchronous steps got about twice as fast (issue 12) and their epoch
    # boundaries cheaper (issue 34); CPU-bound work per step (20 matrix
    # products) keeps each judged window long in time, so a few scheduler
    # slices to the hog do not decide it (with 10, a full-suite run flagged
    # worker 1 once, cost 0.25).
    # The hog starts after the first epoch (starting TensorFlow beside it
    # only made the test longer: the detector judges nothing before a full
    # window). Asynchronous: 12 epochs x 20 steps shared by 2 workers;
    # synchronous: 6 epochs x 20 steps on each replica.
    # (ASYNC_PHASES' and MULTIWORKER_PHASES' "equal".)
    phases = "async_phases" if ps else "multiworker_phases"
    result, _, _ = request.getfixturevalue(phases)["equal"]
    # Every worker was judged at least twice over (each step from its 50th).
    assert min(result["counts"].values()) >= 2 * WINDOW
    assert result["events"] == [], result["events"]


def test_the_slow_worker_injection_says_when_it_is_active(kd_messages, monkeypatch):
    # A slowed worker must never be a silent surprise in a log. (os.environ
    # is a private copy in tests: see conftest.)
    from keras_dist import testing as kd_testing

    lines = kd_messages
    monkeypatch.delenv("KERAS_DIST_SLOW_WORKER", raising=False)
    assert kd_testing.faults_from_env().slowed == {}
    assert lines == []
    monkeypatch.setenv("KERAS_DIST_SLOW_WORKER", "1:3,0:1.5")
    assert kd_testing.faults_from_env().slowed == {1: 3.0, 0: 1.5}
    assert lines == ["keras_dist: KERAS_DIST_SLOW_WORKER=1:3,0:1.5: slowing worker 0 x1.5, "
                     "worker 1 x3 (fault injection for tests and demos)"]
