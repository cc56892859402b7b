"""StragglerDetector, PerReplicaMetrics and keras_dist.testing in one process.

The cluster runs (async and MultiWorkerMirrored) are in test_stragglers.py.
Here: the detector's rule on seeded step-time distributions, the callbacks
under MirroredStrategy (2 logical CPUs) and under Keras' own loop, the
TensorBoard files, the table, and the in-graph slowdown.
"""

import glob
import logging
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.callbacks import ReplicaStep, StragglerDetector, StragglerError
from keras_dist.datasets import load_digits
from conftest import CPUS


def feed(detector, times_by_worker, start_batch=0):
    """Feeds one step per worker per batch; returns the batches fed."""
    n = len(next(iter(times_by_worker.values())))
    for i in range(n):
        batch = start_batch + i
        detector.on_replica_steps(batch, [ReplicaStep(w, 1, float(t[i]))
                                          for w, t in times_by_worker.items()])
        detector.on_train_batch_end(batch, {})
    return n


# ----------------------------------------------------------------- the rule
@pytest.mark.parametrize("seed", range(10))
def test_a_3x_slower_worker_is_flagged_within_two_windows(seed):
    rng = np.random.default_rng(seed)
    window, workers = 50, 4
    calls = []
    detector = StragglerDetector(window=window, action=lambda *a: calls.append(a))
    times = {f"worker{w}": 0.01 * rng.lognormal(0.0, 0.3, 2 * window) for w in range(workers)}
    times["worker2"] *= 3.0
    feed(detector, times)
    assert [c[0] for c in calls] == ["worker2"]
    assert detector.stragglers == {"worker2"}
    assert 0.2 < detector.scores["worker2"] < 0.5
    assert detector.events[0][0] < 2 * window  # the batch it was flagged at


@pytest.mark.parametrize("seed", range(10))
def test_equal_workers_are_not_flagged(seed):
    rng = np.random.default_rng(100 + seed)
    detector = StragglerDetector(window=50, action=lambda *a: pytest.fail(f"flagged {a}"))
    # 1000 steps each with a 20% log-normal spread, 8 workers. (At 30% the
    # fastest of 8 medians of 50 is, now and then, 1/0.75 of the slowest.)
    feed(detector, {f"worker{w}": 0.01 * rng.lognormal(0.0, 0.2, 1000) for w in range(8)})
    assert detector.stragglers == set() and len(detector.scores) == 8


def test_recovery_needs_the_recovery_score_not_just_the_threshold():
    detector = StragglerDetector(window=4, threshold=0.5, recovery=0.9,
                                 action=lambda *a: None)  # seconds: gaps >= 1 ms
    feed(detector, {"a": [1.0] * 4, "b": [3.0] * 4})
    assert detector.stragglers == {"b"}
    feed(detector, {"a": [1.0] * 4, "b": [1.5] * 4}, start_batch=4)  # score 0.67
    assert detector.stragglers == {"b"}
    feed(detector, {"a": [1.0] * 4, "b": [1.05] * 4}, start_batch=8)  # score 0.95
    assert detector.stragglers == set()
    assert [(e[1], e[3]) for e in detector.events] == [("b", "flagged"), ("b", "recovered")]


def test_warn_logs_one_line_per_change_of_state():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("keras_dist")
    logger.addHandler(handler)
    try:
        detector = StragglerDetector(window=4)
        feed(detector, {"worker0": [0.01] * 12, "worker1": [0.04] * 12})
        feed(detector, {"worker0": [0.01] * 12, "worker1": [0.01] * 12}, start_batch=12)
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 2, lines
    assert lines[0] == ("worker1 is a straggler: median step 40.0 ms vs 10.0 ms on worker0 "
                        "(last 4 steps each), score 0.25 < threshold 0.75."), lines[0]
    assert lines[1].startswith("worker1 is no longer a straggler: median step 10.0 ms")


