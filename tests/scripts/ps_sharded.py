"""Sharded variables (a `variable_partitioner`) on a real parameter-server
cluster; run by keras-dist-run.

argv: out_dir mode max_shards

- mode "train" (2 parameter servers): a recommender-style model (Embedding,
  pooling, MLP) whose table and first kernel the partitioner splits.
  The chief writes out_dir/result.json with
  - "placement": each sharded model / optimizer variable's shard devices;
  - "equal": one execution of K steps on one worker, sharded against
    Keras' own `model.fit` on one device for each distinct update path of
    training/sharded.py (slots: momentum; a clipped composite gradient:
    Adam + clipnorm; weight decay: AdamW; a whole-variable rule: Lamb), and
    against the same model unsharded on the same cluster for two wrappers
    that read the pulled weights (DC-ASGD, Gap-Aware): largest weight /
    slot differences;
  - "train": two workers asynchronously, sharded: test accuracy; and with
    local steps;
  - "backup": BackupAndRestore of a sharded model resumes (epochs run,
    restored weights' difference);
  and saves the trained sharded model (out_dir/sharded.keras,
  sharded.weights.h5, sharded.npz: predictions and optimizer variables).
- mode "load" (any number of parameter servers): loads
  out_dir/one_device.keras (saved by the test on one device), reports its
  shards' devices (FixedShardsPartitioner), prediction and optimizer-state
  differences against out_dir/one_device.npz, the same for `load_weights`,
  trains it on, and trains with `kd.fit(..., variable_partitioner=...)`.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keras_dist as kd  # noqa: E402
from sharded_cases import data, recommender  # noqa: E402

OUT, MODE, MAX_SHARDS = sys.argv[1], sys.argv[2], int(sys.argv[3])


if MODE == "train":
    PARTITIONER = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1024, max_shards=MAX_SHARDS)
else:  # another of TF's partitioners: every variable in MAX_SHARDS shards
    PARTITIONER = tf.distribute.experimental.partitioners.FixedShardsPartitioner(MAX_SHARDS)
strategy = kd.resolve_strategy(variable_partitioner=PARTITIONER)
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402

K = 4
EPOCHS = 5  # asynchronous runs: 5 gave 0.94-0.98 test accuracy between runs (the bar: 0.85)
ADAM = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
X, Y = data(4000, 0)
X_TEST, Y_TEST = data(1000, 1)


def remote(make_optimizer, **kwargs):
    with strategy.scope():
        return recommender(make_optimizer(), kd.AsyncModel, **kwargs)


def devices(variable):
    return [s.device for s in kd.sharded.shards(variable)]


def placement():
    model = remote(ADAM)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    return {"model": {v.path: devices(v) for v in model.weights if kd.sharded.is_sharded(v)},
            "optimizer": {v.path: devices(v) for v in model.optimizer.variables
                          if kd.sharded.is_sharded(v)}}


def max_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
               for x, y in zip(a, b))


# One per distinct update path of training/sharded.py (plain SGD, Adam and
# DynSGD take paths these already take: zero slots, per-shard slots, a
# scaled gradient).
OPTIMIZERS = {
    "momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.02),
    # Weight decay and a non-elementwise rule: whole-variable updates.
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    # Wrappers: DC-ASGD and Gap-Aware read the pulled weights. One worker,
    # one execution: every update has staleness 0, where DC-ASGD's
    # compensation and Gap-Aware's gap are 0, so each must give what it
    # gives on one device (where the pulled weights are the weights).
    "dcasgd": lambda: kd.optimizers.DCASGD(keras.optimizers.SGD(0.5), lambda_=0.5),
    "gapaware": lambda: kd.optimizers.GapAware(keras.optimizers.SGD(0.5, momentum=0.9)),
}


class Gradients(keras.callbacks.Callback):
    """Each step's gradients of a model trained with SGD(lr, momentum=mu),
    from its momentums: Keras' SGD sets m = mu * m - lr * g."""

    def __init__(self, lr, mu):
        super().__init__()
        self.lr, self.mu, self.steps = lr, mu, []

    def on_train_batch_end(self, batch, logs=None):
        m = [v.numpy().astype(np.float64) for v in self.model.optimizer.momentums]
        before = self.steps[-1][1] if self.steps else [np.zeros_like(x) for x in m]
        self.steps.append(([(self.mu * b - x) / self.lr for b, x in zip(before, m)], m))


def gap_second_moments(steps, beta):
    """GapAware's average of g * g (measure="gradient") after `steps`."""
    v = [np.zeros_like(g) for g in steps[0][0]]
    for grads, _ in steps:
        v = [beta * a + (1 - beta) * g * g for a, g in zip(v, grads)]
    return v


