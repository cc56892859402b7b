"""Time lost letting go of input iterators under MultiWorkerMirroredStrategy.

tf.data's autotuning runs a model thread beside every iterator; it sleeps
between optimizations for a period that doubles up to a minute, and deleting
the iterator waits for it to wake up. `kd.fit` on arrays makes one
distributed iterator per epoch (and per validation), so before keras_dist
turned autotuning off for the datasets it builds from arrays, every epoch
could end with the process idle for up to that period, on every worker.

Iterators that are garbage, not yet collected, keep their threads; when
the collector finally deletes them, possibly in the middle of a later fit, the
wait has grown. So each side runs in its own cluster, one after the other
(alternating every repeat):

    python benchmarks/iterator_release.py

starts `keras-dist-run --workers 2` on this script with `--side=arrays` or
`--side=autotuned`. Each run's workers make `fits` short `kd.fit` calls of
the digits MLP (`epochs` epochs with validation, on `samples` digits: a test
suite's or a sweep's pattern):

- `arrays`: the arrays themselves (keras_dist's dataset, autotuning off);
- `autotuned`: the same dataset with autotuning back on (what keras_dist
  built before), passed as a `tf.data.Dataset`.

The worker 0 of each run writes its fits' wall and CPU seconds and final
weights; this script prints the median run time per side, the ratio autotuned
/ arrays, the CPU time (idle waiting costs wall time, not CPU) and checks
that both sides ended at the same weights. Results go to `--output`.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

import keras_dist as kd

_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Cluster runs of each side (the autotuned side can take minutes).")
_FITS = flags.DEFINE_integer("fits", 12, "kd.fit calls per cluster run.")
_SIDE = flags.DEFINE_enum("side", None, ["arrays", "autotuned"],
                          "Set by the orchestrating run for the cluster's tasks.")
_RESULT = flags.DEFINE_string("result", None, "Set by the orchestrating run.")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Epochs per fit.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Global batch size.")
_SAMPLES = flags.DEFINE_integer(
    "samples", 160, "Training digits used (short fits, as in a test suite or a sweep).")
_OUTPUT = flags.DEFINE_string(
    "output",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                 "iterator_release.json"),
    "Where the chief writes the results (JSON).")


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def worker():
    """One task of a cluster run: `fits` fits of one side."""
    strategy = kd.resolve_strategy()  # collective ops start with the process
    import tensorflow as tf

    from keras_dist.training import data
    from keras_dist.datasets import load_digits

    (x, y), (x_val, y_val) = load_digits()
    x, y, x_val, y_val = x[:_SAMPLES.value], y[:_SAMPLES.value], x_val[:64], y_val[:64]

    def autotuned(x, y):
        dataset = data.from_arrays(x, y, batch_size=_BATCH_SIZE.value, shuffle=False)
        options = tf.data.Options()
        options.autotune.enabled = True
        return dataset.with_options(options)

    if _SIDE.value == "arrays":
        args = dict(x=x, y=y, batch_size=_BATCH_SIZE.value, shuffle=False,
                    validation_data=(x_val, y_val))
    seconds, cpu = [], []
    started = time.perf_counter()
    for _ in range(_FITS.value):
        if _SIDE.value == "autotuned":
            args = dict(x=autotuned(x, y), validation_data=autotuned(x_val, y_val))
        wall, used = time.perf_counter(), time.process_time()
        history = kd.fit(build_model, strategy=strategy, epochs=_EPOCHS.value, verbose=0,
                         **args)
        seconds.append(time.perf_counter() - wall)
        cpu.append(time.process_time() - used)
    if kd.ClusterConfig.from_env().task_index == 0:
        with open(_RESULT.value, "w") as f:
            json.dump({"seconds": seconds, "cpu_seconds": cpu,
                       "total_seconds": time.perf_counter() - started,
                       "weights": [w.tolist() for w in history.model.get_weights()]}, f)


def orchestrate():
    import numpy as np

    runs = {"arrays": [], "autotuned": []}
    weights = {}
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-dist-run")
    for repeat in range(_REPEATS.value):
        order = ["arrays", "autotuned"] if repeat % 2 == 0 else ["autotuned", "arrays"]
        for side in order:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "result.json")
                cmd = [launcher, "--workers", "2", "--", sys.executable, os.path.abspath(__file__),
                       f"--side={side}", f"--result={path}", f"--fits={_FITS.value}",
                       f"--epochs={_EPOCHS.value}", f"--samples={_SAMPLES.value}",
                       f"--batch_size={_BATCH_SIZE.value}"]
                wall = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=1800)
                wall = time.perf_counter() - wall
                with open(path) as f:
                    result = json.load(f)
            weights[side] = [np.asarray(w) for w in result.pop("weights")]
            result["process_seconds"] = wall
            runs[side].append(result)
            print(f"{side:>9}: {_FITS.value} fits in {result['total_seconds']:.1f} s "
                  f"(slowest fit {max(result['seconds']):.1f} s; CPU "
                  f"{sum(result['cpu_seconds']):.1f} s); whole run {wall:.1f} s", flush=True)
    same = max(float(np.max(np.abs(a - b)))
               for a, b in zip(weights["arrays"], weights["autotuned"]))
    median = {side: statistics.median(r["total_seconds"] for r in rs)
              for side, rs in runs.items()}
    median_cpu = {side: statistics.median(sum(r["cpu_seconds"]) for r in rs)
                  for side, rs in runs.items()}
    slowest = {side: max(max(r["seconds"]) for r in rs) for side, rs in runs.items()}
    result = {
        "config": {"repeats": _REPEATS.value, "fits": _FITS.value, "epochs": _EPOCHS.value,
                   "samples": _SAMPLES.value, "batch_size": _BATCH_SIZE.value, "workers": 2},
        "runs": runs, "median_seconds": median, "median_cpu_seconds": median_cpu,
        "slowest_fit_seconds": slowest,
        "ratio": median["autotuned"] / median["arrays"],
        "largest_weight_difference": same,
    }
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{_FITS.value} kd.fit calls per run, 2 MultiWorkerMirrored workers, "
          f"{_REPEATS.value} runs of each side:")
    for side in runs:
        print(f"  {side:>9}: median {median[side]:.1f} s wall, {median_cpu[side]:.1f} s CPU, "
              f"slowest fit {slowest[side]:.1f} s")
    print(f"ratio autotuned / arrays: {result['ratio']:.2f} "
          f"(largest weight difference {same:.1e})")


def main(argv):
    del argv
    if _SIDE.value:
        worker()
    else:
        orchestrate()


if __name__ == "__main__":
    app.run(main)
