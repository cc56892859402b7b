"""Asynchronous digits training with each staleness-aware wrapper.

Run on every task by keras-dist-run; the chief writes out_dir/result.json
with each wrapper's test accuracy and epoch logs. argv: out_dir [mixed].
With "mixed", it trains under mixed precision policies instead: Keras'
compile puts a LossScaleOptimizer outside the wrapper chain (mixed_float16),
or no loss scaling at all (mixed_bfloat16). The other order (a
LossScaleOptimizer inside a wrapper) is a ValueError (tests/test_optimizers.py).
"""

import json
import os
import sys

import tensorflow as tf

import keras_dist as kd

strategy = kd.resolve_strategy()
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

O = kd.optimizers
# Each wrapper's own update path once; the ones left out take a path run
# here or under mixed precision below: StalenessScaled scales as DynSGD and
# DelayAdaptive do (one StalenessScaling class; its scale() is checked
# against numpy in tests/test_optimizers.py), DCASGD's constant mode is
# its adaptive mode without the running mean (float16-DCASGD), plain
# GapAware runs as bfloat16-GapAware.
WRAPPERS = {
    "DynSGD": lambda: O.DynSGD(keras.optimizers.SGD(0.05, momentum=0.9)),
    "GapAware-momentum": lambda: O.GapAware(
        keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=1e-3), measure="momentum",
        scale_weight_decay=True),
    "StalenessLimit": lambda: O.StalenessLimit(
        O.DynSGD(keras.optimizers.Adam(3e-3)), max_staleness=0),
    # workers=None: N from the cluster (2); the threshold grows as sqrt(k).
    "DelayAdaptive": lambda: O.DelayAdaptive(keras.optimizers.SGD(0.05, momentum=0.9)),
    "Ringmaster": lambda: O.Ringmaster(keras.optimizers.SGD(0.05, momentum=0.9),
                                       threshold="adaptive"),
}


MIXED = {  # name: (policy, optimizer factory)
    "float16-DCASGD": ("mixed_float16", lambda: O.DCASGD(
        keras.optimizers.SGD(0.05, momentum=0.9), mode="adaptive")),
    "bfloat16-GapAware": ("mixed_bfloat16", lambda: O.GapAware(
        keras.optimizers.SGD(0.05, momentum=0.9))),
    "float16-StalenessLimit(DynSGD)": ("mixed_float16", lambda: O.StalenessLimit(
        O.DynSGD(keras.optimizers.SGD(0.05, momentum=0.9)), max_staleness=4)),
}


def main(out_dir):
    (x, y), (x_test, y_test) = load_digits()
    results = {}
    runs = {name: ("float32", make) for name, make in WRAPPERS.items()}
    if sys.argv[2:] == ["mixed"]:
        runs = MIXED
    for name, (policy, make) in runs.items():
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            model = digits_model(make(), cls=kd.AsyncModel, seed=0)
        history = model.fit(x, y, epochs=8, steps_per_epoch=45, batch_size=32, verbose=2)
        accuracy = model.evaluate(x_test, y_test, return_dict=True, verbose=0)["accuracy"]
        results[name] = {"test_accuracy": accuracy, "history": history.history,
                         "version": model.version,
                         "workers": getattr(model.optimizer, "workers", None),
                         "iterations": int(model.optimizer.iterations.numpy()),
                         "optimizer_chain": _chain(model.optimizer)}
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f)


def _chain(optimizer):
    names = []
    while optimizer is not None:
        names.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return names


if __name__ == "__main__":
    main(sys.argv[1])
