"""Staleness-aware wrappers under local steps on a real cluster; run by keras-dist-run.

argv: out_dir part. The chief writes out_dir/result.json.

- part "train":
  - "one_round": a wrapper as the model's optimizer, one scheduled round
    of K local steps (one worker) against Keras' own `model.fit` of its
    inner optimizer on one device for the same K batches from the same
    weights: the largest weight and inner-state difference (a local step
    has staleness 0: the wrapper is its inner optimizer).
  - "train": the digits MLP with a wrapper as the model's optimizer and
    another as the outer optimizer: test accuracy, version (= pushes), the
    step counts of both optimizers, the outer wrapper's mean scale.
- part "raise": digits with NaN rows, local steps and
  `nonfinite_updates="raise"`: what the user sees.
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
from procs import digits_model, one_local_round  # noqa: E402

K = 4
(X, Y), (X_TEST, Y_TEST) = load_digits()


def one_round(make_wrapper, make_inner):
    keras.utils.set_random_seed(1)
    local = digits_model(make_inner())
    with strategy.scope():
        remote = kd.AsyncModel.from_model(digits_model(make_wrapper(make_inner())))
    weights = one_local_round(strategy, local, remote, X, Y, K)
    inner = remote.optimizer
    while isinstance(inner, kd.optimizers.StalenessAwareOptimizer):
        inner = inner.inner_optimizer
    slots = max(float(np.abs(np.asarray(a.numpy(), np.float64) - b.numpy()).max())
                for a, b in zip(local.optimizer.variables, inner.variables))
    return {"weights": weights, "optimizer_state": slots,
            "iterations": int(remote.optimizer.iterations.numpy()), "version": remote.version}


def train():
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = kd.AsyncModel.from_model(digits_model(kd.optimizers.GapAware(
            keras.optimizers.SGD(0.05, momentum=0.9))))
    outer = kd.optimizers.StalenessLimit(kd.optimizers.DynSGD(keras.optimizers.SGD(1.0)),
                                         max_staleness=1000)
    history = model.fit(X, Y, batch_size=32, epochs=3, steps_per_epoch=40 * K, verbose=0,
                        local_steps=K, outer_optimizer=outer)
    outer = model.outer_optimizer
    return {"test_accuracy": model.evaluate(X_TEST, Y_TEST, verbose=0, return_dict=True)[
                "accuracy"],
            "version": model.version,
            "inner_iterations": int(model.optimizer.iterations.numpy()),
            "outer_iterations": int(outer.iterations.numpy()),
            "outer_logs": outer.staleness_logs(),
            "staleness_max": max(history.history["staleness_max"]),
            "accuracy": history.history["accuracy"], "loss": history.history["loss"],
            "updates_per_worker": {str(k): v for k, v in
                                   model.staleness_stats.updates_per_worker().items()}}


def nonfinite_raise():
    x = X.copy()
    x[::60] = np.nan  # 24 poisoned examples: some rounds end with NaN weights
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = kd.AsyncModel.from_model(digits_model(keras.optimizers.SGD(0.05)))
    model.nonfinite_updates = "raise"
    try:
        model.fit(x, Y, epochs=4, steps_per_epoch=40 * K, batch_size=32, verbose=0,
                  local_steps=K)
        return {"error": None}
    except Exception as error:  # what the user sees
        return {"error": f"{type(error).__name__}: {error}"}


def main(out_dir, part):
    if part == "train":
        result = {"one_round": {
            "dynsgd_momentum": one_round(kd.optimizers.DynSGD,
                                         lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
            "gap_aware_adam": one_round(kd.optimizers.GapAware,
                                        lambda: keras.optimizers.Adam(0.01))},
            "train": train()}
    else:
        result = nonfinite_raise()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, default=float)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
