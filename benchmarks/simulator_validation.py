"""Does `keras_dist.simulate` predict real asynchronous training?

    python benchmarks/simulator_validation.py          # ~2 minutes on 2 cores

For N = 2 and 4 workers, once with equal workers and once with worker 0
slowed 3x in-graph (`KERAS_DIST_SLOW_WORKER`), a real local cluster (chief,
N workers, 1 ps, started by `keras-dist-run`) trains the digits MLP
asynchronously: `AsyncModel`, plain SGD, steps_per_execution 1, batch 32,
`--epochs` passes. Every update's worker and staleness are recorded.

Then `simulate.fit` trains the same model, same data and learning rate, with
the speed profile *measured* in the real runs (after the first epoch, which
traces and starts up): each worker's mean step time, from its read to its
version claim, over the fastest's gives its slowdown (`stragglers`); the rest of
its cycle (steady wall time / its updates, minus the step) gives its `gap`;
the spread of log step times within each worker gives the log-normal
`sigma`; and, since all the cluster's processes share this machine's cores,
no more workers computing at once than there are cores (`concurrency`). The
simulator without the cores limit, and without the gap (as it was before),
is shown too.
Reported side by side, real (over `--repeats` runs) against simulated (over
`--sim_seeds` seeds): mean and 95th-percentile staleness, each worker's
share of the updates, and the final test accuracy.

"Agrees" means: the mean staleness differs by at most 0.5 or 25%, the p95 by
at most 1 or 25%, and the mean test accuracy by at most the larger of the
two sides' ranges (max - min) and 1.5 points.

Writes benchmarks/results/simulator_validation.{json,png} and prints a table.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app
from absl import flags

_EPOCHS = flags.DEFINE_integer("epochs", 8, "Passes over the training digits.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Real cluster runs per setting.")
_SIM_SEEDS = flags.DEFINE_integer("sim_seeds", 5, "Simulated runs per setting.")
_LR = flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate (no momentum).")
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "sgd", ["sgd", "delay_adaptive", "ringmaster"],
    "What applies the updates, on the cluster and in the simulator alike: plain SGD, "
    "DelayAdaptive(SGD) (N from the cluster / the simulation), or "
    "Ringmaster(SGD, threshold='adaptive') (dropping on both sides: a cluster cannot stop "
    "a step in flight).")
_FACTOR = flags.DEFINE_float("factor", 3.0, "Slowdown of worker 0 in the slowed setting.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/simulator_validation",
                              "Output path without extension.")
_TRAIN = flags.DEFINE_string("train", None, "Internal: train as a cluster task and write "
                             "the chief's records to this path.")
_SEED = flags.DEFINE_integer("seed", 0, "Internal: the real run's seed.")
BATCH = 32
SETTINGS = [(2, False), (2, True), (4, False), (4, True)]  # (workers, worker 0 slowed)


def build_model(keras, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))


def make_optimizer(keras):
    """The `--optimizer` around SGD(`--learning_rate`)."""
    import keras_dist as kd

    sgd = keras.optimizers.SGD(_LR.value)
    if _OPTIMIZER.value == "delay_adaptive":
        return kd.optimizers.DelayAdaptive(sgd)
    if _OPTIMIZER.value == "ringmaster":
        return kd.optimizers.Ringmaster(sgd, threshold="adaptive")
    return sgd


def optimizer_name():
    return {"sgd": "SGD({lr})", "delay_adaptive": "DelayAdaptive(SGD({lr}))",
            "ringmaster": "Ringmaster(SGD({lr}), threshold='adaptive')"}[
        _OPTIMIZER.value].format(lr=_LR.value)


def train(out_path):
    """One cluster task's part of a real run (every task runs this)."""
    import keras_dist as kd

    strategy = kd.resolve_strategy()
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()
        return
    import keras

    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    epochs = []

    class Records(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epochs.append({
                "seconds": time.perf_counter() - self.start,
                "records": [{"worker": r.worker, "staleness": r.staleness,
                             "seconds": r.seconds, "claimed": r.claimed}
                            for r in self.model.staleness_stats.records]})

    with strategy.scope():
        model = kd.AsyncModel.from_model(build_model(keras, _SEED.value))
        model.compile(make_optimizer(keras), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH, epochs=_EPOCHS.value, steps_per_epoch=len(x) // BATCH,
              verbose=0, callbacks=[Records()])
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    with open(out_path, "w") as f:
        json.dump({"epochs": epochs, "test_accuracy": accuracy}, f)


def real_run(workers, slowed, seed, tmp):
    out = os.path.join(tmp, f"real-{workers}-{int(slowed)}-{seed}.json")
    env = dict(os.environ)
    env.pop("KERAS_DIST_SLOW_WORKER", None)
    if slowed:
        env["KERAS_DIST_SLOW_WORKER"] = f"0:{_FACTOR.value:g}"
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", str(workers), "--ps", "1",
           "--", sys.executable, os.path.abspath(__file__), f"--train={out}",
           f"--seed={seed}", f"--epochs={_EPOCHS.value}", f"--learning_rate={_LR.value}",
           f"--optimizer={_OPTIMIZER.value}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"real run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    with open(out) as f:
        run = json.load(f)
    # The first epoch traces the step function and waits for workers to
    # start: the profile and the staleness compared are the later epochs'.
    steady = run["epochs"][1:]
    records = [r for e in steady for r in e["records"]]
    taus = [t for r in records for t in r["staleness"]]
    counts = np.bincount([r["worker"] for r in records], minlength=workers)
    return {"taus": taus, "share": (counts / counts.sum()).tolist(),
            "test_accuracy": run["test_accuracy"],
            "wall_seconds": sum(e["seconds"] for e in steady),
            "updates": counts.tolist(),
            # The window that makes an update stale: from the execution's
            # start (its read) to its version claim, not to the end of its
            # writes.
            "step_seconds": {str(w): [r["claimed"] for r in records if r["worker"] == w]
                             for w in range(workers)}}


def profile(runs, workers):
    """The speed profile the simulator gets, in units of the fastest
    worker's mean step (from its read to its version claim):

    - each worker's slowdown: its mean step time over the fastest's;
    - each worker's gap: the rest of its cycle (wall time / its updates)
      between an update and its next read;
    - sigma: the spread of log step times within each worker, pooled.
    """
    step = {w: float(np.mean([x for r in runs for x in r["step_seconds"][str(w)]]))
            for w in range(workers)}
    cycle = {w: float(np.mean([r["wall_seconds"] / r["updates"][w] for r in runs]))
             for w in range(workers)}
    unit = min(step.values())
    stragglers = {w: step[w] / unit for w in range(workers) if step[w] / unit > 1.0}
    gaps = {w: max(0.0, (cycle[w] - step[w]) / unit) for w in range(workers)}
    deviations = [np.log(x) - np.mean(np.log(v)) for r in runs
                  for v in r["step_seconds"].values() if len(v) > 1 for x in v]
    sigma = float(np.sqrt(np.mean(np.square(deviations)))) if deviations else 0.0
    return stragglers, gaps, sigma


def simulated_run(workers, stragglers, gaps, sigma, seed, concurrency=None):
    import keras

    from keras_dist import simulate
    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    model = build_model(keras, seed)
    model.compile(make_optimizer(keras), "sparse_categorical_crossentropy")
    _, sched = simulate.fit(model, x, y, workers=workers, epochs=_EPOCHS.value,
                            batch_size=BATCH, seed=seed, sigma=sigma, stragglers=stragglers,
                            gap=gaps, concurrency=concurrency)
    pred = np.argmax(model.predict(x_test, verbose=0), axis=1)
    steady = slice(len(x) // BATCH, None)  # as the real runs: after the first epoch
    counts = np.bincount(sched.workers[steady], minlength=workers)
    return {"taus": sched.staleness[steady].tolist(), "share": (counts / counts.sum()).tolist(),
            "test_accuracy": float(np.mean(pred == y_test))}


def summary(runs):
    taus = [t for r in runs for t in r["taus"]]
    accuracy = [r["test_accuracy"] for r in runs]
    return {"tau_mean": float(np.mean(taus)), "tau_p95": float(np.percentile(taus, 95)),
            "share": np.mean([r["share"] for r in runs], axis=0).round(3).tolist(),
            "accuracy_mean": statistics.mean(accuracy),
            "accuracy_range": [min(accuracy), max(accuracy)],
            "tau_histogram": np.bincount(taus).tolist()}


def agrees(real, sim):
    def close(a, b, absolute):
        return abs(a - b) <= max(absolute, 0.25 * max(a, b))

    spread = max(real["accuracy_range"][1] - real["accuracy_range"][0],
                 sim["accuracy_range"][1] - sim["accuracy_range"][0], 0.015)
    return {"tau_mean": close(real["tau_mean"], sim["tau_mean"], 0.5),
            "tau_p95": close(real["tau_p95"], sim["tau_p95"], 1.0),
            "accuracy": abs(real["accuracy_mean"] - sim["accuracy_mean"]) <= spread}


def main(argv):
    del argv
    if _TRAIN.value:
        train(_TRAIN.value)
        return
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers, slowed in SETTINGS:
            real = [real_run(workers, slowed, seed, tmp) for seed in range(_REPEATS.value)]
            stragglers, gaps, sigma = profile(real, workers)
            # The whole model: the measured profile, and no more workers
            # computing at once than the machine has cores (all processes of
            # the real cluster share them).
            cores = os.cpu_count() or 1
            limit = cores if cores < workers else None
            seeds = range(_SIM_SEEDS.value)
            sim = [simulated_run(workers, stragglers, gaps, sigma, s, limit) for s in seeds]
            # Its parts, for comparison: without the cores, and without the gap
            # (the simulator before this benchmark).
            gap_only = [simulated_run(workers, stragglers, gaps, sigma, s) for s in seeds]
            no_gap = [simulated_run(workers, stragglers, 0.0, sigma, s) for s in seeds]
            row = {"workers": workers, "slowed": slowed, "stragglers": stragglers,
                   "gaps": gaps, "sigma": sigma, "concurrency": limit, "real": summary(real),
                   "simulated": summary(sim), "simulated_gap_only": summary(gap_only),
                   "simulated_without_gap": summary(no_gap)}
            row["agrees"] = agrees(row["real"], row["simulated"])
            rows.append(row)
            print(f"N={workers} {'slowed' if slowed else 'equal'} done "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    report(rows, time.perf_counter() - start)


def report(rows, seconds):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Real clusters vs keras_dist.simulate ({_EPOCHS.value} epochs, "
                        f"{optimizer_name()}, {_REPEATS.value} real runs, {_SIM_SEEDS.value} "
                        "simulated)")
    for column in ("setting", "profile given", "tau mean real / sim (gap only; no gap)",
                   "tau p95 real / sim", "update share real / sim", "accuracy real / sim",
                   "agrees"):
        table.add_column(column)
    for row in rows:
        real, sim = row["real"], row["simulated"]
        setting = f"N={row['workers']}" + (f", worker 0 x{_FACTOR.value:g}" if row["slowed"]
                                          else ", equal")
        given = (", ".join(f"w{w} x{f:.2f}" for w, f in row["stragglers"].items()) or "equal")
        gaps = " ".join(f"{g:.1f}" for g in row["gaps"].values())
        cores = f"; at most {row['concurrency']} at once" if row["concurrency"] else ""
        table.add_row(
            setting, f"{given}; gaps {gaps}; sigma {row['sigma']:.2f}{cores}",
            f"{real['tau_mean']:.2f} / {sim['tau_mean']:.2f} "
            f"({row['simulated_gap_only']['tau_mean']:.2f}; "
            f"{row['simulated_without_gap']['tau_mean']:.2f})",
            f"{real['tau_p95']:.1f} / {sim['tau_p95']:.1f}",
            f"{real['share']} / {sim['share']}",
            f"{100 * real['accuracy_mean']:.1f} [{100 * real['accuracy_range'][0]:.1f}-"
            f"{100 * real['accuracy_range'][1]:.1f}] / {100 * sim['accuracy_mean']:.1f} "
            f"[{100 * sim['accuracy_range'][0]:.1f}-{100 * sim['accuracy_range'][1]:.1f}]",
            ", ".join(k for k, ok in row["agrees"].items() if ok) or "no")
    Console(width=220).print(table)
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value + ".json", "w") as f:
        json.dump({"rows": rows, "epochs": _EPOCHS.value, "learning_rate": _LR.value,
                   "optimizer": optimizer_name(),
                   "factor": _FACTOR.value, "repeats": _REPEATS.value,
                   "sim_seeds": _SIM_SEEDS.value, "seconds": seconds}, f, indent=1)
    plot(rows)
    print(f"wrote {_OUTPUT.value}.json and .png ({seconds:.0f} s)")


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.6), sharey=True)
    for ax, row in zip(axes, rows):
        for side, style in (("real", "-o"), ("simulated", "--s")):
            hist = np.asarray(row[side]["tau_histogram"], float)
            ax.plot(np.arange(len(hist)), hist / hist.sum(), style, label=side, markersize=4)
        ax.set_title(f"N={row['workers']}" + (", worker 0 slowed" if row["slowed"] else
                                              ", equal"), fontsize=9)
        ax.set_xlabel("staleness tau")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of updates")
    axes[0].legend()
    fig.suptitle("Staleness distribution: real local clusters vs keras_dist.simulate")
    fig.tight_layout()
    fig.savefig(_OUTPUT.value + ".png", dpi=120)


if __name__ == "__main__":
    app.run(main)
