"""A user's `train_step` under parameter servers; run by keras-dist-run.

Two models with the same custom `train_step` (from
tests/equivalence_cases.py: loss multiplied by a weight, here with a metric
counting its calls): a `keras.Model` subclass trained with
`kd.fit` and loss weight 0 (the update must be exactly zero: the weights
may not move), and a `kd.AsyncModel` subclass trained with `model.fit` and
loss weight 1 (it must learn). A functional-style subclass with its own
`train_step` / `test_step` keeps its class and steps through `kd.fit`. Then a plain model trains on a
`tf.data.Dataset` created before the strategy connected this process to the
cluster (TensorFlow placed it on /job:localhost, which then no longer
exists), validates and evaluates on another such dataset. The chief writes
out_dir/result.json. argv: out_dir.
"""

import json
import os
import sys

import numpy as np

import tensorflow as tf

import keras_dist as kd
from keras_dist.datasets import load_digits

# Made before kd.resolve_strategy(), as a user may: it must still train.
(_x, _y), (_x_test, _y_test) = load_digits()
EARLY_TRAIN = tf.data.Dataset.from_tensor_slices((_x, _y)).shuffle(1000, seed=0).batch(32)
EARLY_TEST = tf.data.Dataset.from_tensor_slices((_x_test, _y_test)).batch(64)

strategy = kd.resolve_strategy()

import keras  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from equivalence_cases import WeightedStep  # noqa: E402
from procs import digits_model  # noqa: E402

EPOCHS, STEPS = 3, 40


class CallCounting(WeightedStep):
    """Counts calls, not examples: each step is one call on one worker."""

    def count(self, x):
        return 1.0


class PlainSubclass(CallCounting, keras.Model):
    def __init__(self, loss_weight, **kwargs):
        keras.Model.__init__(self, **kwargs)
        self.loss_weight = loss_weight
        self.setup(hidden=64, outputs=10, counter="calls")


class AsyncSubclass(CallCounting, kd.AsyncModel):
    def __init__(self, loss_weight, **kwargs):
        kd.AsyncModel.__init__(self, **kwargs)
        self.loss_weight = loss_weight
        self.setup(hidden=64, outputs=10, counter="calls")


class FunctionalStyle(keras.Model):
    """Built as `FunctionalStyle(inputs, outputs)` (issue 47, item 1): it was
    re-wrapped as an AsyncModel, losing this class and these steps."""

    def train_step(self, data):
        return {**super().train_step(data), "custom_marker": tf.constant(3.0)}

    def test_step(self, data):
        return {**super().test_step(data), "test_marker": tf.constant(5.0)}


def build_functional_style():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(10, activation="softmax")(
        keras.layers.Dense(32, activation="relu")(inputs))
    model = FunctionalStyle(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def functional_style(x, y, x_test, y_test):
    """What a functional-style subclass is after `kd.fit`, and what then
    works on it, as Keras' `fit` leaves it on one device."""
    history = kd.fit(build_functional_style, x, y, strategy=strategy, epochs=2,
                     steps_per_epoch=10, batch_size=32, verbose=0)
    model = history.model
    try:
        model.evaluate(x_test, y_test, verbose=0, no_such_argument=1)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {
        "class": type(model).__name__,
        "history_keys": list(history.history),
        "evaluate": model.evaluate(x_test, y_test, verbose=0, return_dict=True),
        "kd_evaluate": kd.evaluate(model, x_test, y_test, verbose=0, return_dict=True),
        "predict_shape": list(model.predict(x_test, verbose=0).shape),
        "refused": refused,
        "version": model.version_counter.value,
    }


def build(cls, loss_weight):
    keras.utils.set_random_seed(0)
    model = cls(loss_weight)
    model(np.zeros((1, 64), "float32"))
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(out_dir):
    (x, y), (x_test, y_test) = load_digits()
    result = {}
    with strategy.scope():
        frozen = build(PlainSubclass, 0.0)
    before = [w.copy() for w in frozen.get_weights()]
    history = kd.fit(frozen, x, y, strategy=strategy, epochs=EPOCHS, steps_per_epoch=STEPS,
                     batch_size=32, verbose=0)
    result["frozen"] = {
        "history": history.history,
        "largest_change": max(float(np.max(np.abs(a - b)))
                              for a, b in zip(before, history.model.get_weights())),
        "version": history.model.version_counter.value,
    }
    with strategy.scope():
        model = build(AsyncSubclass, 1.0)
    history = model.fit(x, y, epochs=EPOCHS, steps_per_epoch=STEPS, batch_size=32, verbose=0)
    result["learning"] = {
        "history": history.history,
        "test_accuracy": kd.evaluate(model, x_test, y_test, return_dict=True,
                                     verbose=0)["accuracy"],
        "version": model.version,
    }
    result["steps"] = EPOCHS * STEPS

    def build_plain():
        return digits_model(keras.optimizers.SGD(0.05, momentum=0.9), seed=0)

    history = kd.fit(build_plain, EARLY_TRAIN, strategy=strategy, epochs=2,
                     validation_data=EARLY_TEST, verbose=0)
    result["early_dataset"] = {
        "history": history.history,
        "test_accuracy": kd.evaluate(history.model, EARLY_TEST, return_dict=True,
                                     verbose=0)["accuracy"],
    }
    result["functional_style"] = functional_style(x, y, x_test, y_test)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
