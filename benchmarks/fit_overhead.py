"""Overhead of `keras_dist.fit` over plain `keras.Model.fit` on one device.

Both sides train the same digits MLP on the same data with the same seed,
epochs and batch size, `verbose=0`, under TensorFlow's default strategy. Each
timed run covers the whole call, model building included: the plain side
builds and compiles the model and calls `model.fit`; the keras_dist side hands
the same build function to `kd.fit` (which resolves the strategy, builds the
model in its scope, checks it and calls `model.fit`).

Runs are interleaved (the order alternates every repeat) after one discarded
warm-up of each, so drift in machine load hits both sides alike. Prints a
table of medians and the ratios kd / plain, and writes every raw timing to
`--output` as JSON.

Usage:

    python benchmarks/fit_overhead.py
    python benchmarks/fit_overhead.py --repeats=15 --epochs=5
"""

import json
import os
import platform
import statistics
import time

from absl import app
from absl import flags

import keras_dist as kd

_REPEATS = flags.DEFINE_integer(
    "repeats", 7, "Timed runs of each side, after one discarded warm-up each.")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Epochs per run.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the shuffling.")
_TARGET = flags.DEFINE_float(
    "target", 1.03, "Largest acceptable median(kd) / median(plain).")
_OUTPUT = flags.DEFINE_string(
    "output",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                 "fit_overhead.json"),
    "Where to write the raw timings (JSON).")


def build_model():
    """The digits MLP of examples/train_digits.py, seeded."""
    import keras

    keras.utils.set_random_seed(_SEED.value)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def run_plain(x, y):
    model = build_model()
    return model.fit(x, y, epochs=_EPOCHS.value, batch_size=_BATCH_SIZE.value,
                     verbose=0)


def run_kd(x, y):
    return kd.fit(build_model, x, y, strategy="default", epochs=_EPOCHS.value,
                  batch_size=_BATCH_SIZE.value, verbose=0)


def timed(run, x, y):
    """Wall and CPU seconds of one whole run; the session is cleared first, untimed.

    CPU seconds (all of this process's threads) are reported next to wall
    time because they are far less sensitive to other processes competing
    for the same cores.
    """
    import keras

    keras.backend.clear_session()
    cpu_start = time.process_time()
    start = time.perf_counter()
    history = run(x, y)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    return seconds, cpu_seconds, float(history.history["loss"][-1])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import logging

    import keras
    import rich.console
    import rich.table
    import tensorflow as tf

    from keras_dist.datasets import load_digits

    # One "using default strategy" line per kd.fit call would only add noise.
    logging.getLogger("keras_dist").setLevel(logging.WARNING)
    (x, y), _ = load_digits(seed=_SEED.value)
    sides = {"plain": run_plain, "kd": run_kd}
    times = {name: [] for name in sides}
    cpu_times = {name: [] for name in sides}
    final_loss = {name: [] for name in sides}
    warmup = {name: timed(run, x, y)[0] for name, run in sides.items()}
    for repeat in range(_REPEATS.value):
        order = ("plain", "kd") if repeat % 2 == 0 else ("kd", "plain")
        for name in order:
            seconds, cpu_seconds, loss = timed(sides[name], x, y)
            times[name].append(seconds)
            cpu_times[name].append(cpu_seconds)
            final_loss[name].append(loss)

    median = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    ratio_median = median["kd"] / median["plain"]
    ratio_min = best["kd"] / best["plain"]
    ratio_cpu = median_cpu["kd"] / median_cpu["plain"]
    # Each repeat runs the two sides back to back, so the ratio within a pair
    # cancels slow drifts in machine load.
    ratio_paired = statistics.median(
        k / p for p, k in zip(times["plain"], times["kd"]))

    table = rich.table.Table(
        title=f"kd.fit vs model.fit: digits MLP, {_EPOCHS.value} epochs, "
              f"batch {_BATCH_SIZE.value}, {_REPEATS.value} repeats")
    table.add_column("")
    for column in ("median s", "min s", "max s", "median CPU s"):
        table.add_column(column, justify="right")
    for name, label in (("plain", "model.fit"), ("kd", "keras_dist.fit")):
        table.add_row(label, f"{median[name]:.3f}", f"{best[name]:.3f}",
                      f"{max(times[name]):.3f}", f"{median_cpu[name]:.3f}")
    table.add_row("ratio kd/plain", f"{ratio_median:.3f}", f"{ratio_min:.3f}",
                  "", f"{ratio_cpu:.3f}", end_section=True)
    verdict = "ok" if ratio_median <= _TARGET.value else "ABOVE TARGET"
    console = rich.console.Console()
    console.print(table)
    console.print(f"median ratio {ratio_median:.3f} (target <= "
                  f"{_TARGET.value}): {verdict}; median of paired ratios "
                  f"{ratio_paired:.3f}")
    if max(times["plain"]) > 1.5 * best["plain"]:
        console.print("note: runs of the same side differ by more than 50%; "
                      "the machine is busy and the wall-time ratios are noisy.")

    os.makedirs(os.path.dirname(_OUTPUT.value) or ".", exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({
            "benchmark": "fit_overhead",
            "config": {"repeats": _REPEATS.value, "epochs": _EPOCHS.value,
                       "batch_size": _BATCH_SIZE.value, "seed": _SEED.value,
                       "samples": int(len(x)), "strategy": "default"},
            "versions": {"python": platform.python_version(),
                         "tensorflow": tf.__version__,
                         "keras": keras.__version__,
                         "keras_dist": kd.__version__},
            "warmup_seconds": warmup,
            "seconds": times,
            "cpu_seconds": cpu_times,
            "final_loss": final_loss,
            "median_seconds": median,
            "min_seconds": best,
            "median_cpu_seconds": median_cpu,
            "ratio_median": ratio_median,
            "ratio_min": ratio_min,
            "ratio_paired_median": ratio_paired,
            "ratio_cpu_median": ratio_cpu,
            "target": _TARGET.value,
        }, f, indent=2)
    console.print(f"raw timings: {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
