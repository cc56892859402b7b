"""One cache of compiled functions per model, emptied by `compile()` (issue 33).

A model counts, in Python, each trace of its `train_step` and `test_step`
(Python code in a `tf.function` runs only while it is traced). Under
Mirrored over two logical CPUs each replica traces once: a second `fit`,
later epochs and a second `evaluate` trace nothing more, as Keras' own
`train_function` does; a new `compile()` traces again.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from procs import CPUS
from keras_dist.training import compiled

TRACES = {"train": 0, "test": 0}


class Counting(keras.Sequential):
    def train_step(self, data):
        TRACES["train"] += 1
        return super().train_step(data)

    def test_step(self, data):
        TRACES["test"] += 1
        return super().test_step(data)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])


@pytest.fixture
def mirrored():
    return kd.resolve_strategy("mirrored", devices=CPUS)


def test_second_fit_and_evaluate_trace_nothing_and_compile_starts_afresh(mirrored):
    x = np.random.default_rng(0).normal(size=(96, 4)).astype("float32")
    y = np.arange(96) % 3
    with mirrored.scope():
        model = Counting([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        _compile(model)
    TRACES.update(train=0, test=0)
    kd.fit(model, x, y, epochs=2, batch_size=16, verbose=0, strategy=mirrored,
           validation_data=(x, y))
    first = dict(TRACES)
    assert first["train"] == mirrored.num_replicas_in_sync == 2, first
    assert first["test"] == 2, first
    kd.fit(model, x, y, epochs=2, batch_size=16, verbose=0, strategy=mirrored,
           validation_data=(x, y))
    kd.evaluate(model, x, y, verbose=0)
    assert TRACES == first, (first, TRACES)  # nothing traced again
    with mirrored.scope():
        _compile(model)
    kd.fit(model, x, y, epochs=1, batch_size=16, verbose=0, strategy=mirrored)
    assert TRACES["train"] == 2 * first["train"], TRACES  # the new compilation traced


def test_cache_is_per_compilation_even_with_the_same_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer, "mse")
    first = compiled.cached(model, "key", object)
    assert compiled.cached(model, "key", object) is first
    assert compiled.cached(model, "other", object) is not first
    model.compile(optimizer, "mae")  # same optimizer object, new loss
    assert compiled.cached(model, "key", object) is not first


@pytest.mark.parametrize("route", ["keras", "mirrored"])
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_nothing_is_traced_after_the_first_epoch(route, steps_per_execution):
    """Three epochs of 7 steps (at 3 steps per execution the last one is
    shorter), validation after each: every trace happens in the first
    epoch, on one device (Keras' own loop) and under Mirrored (keras_dist's
    synchronous executor). Parameter servers: test_async's
    test_no_retracing_under_parameter_servers."""
    from procs import epoch_traces

    strategy = kd.resolve_strategy("mirrored", devices=CPUS) if route == "mirrored" \
        else kd.resolve_strategy("default")
    x = np.random.default_rng(1).normal(size=(7 * 16, 4)).astype("float32")
    y = np.arange(7 * 16) % 3
    with strategy.scope():
        model = Counting([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    TRACES.update(train=0, test=0)
    callback = epoch_traces(TRACES)
    kd.fit(model, x, y, epochs=3, batch_size=16, verbose=0, strategy=strategy,
           validation_data=(x[:40], y[:40]), callbacks=[callback])
    first, *later = callback.records
    assert first["train"] >= 1 and first["test"] >= 1, first
    assert later == [first, first], callback.records


def test_one_device_kd_fit_traces_once_as_keras_fit_does():
    """Issue 47, 3: on one device each `kd.fit` traced the train step again
    (its non-finite guard reset `train_function` every time), where a second
    `model.fit` traces nothing. Keras' own `model.fit` after it keeps its
    own unguarded function, and a later `kd.fit` still skips a NaN batch."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.arange(64) % 3

    def build():
        model = Counting([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        _compile(model)
        return model

    reference = build()
    TRACES.update(train=0, test=0)
    reference.fit(x, y, epochs=2, batch_size=16, verbose=0)
    keras_traces = TRACES["train"]
    reference.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert TRACES["train"] == keras_traces >= 1  # Keras: nothing traced again

    model = build()
    TRACES.update(train=0, test=0)
    kd.fit(model, x, y, epochs=2, batch_size=16, verbose=0)
    assert TRACES["train"] == keras_traces, TRACES
    kd.fit(model, x, y, epochs=2, batch_size=16, verbose=0)
    assert TRACES["train"] == keras_traces, TRACES  # nothing traced again
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # Keras' own: its own function
    with_keras = TRACES["train"]
    assert with_keras > keras_traces, TRACES
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    poisoned = x.copy()
    poisoned[0, 0] = np.nan
    history = kd.fit(model, poisoned, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    assert TRACES["train"] == with_keras, TRACES
    assert history.history["skipped_nonfinite"] == [1]
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 2 * 8 + 2 * 4 + 3