def equal():
    results = {}
    for name, make in OPTIMIZERS.items():
        keras.utils.set_random_seed(1)
        optimizer = make()
        wrapper = isinstance(optimizer, kd.optimizers.StalenessAwareOptimizer)
        # A wrapper's reference is Keras' fit with its inner optimizer.
        local = recommender(optimizer.inner_optimizer if wrapper else optimizer)
        init = [w.numpy() for w in local.weights]
        model = remote(make, steps_per_execution=K)
        model.set_weights(init)
        model.fit(X[:32 * K], Y[:32 * K], batch_size=32, epochs=1, steps_per_epoch=K,
                  shuffle=False, verbose=0)
        gradients = Gradients(0.5, 0.9) if name == "gapaware" else None
        with kd.local_fit():  # the chief's own reference model
            local.fit(X[:32 * K], Y[:32 * K], batch_size=32, epochs=1, shuffle=False, verbose=0,
                      callbacks=[gradients] if gradients else None)
        slots = model.optimizer.inner_optimizer if wrapper else model.optimizer
        result = results[name] = {
            "iterations": int(model.optimizer.iterations.numpy()),
            "sharded_variables": [v.path for v in model.weights if kd.sharded.is_sharded(v)],
            "sharded_vs_keras": max_diff(model.weights, local.weights),
            "slots_sharded_vs_keras": max_diff(slots.variables, local.optimizer.variables),
        }
        if wrapper:  # the wrapper's own path ran for each update (its scale's count)
            own = {v.name: v for v in model.optimizer.own_variables}
            result["wrapper_updates"] = float(own["scale_count"].numpy())
        if gradients:  # Gap-Aware's own state, sharded: relative to its largest value
            expected = gap_second_moments(gradients.steps, model.optimizer.beta)
            got = [v for v in model.optimizer.own_variables if "gap_second_moment" in v.path]
            result["gap_second_moments_relative"] = max_diff(got, expected) / max(
                float(np.abs(e).max()) for e in expected)
    return results


def train():
    results = {}
    for label, local_steps in (("sharded", 1), ("sharded_local_steps", 4)):
        keras.utils.set_random_seed(2)
        model = remote(ADAM)
        history = model.fit(X, Y, batch_size=64, epochs=EPOCHS, verbose=0, local_steps=local_steps)
        results[label] = {"test_accuracy": float(model.evaluate(X_TEST, Y_TEST, verbose=0)[1]),
                          "loss": history.history["loss"], "version": model.version}
        if label == "sharded":
            save(model)
    return results


def save(model):
    model.save(os.path.join(OUT, "sharded.keras"))
    model.save_weights(os.path.join(OUT, "sharded.weights.h5"))
    np.savez(os.path.join(OUT, "sharded.npz"), predictions=model.predict(X_TEST, verbose=0),
             **{f"opt_{i}": v.numpy() for i, v in enumerate(model.optimizer.variables)})


class Seen(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [w.numpy() for w in self.model.weights]


def backup():
    backup_dir = os.path.join(OUT, "backup")
    first = remote(ADAM)
    first.fit(X, Y, batch_size=64, epochs=1, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)])
    second, seen = remote(ADAM), Seen()
    history = second.fit(X, Y, batch_size=64, epochs=2, verbose=0,
                         callbacks=[kd.callbacks.BackupAndRestore(backup_dir), seen])
    return {"epochs_run": len(history.history["loss"]),
            "restored_difference": max_diff(seen.weights, first.weights)}


def load():
    reference = np.load(os.path.join(OUT, "one_device.npz"))
    with strategy.scope():
        model = keras.models.load_model(os.path.join(OUT, "one_device.keras"))
    result = {
        "placement": {v.path: devices(v) for v in model.weights if kd.sharded.is_sharded(v)},
        "optimizer_placement": {v.path: devices(v) for v in model.optimizer.variables
                                if kd.sharded.is_sharded(v)},
        # A plain keras.Model: Keras' predict does not run under parameter
        # servers (kd.AsyncModel's does), so call it on the chief.
        "predictions": max_diff([model(X_TEST, training=False)], [reference["predictions"]]),
        "optimizer_variables": len(model.optimizer.variables),
        "optimizer_state": max_diff(model.optimizer.variables,
                                    [reference[f"opt_{i}"] for i in range(len(model.optimizer.variables))]),
    }
    with strategy.scope():
        fresh = recommender(ADAM(), kd.AsyncModel)
    fresh.load_weights(os.path.join(OUT, "one_device.weights.h5"))
    result["load_weights_predictions"] = max_diff([fresh.predict(X_TEST, verbose=0)],
                                                  [reference["predictions"]])
    before = float(fresh.evaluate(X_TEST, Y_TEST, verbose=0)[1])
    fresh.fit(X, Y, batch_size=64, epochs=2, verbose=0)
    result["accuracy_before_after"] = [before, float(fresh.evaluate(X_TEST, Y_TEST, verbose=0)[1])]
    # kd.fit with the partitioner (the one this process's strategy has) and a
    # model function: the model it trains is sharded.
    history = kd.fit(lambda: recommender(ADAM()), X, Y, batch_size=64, epochs=1, verbose=0,
                     variable_partitioner=PARTITIONER)
    result["kd_fit_table"] = devices(history.model.get_layer("table").embeddings)
    try:
        kd.fit(lambda: recommender(ADAM()), X, Y, epochs=1, verbose=0,
               variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner())
    except ValueError as error:
        result["other_partitioner_error"] = str(error)
    return result


def main():
    if MODE == "train":
        result = {"placement": placement(), "equal": equal(), "train": train(),
                  "backup": backup()}
    else:
        result = load()
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
