"""keras_dist.fit / evaluate in-process: model handling, dispatch, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from procs import CPUS


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    return x, y


def build_model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    return model


def replica_values(strategy, variable):
    return [t.numpy() for t in strategy.experimental_local_results(variable.value)]


@pytest.mark.compat("default")
def test_default_strategy_is_plain_keras_fit(data):
    x, y = data
    history = kd.fit(build_model, x, y, strategy="default", epochs=3, batch_size=32,
                     shuffle=False, verbose=0)
    plain = build_model()
    expected = plain.fit(x, y, epochs=3, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    for a, b in zip(history.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.compat("mirrored")
def test_mirrored_build_function_trains_with_identical_replicas(data):
    x, y = data
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=5, batch_size=32,
                     verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    model = history.model
    assert strategy.num_replicas_in_sync == 2
    for variable in model.weights:
        assert strategy.extended.variable_created_in_scope(variable.value)
        copies = replica_values(strategy, variable)
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])


def test_compiled_model_outside_scope_is_recreated_inside(data, caplog):
    x, y = data
    outside = build_model()
    outside.fit(x, y, epochs=1, verbose=0)  # weights no longer the initial ones
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)
    history = kd.fit(outside, x, y, strategy=strategy, epochs=0, verbose=0)
    clone = history.model
    assert clone is not outside
    assert all(strategy.extended.variable_created_in_scope(v.value) for v in clone.weights)
    for a, b in zip(clone.get_weights(), outside.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert clone.loss == outside.loss
    assert isinstance(clone.optimizer, keras.optimizers.SGD)
    assert float(keras.ops.convert_to_numpy(clone.optimizer.learning_rate)) == pytest.approx(0.05)
    # ... and it trains on from there.
    before = clone.evaluate(x, y, verbose=0)[0]
    kd.fit(clone, x, y, strategy=strategy, epochs=2, verbose=0)
    assert clone.evaluate(x, y, verbose=0)[0] < before


def test_model_built_in_scope_is_used_as_is(data):
    x, y = data
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)
    with strategy.scope():
        model = build_model()
    history = kd.fit(model, x, y, strategy=strategy, epochs=1, verbose=0)
    assert history.model is model


def test_dataset_fn_under_mirrored(data):
    x, y = data
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)

    def dataset_fn(context):
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .repeat().batch(context.get_per_replica_batch_size(32)))

    history = kd.fit(build_model, dataset_fn, strategy=strategy, epochs=3,
                     steps_per_epoch=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_evaluate_uses_the_models_strategy(data):
    x, y = data
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=2, verbose=0)
    result = kd.evaluate(history.model, x, y, batch_size=32, return_dict=True, verbose=0)
    plain = build_model()
    plain.set_weights(history.model.get_weights())
    expected = plain.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    assert sorted(result) == ["loss", "mae"]
    for key in expected:
        assert result[key] == pytest.approx(expected[key], rel=1e-5)


def test_env_var_selects_strategy(data, monkeypatch):
    x, y = data
    monkeypatch.setenv("KERAS_DIST_STRATEGY", "one_device")
    history = kd.fit(build_model, x, y, epochs=1, verbose=0)
    assert isinstance(history.model.distribute_strategy, tf.distribute.OneDeviceStrategy)


def test_not_compiled_model_is_rejected(data):
    x, y = data
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        kd.fit(model, x, y, strategy="default", verbose=0)


def test_build_function_must_return_a_model(data):
    x, y = data
    with pytest.raises(TypeError, match="must return a keras.Model; it returned dict"):
        kd.fit(lambda: {}, x, y, strategy="default", verbose=0)


def test_non_model_non_callable_is_rejected(data):
    x, y = data
    with pytest.raises(TypeError, match="compiled keras.Model or a zero-argument function"):
        kd.fit("my_model.keras", x, y, strategy="default", verbose=0)


def test_unknown_strategy_is_rejected(data):
    x, y = data
    with pytest.raises(ValueError, match="Unknown strategy 'tpu'"):
        kd.fit(build_model, x, y, strategy="tpu", verbose=0)


def test_uncloneable_model_gets_a_clear_error(data):
    x, y = data

    class Custom(keras.Model):
        def __init__(self, units, **kwargs):  # no get_config: cannot be cloned
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(units)

        def call(self, inputs):
            return self.dense(inputs)

    model = Custom(1)
    model.compile("sgd", "mse")
    model(x[:1])
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)
    with pytest.raises(ValueError, match="(?s)could not re-create.*Pass a function"):
        kd.fit(model, x, y, strategy=strategy, verbose=0)
