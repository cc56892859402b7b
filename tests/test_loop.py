"""keras_dist's driver with the synchronous executor against Keras' own
fit/evaluate, in-process (the full feature-by-feature equivalence suite is
tests/test_equivalence.py).

The owned loop under MirroredStrategy (2 replicas) must give what Keras' own
loop gives on one device for the same global batches: each replica's loss is
scaled by 1/replicas, so with evenly split batches the summed gradient equals
the one-device gradient. Same seed, same data order: the histories and the
weights must agree. That pins the loop to Keras semantics before it is used
where Keras' loop fails (multi-worker: tests/test_fit_multiworker.py;
Mirrored with uneven batches or steps_per_execution > 1: below).
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.training import driver
from keras_dist.training.plan import RunPlan
from keras_dist.training.sync_executor import SyncExecutor
from procs import CPUS


def own_fit(model, strategy, *args, **kwargs):
    return driver.fit(SyncExecutor(model, strategy), *args, **kwargs)


def own_evaluate(model, strategy, *args, **kwargs):
    return driver.evaluate(SyncExecutor(model, strategy), *args, **kwargs)


@pytest.fixture(scope="module")
def strategy():
    return kd.resolve_strategy("mirrored", devices=CPUS)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype("float32")
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int32")
    return x, y


def build(strategy=None, steps_per_execution=1):
    keras.utils.set_random_seed(3)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      "sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    return model


def assert_same(model_a, model_b):
    for a, b in zip(model_a.get_weights(), model_b.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def assert_same_history(h_a, h_b):
    assert sorted(h_a.history) == sorted(h_b.history)
    for key in h_a.history:
        np.testing.assert_allclose(h_a.history[key], h_b.history[key], rtol=1e-5)


@pytest.mark.compat("mirrored")
@pytest.mark.parametrize("kwargs", [
    dict(epochs=3, batch_size=32, shuffle=False),
    dict(epochs=2, batch_size=48, shuffle=False, validation_split=0.25),
    dict(epochs=2, batch_size=32, shuffle=False, class_weight={0: 1.0, 1: 3.0}),
    dict(epochs=2, batch_size=32, shuffle=False, validation_freq=2,
         initial_epoch=0),
], ids=["plain", "validation_split", "class_weight", "validation_freq"])
def test_matches_keras_fit_on_arrays(strategy, data, kwargs):
    x, y = data
    keras_model, own_model = build(), build(strategy)
    val = {} if "validation_split" in kwargs else {"validation_data": (x[:40], y[:40])}
    h_keras = keras_model.fit(x, y, verbose=0, **val, **kwargs)
    h_own = own_fit(own_model, strategy, x, y, verbose=0, **val, **kwargs)
    assert_same_history(h_keras, h_own)
    assert_same(keras_model, own_model)


def test_matches_keras_fit_with_sample_weight_and_steps_per_execution(strategy, data):
    x, y = data
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    keras_model, own_model = build(None, 3), build(strategy, 3)
    h_keras = keras_model.fit(x, y, sample_weight=weights, epochs=2, batch_size=16,
                              shuffle=False, verbose=0)
    h_own = own_fit(own_model, strategy, x, y, sample_weight=weights, epochs=2,
                          batch_size=16, shuffle=False, verbose=0)
    assert_same_history(h_keras, h_own)
    assert_same(keras_model, own_model)


def test_matches_keras_fit_on_dataset(strategy, data):
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(20)
    keras_model, own_model = build(), build(strategy)
    h_keras = keras_model.fit(dataset, epochs=2, verbose=0)
    h_own = own_fit(own_model, strategy, dataset, epochs=2, verbose=0)
    assert_same_history(h_keras, h_own)
    assert_same(keras_model, own_model)


def test_dataset_fn_with_steps_per_epoch(strategy, data):
    x, y = data
    seen_contexts = []

    def dataset_fn(context):
        seen_contexts.append(context)
        batch = context.get_per_replica_batch_size(32)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)

    model = build(strategy)
    history = own_fit(model, strategy, dataset_fn, epochs=3,
                            steps_per_epoch=5, verbose=0)
    # One input pipeline per worker (plus one local sample batch, read
    # once to create the optimizer's and metrics' state).
    distributed = [c for c in seen_contexts if c.num_replicas_in_sync == 2]
    assert len(distributed) == 1 and len(seen_contexts) == 2
    losses = history.history["loss"]
    assert losses[-1] < losses[0]


def test_dataset_fn_needs_steps(strategy, data):
    with pytest.raises(ValueError, match="dataset_fn.*steps_per_epoch"):
        own_fit(build(strategy), strategy, lambda ctx: None, epochs=1, verbose=0)


def test_infinite_dataset_needs_steps(strategy, data):
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    with pytest.raises(ValueError, match="repeats forever.*steps_per_epoch"):
        own_fit(build(strategy), strategy, dataset, epochs=1, verbose=0)


def test_runs_out_of_data_warns_and_starts_a_new_pass_as_keras(strategy, data):
    """Keras 3's epoch iterator: a pass that ends inside an epoch ends that
    epoch (with the warning) and the next epoch starts a new pass; training
    goes on (tests/test_inputs.py compares more cases with Keras)."""
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(50)  # 4 batches
    model = build(strategy)
    with pytest.warns(UserWarning, match="ran out of data"):
        history = own_fit(model, strategy, dataset, epochs=5,
                                steps_per_epoch=3, verbose=0)
    assert len(history.history["loss"]) == 5
    assert int(model.optimizer.iterations.numpy()) == 3 + 1 + 3 + 1 + 3


def test_callbacks_see_every_hook_and_can_stop(strategy, data):
    x, y = data

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.events = []

        def on_train_begin(self, logs=None):
            self.events.append("train_begin")

        def on_epoch_end(self, epoch, logs=None):
            self.events.append(("epoch_end", epoch, sorted(logs)))
            if epoch == 1:
                self.model.stop_training = True

        def on_train_batch_end(self, batch, logs=None):
            self.events.append(("batch", batch))

        def on_test_end(self, logs=None):
            self.events.append("test_end")

    recorder = Recorder()
    history = own_fit(build(strategy), strategy, x, y, epochs=10, batch_size=50,
                            validation_data=(x[:20], y[:20]), callbacks=[recorder],
                            verbose=0)
    assert len(history.history["loss"]) == 2
    batches = [e for e in recorder.events if isinstance(e, tuple) and e[0] == "batch"]
    assert [b[1] for b in batches] == [0, 1, 2, 3] * 2
    assert recorder.events.count("test_end") == 2
    assert ("epoch_end", 0, ["accuracy", "loss", "val_accuracy", "val_loss"]) in recorder.events


def test_evaluate_matches_keras(strategy, data):
    x, y = data
    model = build(strategy)
    model.fit(x, y, epochs=1, verbose=0)
    expected = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    got = own_evaluate(model, strategy, x, y, batch_size=32, return_dict=True,
                             verbose=0)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5)
    as_list = own_evaluate(model, strategy, x, y, batch_size=32, verbose=0)
    assert as_list == pytest.approx([expected["loss"], expected["accuracy"]], rel=1e-5)


def replica_weights(model, strategy):
    """Each replica's copy of every variable, as numpy."""
    return [[r.numpy() for r in strategy.experimental_local_results(v.value)]
            for v in model.weights]


