"""Synchronous vs asynchronous training with one worker slowed down.

    python benchmarks/straggler.py            # ~3 minutes on 2 cores

Runs, interleaved, on local clusters started with `keras-dist-run`:

  sync   2 MultiWorkerMirrored workers, global batch 2 x 64;
  async  chief + 2 workers + 1 ps (`AsyncModel`), batch 64 per update;

each with worker 1 slowed `--factor` times (`KERAS_DIST_SLOW_WORKER`) and,
for reference, with nobody slowed. Same model (digits MLP 64-256-256-10, SGD
0.05 momentum 0.9), same data, same examples per epoch (one pass over the
1,437 training digits), same epochs. A StragglerDetector runs in every run.

Each training task measures its training time per epoch (evaluation on the
test digits happens after each epoch, outside the timed part) and writes
a JSON. Reported: examples/s and updates/s after the first epoch (tracing
and start-up excluded), training seconds until test accuracy first reaches
0.90, and whether the detector flagged the slowed worker. Target: async
examples/s >= 2x sync examples/s under the straggler. Writes
benchmarks/results/straggler.json and straggler.png.
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

_FACTOR = flags.DEFINE_float("factor", 4.0, "Slowdown of worker 1.")
_EPOCHS = flags.DEFINE_integer("epochs", 12, "Passes over the training digits.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs per configuration (interleaved).")
_TARGET = flags.DEFINE_float("target_accuracy", 0.90, "Test accuracy to time.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/straggler.json", "JSON path.")
_TRAIN = flags.DEFINE_string("train", None, "Internal: train as a cluster task and "
                             "write the chief's measurements to this path.")

BATCH = 64  # per worker per step, in both modes


def train(out_path):
    """One cluster task's part of a run (every task runs this)."""
    import keras_dist as kd

    strategy = kd.resolve_strategy()  # before any TF op (MultiWorkerMirrored)
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_dist.datasets import load_digits

    asynchronous = isinstance(strategy, tf.distribute.ParameterServerStrategy)
    (x, y), (x_test, y_test) = load_digits()

    def build_model():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    class Clock(keras.callbacks.Callback):
        """Training seconds per epoch; test accuracy after each, untimed."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.start
            probs = self.model(x_test, training=False)
            accuracy = float(np.mean(np.argmax(np.asarray(probs), axis=1) == y_test))
            self.epochs.append({"seconds": seconds, "test_accuracy": accuracy})

    flagged = []
    detector = kd.callbacks.StragglerDetector(
        window=30, action=lambda worker, cost, logs: flagged.append([worker, cost]))
    clock = Clock()
    steps = -(-len(x) // BATCH)  # async: updates per epoch, one pass over the data
    global_batch = BATCH * (1 if asynchronous else strategy.num_replicas_in_sync)
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=_EPOCHS.value,
                     batch_size=global_batch, verbose=0, callbacks=[detector, clock],
                     **({"steps_per_epoch": steps} if asynchronous else {}))
    if not detector.is_chief:
        return
    updates = steps if asynchronous else -(-len(x) // global_batch)
    with open(out_path, "w") as f:
        json.dump({"mode": "async" if asynchronous else "sync", "epochs": clock.epochs,
                   "updates_per_epoch": updates,
                   "examples_per_epoch": steps * BATCH if asynchronous else len(x),
                   "flagged": flagged, "final_loss": history.history["loss"][-1]}, f)


def run_once(mode, factor, tmp):
    out = os.path.join(tmp, f"{mode}-{factor:g}-{time.monotonic_ns()}.json")
    env = dict(os.environ)
    env.pop("KERAS_DIST_SLOW_WORKER", None)
    if factor > 1:
        env["KERAS_DIST_SLOW_WORKER"] = f"1:{factor:g}"
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2",
           "--ps", "1" if mode == "async" else "0", "--", sys.executable,
           os.path.abspath(__file__), f"--train={out}", f"--epochs={_EPOCHS.value}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def summarize(run, target):
    epochs = run["epochs"]
    steady = epochs[1:]  # the first epoch traces functions and starts workers
    seconds = sum(e["seconds"] for e in steady)
    elapsed, to_target = 0.0, None
    for epoch in epochs:
        elapsed += epoch["seconds"]
        if to_target is None and epoch["test_accuracy"] >= target:
            to_target = elapsed
    return {
        "examples_per_s": run["examples_per_epoch"] * len(steady) / seconds,
        "updates_per_s": run["updates_per_epoch"] * len(steady) / seconds,
        "seconds_to_target": to_target,
        "final_test_accuracy": epochs[-1]["test_accuracy"],
        "flagged": sorted({w for w, _ in run["flagged"]}),
    }


def plot(runs, path, factor, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"sync": "tab:red", "async": "tab:blue"}
    for key, repeats in runs.items():
        mode, slowed = key.split("/")
        run = repeats[0]
        t, times = 0.0, []
        for epoch in run["epochs"]:
            t += epoch["seconds"]
            times.append(t)
        left.plot(times, [e["test_accuracy"] for e in run["epochs"]], marker="o", ms=3,
                  color=colors[mode], linestyle="-" if slowed != "none" else ":",
                  label=f"{mode}, {'worker 1 slowed %gx' % factor if slowed != 'none' else 'no straggler'}")
    left.axhline(target, color="gray", lw=0.8)
    left.set(xlabel="training seconds", ylabel="test accuracy", ylim=(0.5, 1.0),
             title="digits test accuracy against training time")
    left.legend(fontsize=8)
    names = list(runs)
    rates = [statistics.median(summarize(r, target)["examples_per_s"] for r in runs[k])
             for k in names]
    right.bar(range(len(names)), rates, color=[colors[k.split("/")[0]] for k in names])
    right.set_xticks(range(len(names)), [k.replace("/none", "\nno straggler").replace(
        "/slowed", f"\nworker 1 {factor:g}x") for k in names], fontsize=8)
    right.set(ylabel="examples / s (after epoch 1)", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    if _TRAIN.value:
        train(_TRAIN.value)
        return
    from rich.console import Console
    from rich.table import Table

    factor, target = _FACTOR.value, _TARGET.value
    runs = {"sync/slowed": [], "async/slowed": [], "sync/none": [], "async/none": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(_REPEATS.value):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            for key in order:
                mode, slowed = key.split("/")
                began = time.perf_counter()
                runs[key].append(run_once(mode, factor if slowed == "slowed" else 1.0, tmp))
                print(f"{key} repeat {repeat}: {time.perf_counter() - began:.0f} s wall",
                      flush=True)
    summary = {}
    for key, repeats in runs.items():
        per = [summarize(r, target) for r in repeats]
        to_target = [p["seconds_to_target"] for p in per if p["seconds_to_target"] is not None]
        summary[key] = {
            "examples_per_s": statistics.median(p["examples_per_s"] for p in per),
            "updates_per_s": statistics.median(p["updates_per_s"] for p in per),
            "seconds_to_target": statistics.median(to_target) if to_target else None,
            "reached_target": f"{len(to_target)}/{len(per)}",
            "final_test_accuracy": statistics.median(p["final_test_accuracy"] for p in per),
            "flagged": sorted({w for p in per for w in p["flagged"]}),
        }
    ratio = summary["async/slowed"]["examples_per_s"] / summary["sync/slowed"]["examples_per_s"]
    ratio_none = summary["async/none"]["examples_per_s"] / summary["sync/none"]["examples_per_s"]
    table = Table(title=f"worker 1 slowed {factor:g}x vs no straggler (median of "
                        f"{_REPEATS.value} runs)")
    for column in ("run", "examples/s", "updates/s", f"s to acc {target:.2f}",
                   "final acc", "flagged"):
        table.add_column(column, justify="left" if column in ("run", "flagged") else "right")
    for key, row in summary.items():
        table.add_row(key, f"{row['examples_per_s']:.0f}", f"{row['updates_per_s']:.1f}",
                      "-" if row["seconds_to_target"] is None
                      else f"{row['seconds_to_target']:.2f}",
                      f"{row['final_test_accuracy']:.3f}", ", ".join(row["flagged"]) or "-")
    Console(width=120).print(table)
    print(f"async / sync examples/s with the straggler: {ratio:.2f} (target >= 2.0); "
          f"without: {ratio_none:.2f}")
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    png = os.path.splitext(_OUTPUT.value)[0] + ".png"
    plot(runs, png, factor, target)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"factor": factor, "epochs": _EPOCHS.value, "repeats": _REPEATS.value,
                   "batch_per_worker": BATCH, "target_accuracy": target,
                   "summary": summary, "ratio_async_sync_slowed": ratio,
                   "ratio_async_sync_none": ratio_none, "runs": runs}, f, indent=1)
    print(f"wrote {_OUTPUT.value} and {png}")


if __name__ == "__main__":
    app.run(main)