def test_raise_stops_with_a_message_naming_the_worker():
    detector = StragglerDetector(window=3, action="raise")
    with pytest.raises(StragglerError, match=r"worker1 is a straggler at batch 2: .*score 0\.50"):
        feed(detector, {"worker0": [0.01] * 3, "worker1": [0.02] * 3})


def test_sub_millisecond_differences_are_not_flagged():
    detector = StragglerDetector(window=4, action=lambda *a: None)
    feed(detector, {"a": [0.0001] * 8, "b": [0.0004] * 8})  # 4x, but 0.3 ms
    assert detector.scores["b"] == pytest.approx(0.25) and detector.stragglers == set()
    detector = StragglerDetector(window=4, min_gap=0.0, action=lambda *a: None)
    feed(detector, {"a": [0.0001] * 8, "b": [0.0004] * 8})
    assert detector.stragglers == {"b"}


def test_steps_per_execution_counts_every_step():
    detector = StragglerDetector(window=10, min_steps=10, min_gap=0, action=lambda *a: None)
    detector.on_replica_steps(0, [ReplicaStep("w0", 5, 0.05), ReplicaStep("w1", 5, 0.5)])
    assert detector.scores == {}  # 5 of the 10 steps needed
    detector.on_replica_steps(1, [ReplicaStep("w0", 5, 0.05), ReplicaStep("w1", 5, 0.5)])
    assert detector.scores == {"w0": 1.0, "w1": pytest.approx(0.1)}


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 1}, "`window` must be an integer >= 2"),
    ({"window": 2.5}, "`window` must be an integer >= 2"),
    ({"threshold": 0.0}, "`threshold` must be a number strictly between 0 and 1"),
    ({"threshold": 1.0}, "`threshold` must be a number strictly between 0 and 1"),
    ({"threshold": "0.5"}, "`threshold` must be a number strictly between 0 and 1"),
    ({"action": "email"}, "`action` must be 'warn', 'raise' or a callable"),
    ({"window": 10, "min_steps": 11}, r"`min_steps` must be an integer in \[2, window=10\]"),
    ({"threshold": 0.8, "recovery": 0.7}, r"`recovery` must be a number in \(threshold=0.8"),
    ({"min_gap": -1}, "`min_gap` must be a number of seconds >= 0"),
])
def test_detector_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StragglerDetector(**kwargs)


def test_per_replica_metrics_rejects_a_bad_log_dir():
    with pytest.raises(ValueError, match="`log_dir` must be a directory path or None"):
        kd.callbacks.PerReplicaMetrics(log_dir=3)


# ------------------------------------------------- real training, one process
def _digits_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _scalars(event_dir):
    found = {}
    for path in glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return found


@pytest.mark.compat("callbacks")
def test_per_replica_metrics_under_mirrored_add_up(tmp_path, capsys):
    (x, y), _ = load_digits()
    x, y = x[:1280], y[:1280]  # 20 batches of 64, 32 per replica
    metrics = kd.callbacks.PerReplicaMetrics(log_dir=tmp_path)
    history = kd.fit(_digits_model, x, y, epochs=3, batch_size=64, verbose=0,
                     strategy=kd.resolve_strategy("mirrored", devices=CPUS),
                     callbacks=[keras.callbacks.CSVLogger(tmp_path / "log.csv"), metrics])
    h = history.history
    # Each replica's loss over its own examples; together they are Keras' loss.
    np.testing.assert_allclose((np.array(h["replica0/loss"]) + np.array(h["replica1/loss"])) / 2,
                               h["loss"], rtol=1e-5)
    assert h["replica0/loss"] != h["replica1/loss"]  # really per replica
    assert h["replica0/updates"] == h["replica1/updates"] == [20, 20, 20]
    for replica in ("replica0", "replica1"):
        assert all(t > 0 for t in h[f"{replica}/step_time"])
        # examples/s = its 640 examples / its own summed step time.
        np.testing.assert_allclose(h[f"{replica}/examples_per_sec"],
                                   [640 / (20 * t) for t in h[f"{replica}/step_time"]],
                                   rtol=1e-6)
        found = _scalars(tmp_path / replica)
        np.testing.assert_allclose(found["loss"], h[f"{replica}/loss"], rtol=1e-5)
        assert found["updates"] == [20, 20, 20]
    # CSVLogger listed *before* the callback still got the columns.
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "replica1/loss" in header and "replica0/step_time" in header
    out = capsys.readouterr().out
    assert "per-replica training summary" in out and "replica1" in out
    assert metrics.totals["replica0"]["updates"] == 60


