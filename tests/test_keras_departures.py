"""What Keras' own fit tests found `kd.fit` doing differently (issue 37).

Each test is one departure, reproduced as Keras' own test shows it, with
`kd.fit` / `kd.evaluate` under Mirrored over two logical CPUs against
Keras' `model.fit` / `model.evaluate` on one device (tests/conftest.py
splits the CPU). The input-side departures (lists, generators, arrays with
`steps_per_epoch`) are in tests/test_inputs.py.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.training import driver
from procs import CPUS


@pytest.fixture(scope="module")
def mirrored():
    return kd.resolve_strategy("mirrored", devices=CPUS)


def _dense(seed):
    """A compiled one-layer regression model (3 inputs, 2 outputs) from `seed`."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model


def _xy(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


@pytest.mark.parametrize("form", ["sequential_without_input", "subclassed"])
def test_an_unbuilt_model_made_in_the_scope_is_trained_itself(mirrored, form):
    """It was cloned (no variables yet, so 'not created in the scope'): the
    caller's model stayed untrained, and a subclassed one failed to re-create."""
    x, y = _xy()

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs):
            return self.dense(inputs)

    with mirrored.scope():
        model = (keras.Sequential([keras.layers.Dense(2)]) if form != "subclassed"
                 else Subclassed())
        model.compile("sgd", "mse")
    assert not model.built
    history = kd.fit(model, x, y, strategy=mirrored, epochs=2, batch_size=8, verbose=0)
    assert history.model is model and model.built
    assert int(model.optimizer.iterations.numpy()) == 10


def test_evaluate_lists_metrics_in_compile_order(mirrored):
    """Keras: [loss, mse, mae] for metrics=["mse", "mae"]; kd.evaluate gave
    them alphabetically, values swapped without a word."""
    x, y = _xy()

    def build():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse", metrics=["mse", "mae"])
        return model

    with mirrored.scope():
        ours = build()
    theirs = build()
    mse = keras.metrics.MeanSquaredError()(y, theirs.predict(x, verbose=0))
    mae = keras.metrics.MeanAbsoluteError()(y, theirs.predict(x, verbose=0))
    expected = theirs.evaluate(x, y, verbose=0)
    got = kd.evaluate(ours, x, y, strategy=mirrored, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(got[1:], [float(mse), float(mae)], rtol=1e-5)
    assert driver.ordered_names(ours, {"loss": 0, "mae": 0, "mse": 0, "zz": 0}) == [
        "loss", "mse", "mae", "zz"]


class _Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_batch_indices_with_steps_per_execution_are_keras(mirrored):
    """7 batches at 3 per execution: Keras reports 2, 5, 8 (a short last
    execution numbered as a whole one); kd.fit reported 2, 5, 6."""
    x, y = _xy(56)

    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse", steps_per_execution=3)
        return model

    theirs, ours = _Batches(), _Batches()
    build().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[theirs])
    kd.fit(build, x, y, strategy=mirrored, batch_size=8, epochs=1, shuffle=False, verbose=0,
           callbacks=[ours])
    assert theirs.ends == [2, 5, 8]
    assert ours.ends == theirs.ends


def test_keras_debug_limits_on_epochs_and_steps_apply(mirrored):
    """keras.config.set_max_epochs / set_max_steps_per_epoch were ignored."""
    x, y = _xy(80)

    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        return model

    keras.config.set_max_epochs(2)
    keras.config.set_max_steps_per_epoch(3)
    try:
        with pytest.warns(UserWarning, match="Limiting"):
            history = kd.fit(build, x, y, strategy=mirrored, batch_size=8, epochs=4,
                             verbose=0)
        reference = build().fit(x, y, batch_size=8, epochs=4, verbose=0)
    finally:
        keras.config.set_max_epochs(None)
        keras.config.set_max_steps_per_epoch(None)
    assert len(history.history["loss"]) == len(reference.history["loss"]) == 2
    assert int(history.model.optimizer.iterations.numpy()) == 6


def test_evaluate_builds_without_a_training_loss(mirrored):
    """An overridden compute_loss sees training=False only, as in Keras
    (kd.evaluate's build step called it with training=True)."""
    x, y = _xy()
    seen = {}

    class Recording(keras.Sequential):
        def compute_loss(self, *args, training=True, **kwargs):
            seen.setdefault(self.name, []).append(training)
            return super().compute_loss(*args, training=training, **kwargs)

    def build(name):
        model = Recording([keras.Input((3,)), keras.layers.Dense(2)], name=name)
        model.compile("sgd", "mse")
        return model

    build("keras").evaluate(x, y, batch_size=8, verbose=0)
    with mirrored.scope():
        ours = build("ours")
    kd.evaluate(ours, x, y, strategy=mirrored, batch_size=8, verbose=0)
    assert set(seen["keras"]) == {False}
    assert set(seen["ours"]) == {False}