@pytest.mark.parametrize("batch, steps_per_execution", [(25, 1), (16, 3)],
                         ids=["uneven_batches", "steps_per_execution"])
def test_trains_where_keras_mirrored_fit_fails(strategy, data, batch,
                                                steps_per_execution):
    """Keras 3.15's own fit under MirroredStrategy raises here: with a batch
    that does not split evenly over replicas (`_maybe_symbolic_build` adds
    per-replica batches of shapes [13, 8] and [12, 8]) and with
    steps_per_execution > 1 (variables initialized inside its while loop)."""
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model = build(strategy, steps_per_execution)
    history = own_fit(model, strategy, dataset, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    for copies in replica_weights(model, strategy):
        np.testing.assert_array_equal(copies[0], copies[1])


def test_finished_iterators_are_let_go_off_the_training_thread(strategy, data):
    """Deleting a tf.data iterator under MirroredStrategy waits for its
    autotuning threads, now and then for up to a minute (an epoch boundary
    of this module took 47-86 s in some runs, the same fit 3 s in others).
    Each epoch's and each evaluation's iterator is let go on keras_dist's
    release thread, so that wait never stops training."""
    import threading
    import weakref

    finalized = []   # (what, thread name) as each iterator is deleted
    executor = SyncExecutor(build(strategy), strategy)

    class Watch(keras.callbacks.Callback):
        def _watch(self, what):
            iterator = executor._iterator
            weakref.finalize(iterator, lambda: finalized.append(
                (what, threading.current_thread().name)))

        def on_epoch_end(self, epoch, logs=None):
            self._watch(f"train epoch {epoch}")

    x, y = data
    driver.fit(executor, x, y, epochs=3, batch_size=32, validation_data=(x[:40], y[:40]),
               verbose=0, callbacks=[Watch()])
    deadline = time.monotonic() + 120  # the release thread may itself wait a while
    while len(finalized) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(finalized) == [(f"train epoch {e}", "keras_dist-iterator-release")
                                 for e in range(3)], finalized


def test_a_release_that_never_returns_holds_up_no_later_one():
    """An iterator whose destructor never returns (one over a generator that
    waits forever), or takes a minute, must not keep every later iterator of
    the process from being freed. (One release thread did: in a CI run the
    test above saw none of its 3 iterators freed within 120 s, in an xdist
    worker that had run 70 other tests.)"""
    import threading

    from keras_dist.training.data import _Releaser

    releaser = _Releaser()
    releaser.STUCK = 0.3
    gate, freed = threading.Event(), []

    class NeverReturns:
        def __del__(self):
            gate.wait(60)

    class Returns:
        def __del__(self):
            freed.append(threading.current_thread().name)

    try:
        releaser.release(NeverReturns())
        time.sleep(0.6)  # its thread is now stuck in the destructor
        releaser.release(Returns())
        deadline = time.monotonic() + 10
        while not freed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert freed == ["keras_dist-iterator-release"]
        # A release while one thread is busy, but not for long, starts none.
        releaser.STUCK = 60
        releaser.release(Returns())
        assert len(releaser._threads) == 2
    finally:
        gate.set()
        releaser._drain(timeout=10)
    assert not any(t.is_alive() for t in releaser._threads)


@pytest.mark.parametrize("kwargs, message", [
    (dict(validation_data=([1, 2, 3],)), "validation_data.*tuple"),
    (dict(validation_split=1.5), "validation_split.*range"),
    (dict(y=np.zeros(7)), "different numbers of samples: 200 and 7"),
    (dict(steps_per_epoch=0),
     r"`steps_per_epoch` must be an integer >= 1 or None. Received: steps_per_epoch=0\."),
    (dict(class_weight={0: 1.0}), "class_weight.*no entry for class.*1"),
    (dict(validation_freq=0, validation_data=None), "validation_freq"),
])
def test_bad_arguments(strategy, data, kwargs, message):
    x, y = data
    args = dict(y=y, epochs=1, verbose=0)
    args.update(kwargs)
    if "validation_freq" in kwargs:
        args["validation_data"] = (x[:10], y[:10])
    with pytest.raises(ValueError, match=message):
        own_fit(build(strategy), strategy, x, **args)


def test_numpy_integer_counts_are_integers(strategy, data):
    """One rule for counts (keras_dist.training.data.check_fit_counts): NumPy integers
    are accepted for `epochs` and `steps_per_epoch` as Keras accepts them,
    and `evaluate`'s `steps=0` names `steps`."""
    x, y = data
    model = build(strategy)
    history = own_fit(model, strategy, x, y, batch_size=20, epochs=np.int64(2),
                      steps_per_epoch=np.int64(3), verbose=0)
    assert len(history.history["loss"]) == 2
    with pytest.raises(ValueError, match=r"`steps` must be an integer >= 1 or None\. "
                                         r"Received: steps=0\."):
        own_evaluate(model, strategy, x, y, steps=0, verbose=0)


@pytest.mark.parametrize("task, live", [(("worker", 0), True), (("worker", 1), False)])
def test_only_the_leading_task_shows_a_live_progress_bar(strategy, data, task, live, capsys):
    # Every worker of a cluster prints; a live bar from each would interleave.
    cluster = kd.ClusterConfig.from_dict({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": task[0], "index": task[1]}})
    model = build(strategy)
    driver.fit(SyncExecutor(model, RunPlan(strategy=strategy, cluster=cluster)), *data, epochs=1,
               batch_size=50)  # verbose="auto", as by default
    shown = capsys.readouterr().out
    assert ("\r" in shown or "\b" in shown) == live, repr(shown)
    assert "4/4" in shown and "loss:" in shown  # the epoch's line, either way


class _PythonIfOnTensors(keras.Model):
    def train_step(self, data):
        x, _ = data
        if tf.reduce_sum(x) > 0:  # a Python `if` on a tensor: needs AutoGraph
            pass
        return super().train_step(data)


def test_train_step_is_not_autograph_converted_exactly_as_in_keras_fit(strategy, data):
    # Keras 3 traces train_step without AutoGraph (do_not_convert in its TF
    # trainer), so Python control flow on tensors fails there; the owned
    # loop must not quietly accept what Keras' own fit refuses.
    x, y = data

    def make(scope_strategy):
        with scope_strategy.scope():
            inputs = keras.Input((8,))
            model = _PythonIfOnTensors(inputs, keras.layers.Dense(2)(inputs))
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        make(tf.distribute.get_strategy()).fit(x, y, epochs=1, verbose=0)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        own_fit(make(strategy), strategy, x, y, epochs=1, verbose=0)


def test_more_than_32_steps_per_execution(strategy, data):
    # tf.data refuses more than 32 `next` calls in a function AutoGraph has
    # not converted; the owned loop unrolls steps_per_execution of them.
    x, y = data
    model = build(strategy, steps_per_execution=40)
    own_fit(model, strategy, x, y, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 50
