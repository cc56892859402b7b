"""DANA on a real parameter-server cluster; run by keras-dist-run.

The chief writes out_dir/result.json with:

- "one_execution": one scheduled execution of K steps (so one worker) from
  the same weights as Keras' own `fit` of `SGD(nesterov=True)` on one
  device over the same K batches: the largest weight difference, and the
  velocities (the running worker's row against Keras' momentum, -m / eta;
  the other worker's row must still be zero).
- "train": the digits MLP trained asynchronously by both workers: test
  accuracy, version, updates per worker, and which velocity rows moved.

argv: out_dir.
"""

import json
import os
import sys

import numpy as np

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

K, ETA, GAMMA = 4, 0.05, 0.9
(X, Y), (X_TEST, Y_TEST) = load_digits()


def one_execution():
    keras.utils.set_random_seed(1)
    local = digits_model(keras.optimizers.SGD(ETA, momentum=GAMMA, nesterov=True))
    init = [w.numpy() for w in local.weights]
    with strategy.scope():
        remote = kd.AsyncModel.from_model(
            digits_model(kd.optimizers.DANA(keras.optimizers.SGD(ETA), momentum=GAMMA),
                         steps_per_execution=K))
    remote.set_weights(init)
    remote.fit(X[:32 * K], Y[:32 * K], batch_size=32, epochs=1, steps_per_epoch=K,
               shuffle=False, verbose=0)
    with kd.local_fit():  # the chief's own reference model
        local.fit(X[:32 * K], Y[:32 * K], batch_size=32, epochs=1, shuffle=False,
                  verbose=0)
    [worker] = remote.staleness_stats.updates_per_worker()
    keras_momenta = [m.numpy() for m in local.optimizer.variables if "momentum" in m.path]
    velocities = [v.numpy() for v in remote.optimizer.velocities]
    return {
        "workers": remote.optimizer.workers,
        "worker": int(worker),
        "weights": max(float(np.abs(a.numpy() - b.numpy()).max())
                       for a, b in zip(local.weights, remote.weights)),
        "velocity_vs_keras": max(float(np.abs(v[worker] + m / ETA).max())
                                 for v, m in zip(velocities, keras_momenta)),
        "other_rows": max(float(np.abs(np.delete(v, worker, axis=0)).max())
                          for v in velocities),
        "velocity_size": max(float(np.abs(v[worker]).max()) for v in velocities),
    }


def train():
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = kd.AsyncModel.from_model(
            digits_model(kd.optimizers.DANA(keras.optimizers.SGD(ETA), momentum=GAMMA)))
    history = model.fit(X, Y, batch_size=32, epochs=8, steps_per_epoch=45, verbose=0)
    velocities = [v.numpy() for v in model.optimizer.velocities]
    return {"test_accuracy": model.evaluate(X_TEST, Y_TEST, verbose=0, return_dict=True)[
                "accuracy"],
            "version": model.version, "loss": history.history["loss"],
            "updates_per_worker": {str(k): v for k, v in
                                   model.staleness_stats.updates_per_worker().items()},
            "rows_moved": [bool(any(np.abs(v[w]).max() > 0 for v in velocities))
                           for w in range(model.optimizer.workers)]}


def main(out_dir):
    result = {"one_execution": one_execution(), "train": train()}
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