def test_jit_compile_under_several_replicas_is_refused_clearly(mirrored):
    x, y = _xy()

    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse", jit_compile=True)
        return model

    with pytest.raises(ValueError, match="jit_compile=True is not supported with 2 "
                       "synchronous replicas"):
        kd.fit(build, x, y, strategy=mirrored, epochs=1, verbose=0)


def test_a_trainer_mixin_model_is_a_model_not_a_function():
    """Keras' own tests train layers that mix in Keras' trainer; kd.fit took
    them for a model-building function (TypeError: missing 'inputs')."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    class Trainable(TensorFlowTrainer, keras.layers.Dense):
        def __init__(self, units):
            keras.layers.Dense.__init__(self, units)
            TensorFlowTrainer.__init__(self)

    x, y = _xy()
    model = Trainable(2)
    model.compile("sgd", "mse")
    history = kd.fit(model, x, y, strategy="default", epochs=2, batch_size=8, verbose=0)
    assert history.model is model and len(history.history["loss"]) == 2


def test_steps_per_execution_traces_the_step_once_per_replica(mirrored):
    """An execution of k steps loops around one compiled step, as Keras'
    does; unrolled, the step was traced k times per replica."""
    x, y = _xy(80)
    traces = []

    class Counting(keras.Sequential):
        def train_step(self, data):
            traces.append(1)
            return super().train_step(data)

    def build():
        keras.utils.set_random_seed(4)
        model = Counting([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse", steps_per_execution=4)
        return model

    # 10 batches: executions of 4, 4 and 2 steps.
    history = kd.fit(build, x, y, strategy=mirrored, batch_size=8, epochs=2, shuffle=False,
                     verbose=0)
    assert len(traces) == 2  # one per replica, for every k
    reference = build()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(history.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


class _EpochKeys(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.keys = []

    def on_epoch_end(self, epoch, logs=None):
        self.keys.append(list(logs))


def test_fit_logs_several_metrics_in_keras_order(mirrored):
    """Keras flattens a multi-output model's logs in compile order
    (`_flatten_metrics_in_order`): the History's keys, the epoch logs'
    keys and their values are Keras' under kd.fit in Mirrored."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = {"b": rng.normal(size=(64, 1)).astype("float32"),
         "a": (np.arange(64) % 2).astype("float32")[:, None]}

    def build():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, activation="relu")(inputs)
        outputs = {"b": keras.layers.Dense(1, name="b")(hidden),
                   "a": keras.layers.Dense(1, activation="sigmoid", name="a")(hidden)}
        model = keras.Model(inputs, outputs)
        model.compile("sgd", loss={"b": "mse", "a": "binary_crossentropy"},
                      metrics={"b": ["mae", "mse"], "a": ["accuracy", keras.metrics.AUC(name="auc")]},
                      weighted_metrics={"b": ["mae"]})
        return model

    theirs, keys_theirs = build(), _EpochKeys()
    expected = theirs.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0,
                          callbacks=[keys_theirs]).history
    with mirrored.scope():
        ours = build()
    keys_ours = _EpochKeys()
    got = kd.fit(ours, x, y, strategy=mirrored, epochs=2, batch_size=16, shuffle=False,
                 verbose=0, callbacks=[keys_ours]).history
    assert list(got) == list(expected)
    assert keys_ours.keys == keys_theirs.keys
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_predict_and_evaluate_after_a_one_device_fit_with_a_step_backup(tmp_path):
    """Issue 47, 2: a step-frequency backup routes a one-device `kd.fit`
    through keras_dist's loop, which then gave the model `kd.predict` /
    `kd.evaluate` as its own; those call the model's own: RecursionError.
    After it the model's `predict` / `evaluate` are Keras' and agree with a
    model trained by Keras' `fit`."""
    x, y = _xy(48)

    def build():
        return _dense(3)

    backup = kd.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    model = kd.fit(build, x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
                   callbacks=[backup]).model
    reference = build()
    reference.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "predict" not in vars(model) and "evaluate" not in vars(model)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(reference.evaluate(x, y, verbose=0))
    assert kd.evaluate(model, x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0))


class _StopAfter(keras.callbacks.Callback):
    """Sets the model's stop_evaluating / stop_predicting after `n` batches,
    as Keras' test_stop_loop_* tests do; counts the batches it saw."""

    def __init__(self, n):
        super().__init__()
        self.n, self.test_batches, self.predict_batches = n, 0, 0

    def on_test_batch_end(self, batch, logs=None):
        self.test_batches += 1
        if self.test_batches == self.n:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.predict_batches += 1
        if self.predict_batches == self.n:
            self.model.stop_predicting = True