def test_callbacks_under_keras_own_loop_time_the_host_step():
    (x, y), _ = load_digits()
    metrics = kd.callbacks.PerReplicaMetrics(table=False)
    detector = StragglerDetector(window=5)
    model = _digits_model()
    history = model.fit(x[:640], y[:640], batch_size=64, epochs=2, verbose=0,
                        callbacks=[detector, metrics])
    h = history.history
    assert h["replica0/updates"] == [10, 10]
    assert h["replica0/loss"] == pytest.approx(h["loss"], rel=1e-6)
    assert detector.scores == {}  # nobody to compare with
    assert "examples_per_sec" not in metrics.totals["replica0"]  # batch size unknown here


def test_straggler_detector_raise_stops_mirrored_fit():
    (x, y), _ = load_digits()
    detector = StragglerDetector(window=5, threshold=0.5, action="raise")
    with kd.testing.slow_worker(1, 20), pytest.raises(StragglerError, match="replica1"):
        kd.fit(_digits_model, x[:1280], y[:1280], epochs=2, batch_size=64, verbose=0,
               strategy=kd.resolve_strategy("mirrored", devices=CPUS), callbacks=[detector])
    assert detector.events[0][1] == "replica1"


# ----------------------------------------------------------- fault injection
def test_sleep_op_sleeps_in_a_graph():
    @tf.function
    def timed(seconds):
        start = tf.timestamp()
        return kd.testing.sleep(seconds, after=start) - start

    timed(0.0)
    assert 0.03 <= float(timed(0.03)) < 0.03 + 0.05
    assert float(timed(-1.0)) < 0.02


def test_slow_down_sleeps_only_for_the_slowed_identity():
    @tf.function
    def elapsed(identity):
        start = tf.timestamp()
        waits = kd.testing.slow_down(identity, tf.constant(0.02, tf.float64), start,
                                     slowed={1: 3.0})
        with tf.control_dependencies(waits):
            return tf.timestamp() - start

    elapsed(0)
    assert float(elapsed(1)) >= 0.04  # (3 - 1) x 20 ms
    assert float(elapsed(0)) < 0.02
    assert kd.testing.slow_down(0, 0.1, [], slowed={}) == []  # nothing added


@pytest.mark.parametrize("text", ["1", "x:3", "1:0.5", "-1:2", "1:3,1:4", "1:nan"])
def test_malformed_slow_worker_setting_is_rejected(text):
    with pytest.raises(ValueError, match="KERAS_DIST_SLOW_WORKER"):
        kd.testing.slow_workers_from_env({"KERAS_DIST_SLOW_WORKER": text})


def test_injected_slowdown_shows_in_mirrored_replica_times():
    (x, y), _ = load_digits()
    metrics = kd.callbacks.PerReplicaMetrics(table=False)
    with kd.testing.slow_worker(0, 4):
        history = kd.fit(_digits_model, x[:1280], y[:1280], epochs=2, batch_size=64,
                         verbose=0, strategy=kd.resolve_strategy("mirrored", devices=CPUS),
                         callbacks=[metrics])
    # Epoch 2: no tracing in it. Replica 0 sleeps 3x its own computation.
    h = history.history
    assert h["replica0/step_time"][1] > 2 * h["replica1/step_time"][1], h
    assert not math.isnan(metrics.totals["replica0"]["loss"])
