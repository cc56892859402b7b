"""AsyncModel outside parameter-server training: exactly a keras.Model."""

import keras
import numpy as np
import pytest

import keras_dist as kd


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(96, 5)).astype("float32")
    return x, (x.sum(1, keepdims=True) > 0).astype("float32")


def layers():
    """Two built layers with seeded weights (built now, so the seed decides)."""
    keras.utils.set_random_seed(11)
    hidden = keras.layers.Dense(8, activation="relu")
    out = keras.layers.Dense(1, activation="sigmoid")
    hidden.build((None, 5))
    out.build((None, 8))
    return [hidden, out]


def compile_(model):
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy", metrics=["accuracy"])
    return model


def functional(cls):
    inputs = keras.Input((5,))
    hidden, out = layers()
    return compile_(cls(inputs, out(hidden(inputs))))


class Subclassed(kd.AsyncModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = layers()

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class PlainSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = layers()

    def call(self, inputs):
        return self.out(self.hidden(inputs))


@pytest.mark.parametrize("make_async, make_plain", [
    (lambda: functional(kd.AsyncModel), lambda: functional(keras.Model)),
    (lambda: kd.AsyncModel.from_model(compile_(keras.Sequential([keras.Input((5,)), *layers()]))),
     lambda: compile_(keras.Sequential([keras.Input((5,)), *layers()]))),
], ids=["functional", "from_model"])
def test_trains_exactly_like_keras_model_without_parameter_servers(data, make_async, make_plain):
    x, y = data
    async_model, plain = make_async(), make_plain()
    assert isinstance(async_model, kd.AsyncModel)
    h_async = async_model.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)
    h_plain = plain.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_async.history["loss"], h_plain.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(async_model.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    # Synchronous training: the version counts the optimizer's steps, and
    # no update was stale (what a parameter-server run reports there).
    assert async_model.version == int(plain.optimizer.iterations.numpy()) == 18
    assert async_model.staleness_stats.logs() == {"staleness_mean": 0.0, "staleness_max": 0}
    assert "staleness_mean" not in h_async.history


def test_subclass_and_functional_forms_mix_in_one_process(data):
    """Keras builds a Model subclass called with (inputs, outputs) by
    rewriting the class's bases to Functional (inject_functional_model_class);
    done to AsyncModel, every subclass of it made afterwards is a Functional
    without inputs and fails. Here the functional form comes first, and both
    a subclass made before it and one made after train exactly like Keras."""
    x, y = data
    before = compile_(Subclassed())
    bases = kd.AsyncModel.__bases__
    functional(kd.AsyncModel).fit(x, y, epochs=1, verbose=0)
    kd.AsyncModel.from_model(compile_(keras.Sequential([keras.Input((5,)), *layers()])))
    assert kd.AsyncModel.__bases__ == bases  # AsyncModel itself is left as defined
    after, plain = compile_(Subclassed()), compile_(PlainSubclassed())
    h_after = after.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)
    h_plain = plain.fit(x, y, epochs=3, batch_size=16, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_after.history["loss"], h_plain.history["loss"], rtol=1e-6)
    before.fit(x, y, epochs=1, verbose=0)
    assert before.predict(x, verbose=0).shape == (96, 1)


def test_from_model_shares_weights_and_compile_settings():
    seq = compile_(keras.Sequential([keras.Input((5,)), *layers()]))
    model = kd.AsyncModel.from_model(seq)
    assert [id(w) for w in model.weights] == [id(w) for w in seq.weights]
    assert model.loss == "binary_crossentropy"
    assert kd.AsyncModel.from_model(model) is model


def test_from_model_rejects_models_without_inputs():
    with pytest.raises(ValueError, match="needs a functional or Sequential model with defined inputs"):
        kd.AsyncModel.from_model(PlainSubclassed())


def test_keras_save_load_round_trip(tmp_path, data):
    x, y = data
    model = functional(kd.AsyncModel)
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, kd.AsyncModel)
    assert keras.saving.get_registered_name(type(loaded)) == "keras_dist>AsyncModel"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    loaded.fit(x, y, epochs=1, verbose=0)  # and training continues


LOAD_IN_A_FRESH_PROCESS = """
import sys
{first}
{second}
import numpy as np
model = keras.saving.load_model(sys.argv[1])
print(type(model).__name__, keras.saving.get_registered_name(type(model)),
      type(model.optimizer).__name__, type(model.optimizer.inner_optimizer).__name__)
np.save(sys.argv[2], model.predict(np.load(sys.argv[3]), verbose=0))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("first, second", [
    ("import keras_dist", "import keras"),
    ("import keras", "import keras_dist"),
], ids=["keras_dist-first", "keras-first"])
def test_saved_async_model_loads_in_a_fresh_process_after_import_keras_dist(
        tmp_path, data, first, second):
    """A user's process that only imported keras_dist (not kd.AsyncModel or
    kd.optimizers) loads a saved AsyncModel compiled with a wrapper."""
    import subprocess
    import sys

    x, y = data
    inputs = keras.Input((5,))
    hidden, out = layers()
    model = kd.AsyncModel(inputs, out(hidden(inputs)))
    model.compile(kd.optimizers.DynSGD(keras.optimizers.SGD(0.05)), "binary_crossentropy")
    with pytest.warns(UserWarning):  # a staleness-aware wrapper outside parameter servers
        model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    script = LOAD_IN_A_FRESH_PROCESS.format(first=first, second=second)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "m.keras"), str(tmp_path / "p.npy"),
         str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["AsyncModel", "keras_dist>AsyncModel", "DynSGD", "SGD"]
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), model.predict(x, verbose=0),
                               atol=1e-6)


def test_async_input_errors_are_clear():
    import tensorflow as tf

    from keras_dist.training.data import per_worker_input

    unknown = tf.data.Dataset.range(10).filter(lambda i: i > 2).map(lambda i: (i, i))
    with pytest.raises(ValueError, match="unknown or infinite length; pass `steps_per_epoch`"):
        per_worker_input(None, unknown, batch_size=8)
    with pytest.raises(ValueError, match="dataset_fn.*pass `steps_per_epoch`"):
        per_worker_input(None, lambda ctx: unknown, batch_size=8)
    with pytest.raises(ValueError, match="`steps_per_epoch` must be an integer >= 1 or None. "
                                         "Received: steps_per_epoch=0"):
        per_worker_input(None, np.zeros((4, 2)), np.zeros(4), batch_size=8, steps=0)


def test_async_input_rejects_weights_beside_a_dataset():
    import tensorflow as tf

    from keras_dist.training.data import per_worker_input

    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2)), np.zeros(4))).batch(2)
    with pytest.raises(ValueError, match="`class_weight` must be None when `x` is a tf.data"):
        per_worker_input(None, dataset, class_weight={0: 1.0})