@pytest.mark.timeout(120)
def test_a_callback_stops_evaluate_and_predict_early(mirrored):
    """Issue 47: kd.evaluate ignored `model.stop_evaluating` (all 40 batches
    where Keras stops after 5; an infinite generator never returned), and
    kd.predict `model.stop_predicting`. Keras' own on one device is the
    reference."""
    x, y = _xy(200)

    def build():
        return _dense(2)

    def endless():
        while True:
            yield x[:5], y[:5]

    reference = build()
    seen = {}
    for name, run in [("evaluate", lambda m, cb: m.evaluate(x, y, batch_size=5, verbose=0,
                                                             callbacks=[cb])),
                      ("endless", lambda m, cb: m.evaluate(endless(), verbose=0,
                                                            callbacks=[cb])),
                      ("predict", lambda m, cb: m.predict(x, batch_size=5, verbose=0,
                                                           callbacks=[cb]))]:
        keras_cb = _StopAfter(5)
        run(reference, keras_cb)
        seen[name] = (keras_cb.test_batches, keras_cb.predict_batches)
    assert seen == {"evaluate": (5, 0), "endless": (5, 0), "predict": (0, 5)}

    model = kd.fit(build, x, y, strategy=mirrored, epochs=1, batch_size=10, verbose=0).model
    callback = _StopAfter(5)
    kd.evaluate(model, x, y, batch_size=5, verbose=0, callbacks=[callback])
    assert callback.test_batches == 5
    callback = _StopAfter(5)
    kd.evaluate(model, endless(), verbose=0, callbacks=[callback])
    assert callback.test_batches == 5
    callback = _StopAfter(5)
    assert kd.predict(model, x, batch_size=5, verbose=0, callbacks=[callback]).shape == (25, 2)
    assert callback.predict_batches == 5


def test_predict_after_a_mirrored_fit_reads_inputs_as_keras_predict(mirrored):
    """Issue 47: after a multi-replica `fit` the model's `predict` (keras_dist's)
    read a list of 3 input arrays as (x, y, sample_weight) and could not read
    a Python generator. Both give what Keras' `predict` gives on one device."""
    rng = np.random.default_rng(4)
    xs = [rng.normal(size=(20, n)).astype("float32") for n in (2, 3, 1)]
    y = rng.normal(size=(20, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(5)
        inputs = [keras.Input((n,)) for n in (2, 3, 1)]
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Concatenate()(inputs)))
        model.compile("sgd", "mse")
        return model

    def batches():
        for start in range(0, 20, 8):
            yield (tuple(a[start:start + 8] for a in xs),)

    model = kd.fit(build, xs, y, strategy=mirrored, epochs=1, batch_size=4, verbose=0).model
    reference = build()
    reference.set_weights(model.get_weights())
    expected = reference.predict(xs, verbose=0)
    np.testing.assert_allclose(model.predict(xs, verbose=0), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.predict(batches(), verbose=0),
                               reference.predict(batches(), verbose=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kd.predict(model, batches(), verbose=0), expected,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", ["one_device", "mirrored"])
def test_the_build_before_training_calls_compute_loss_symbolically(mirrored, shape, tmp_path):
    """Keras' test_fwd_pass_loss_presence_in_compute_loss: an overridden
    compute_loss that asserts `training` outside Keras' symbolic build.
    keras_dist built the model by calling compute_loss(training=False)
    eagerly on a real batch; Keras does it on symbolic tensors (or not at
    all on one device), so the only real calls are training steps."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope  # as Keras' test

    calls = []

    class MyModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.custom_metric = keras.metrics.Mean(name="custom")
            self.dense = keras.layers.Dense(2, activity_regularizer="l2")

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            calls.append((in_symbolic_scope(), training))
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            self.custom_metric.update_state(sum(self.losses))
            return loss

    def build():
        keras.utils.set_random_seed(0)
        model = MyModel()
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = np.ones((32, 4), "float32"), np.ones((32, 2), "float32") * 2
    history = kd.fit(build, x, y, verbose=0, batch_size=8,
                     strategy=mirrored if shape == "mirrored" else "auto",
                     callbacks=[kd.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)])
    assert all(training for symbolic, training in calls if not symbolic), calls
    assert (True, False) in calls  # the build, as Keras' symbolic one
    assert history.history["custom"][0] > 0.0


def test_keras_fit_after_a_mirrored_fit_trains_on_as_kd_fit(mirrored):
    """Issue 47: after `kd.fit` under Mirrored the model's `fit` is keras_dist's,
    as its `evaluate` and `predict` are: Keras' own fails at a batch of 5 over
    2 replicas (tests/test_loop.py). Called with Keras' positional arguments
    (x, y, batch_size, epochs, verbose), it trains as Keras' fit does on one
    device from the same weights."""
    x, y = _xy(20)
    model = kd.fit(lambda: _dense(6), x, y, strategy=mirrored, batch_size=5, epochs=1,
                   shuffle=False, verbose=0).model
    reference = _dense(6)
    reference.set_weights(model.get_weights())
    history = model.fit(x, y, 5, 2, 0, shuffle=False)
    expected = reference.fit(x, y, 5, 2, 0, shuffle=False)
    assert history.model is model and list(history.history) == list(expected.history)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
