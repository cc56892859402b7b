"""Peers that never come, and scripts that never hand over (issue 32, items 2 and 4).

From outside, as a cluster would see it: real processes on loopback with
free ports, stopped with real signals.

- A MultiWorkerMirrored worker whose peer never starts fails within
  `connect_timeout` naming the missing task (TensorFlow's own wait has no
  limit), and SIGTERM ends its wait.
- SIGTERM still ends a MultiWorkerMirrored task once the strategy is built
  (TensorFlow's preemption notifier swallowed it).
- Keras' own `model.fit` on any task of a parameter-server cluster fails
  with keras_dist's error before anything trains: with keras_dist imported
  first, and under `keras-dist-run` for a script that never imports it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist import ClusterConfig

from procs import REPO, ProcessGroup

pytestmark = pytest.mark.multiprocess

LONE = """
import sys, time
import keras_dist as kd
start = time.monotonic()
try:
    kd.resolve_strategy(connect_timeout=float(sys.argv[1]))
except TimeoutError as error:
    print("TIMEOUT", round(time.monotonic() - start, 1), error, flush=True)
    sys.exit(3)
print("BUILT", flush=True)
"""

PAIR = """
import time
import keras_dist as kd
strategy = kd.resolve_strategy()
import tensorflow as tf
total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
print("READY", float(total), flush=True)
time.sleep(300)
"""


def _script(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def _wait_for(proc, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(proc.log_path) as f:
            if text in f.read():
                return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    with open(proc.log_path) as f:
        raise AssertionError(f"{text!r} not seen in {timeout} s:\n{f.read()[-3000:]}")


def test_a_lone_multiworker_task_fails_in_time_naming_its_peer(tmp_path):
    cluster = ClusterConfig.local(workers=2)
    missing = cluster.cluster["worker"][1]
    with ProcessGroup() as group:
        proc = group.start("worker0", [_script(tmp_path, "lone.py", LONE), "4"],
                           env_extra={"TF_CONFIG": cluster.for_task("worker", 0).to_tf_config()},
                           log_dir=str(tmp_path))
        codes = group.wait(timeout=60)
        log = open(proc.log_path).read()
    assert codes == {"worker0": 3}, log
    assert f"worker:1 at {missing}" in log and "(this task: worker:0)" in log, log
    waited = float(log.split("TIMEOUT ")[1].split()[0])
    assert 4 <= waited < 30, log


def test_sigterm_ends_a_lone_multiworker_task_waiting_for_its_peer(tmp_path):
    cluster = ClusterConfig.local(workers=2)
    with ProcessGroup() as group:
        proc = group.start("worker0", [_script(tmp_path, "lone.py", LONE), "600"],
                           env_extra={"TF_CONFIG": cluster.for_task("worker", 0).to_tf_config()},
                           log_dir=str(tmp_path))
        _wait_for(proc, "using multi_worker strategy", 60)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == -signal.SIGTERM, open(proc.log_path).read()


def test_sigterm_ends_a_multiworker_task_after_the_strategy_is_built(tmp_path):
    cluster = ClusterConfig.local(workers=2)
    script = _script(tmp_path, "pair.py", PAIR)
    with ProcessGroup() as group:
        procs = [group.start(f"worker{i}", [script], log_dir=str(tmp_path),
                             env_extra={"TF_CONFIG": cluster.for_task("worker", i).to_tf_config()})
                 for i in range(2)]
        for proc in procs:
            _wait_for(proc, "READY 2.0", 120)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(15) == -signal.SIGTERM, group.logs()


PLAIN_FIT = """
import sys
if sys.argv[1:] == ["resolve"]:
    import keras_dist as kd
    strategy = kd.resolve_strategy()
import keras
import numpy as np
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
print("FIT", flush=True)
model.fit(np.ones((64, 4)), np.ones((64, 1)), epochs=50, verbose=0)
print("TRAINED ON ITS OWN", flush=True)
"""


@pytest.mark.parametrize("mode", ["plain", "resolve"])
def test_keras_own_fit_is_refused_on_every_task_of_a_parameter_server_job(tmp_path, mode):
    """`plain`: the script never imports keras_dist (the launcher's
    start-up hook guards it); `resolve`: `kd.resolve_strategy()` first, then
    Keras' fit (the chief got TensorFlow's raw "create_per_worker_dataset"
    error; the worker and ps tasks trained on their own)."""
    script = _script(tmp_path, "plain_fit.py", PLAIN_FIT)
    command = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "1", "--ps", "1",
               "--max-restarts", "0", "--", sys.executable, script]
    if mode == "resolve":
        command.append("resolve")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    out = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=180)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert "TRAINED ON ITS OWN" not in log
    assert "[chief:0] RuntimeError: keras_dist: Keras' own model.fit was called on chief:0 " \
           "of a parameter-server cluster (TF_CONFIG names 1 ps task(s))" in log, log
    assert "create_per_worker_dataset" not in log
