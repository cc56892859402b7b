"""Staleness at scale: every method tuned, two tasks, equal examples, simulated time.

    python benchmarks/staleness_convergence.py     # ~25 min on 2 cores (see docs/benchmarks.md)

Simulates N asynchronous workers in one process with `keras_dist.simulate`
(each gradient on the weights its worker pulled; updates through the real
keras_dist optimizers in order of completion) and trains a 64-64-10 ReLU
MLP on two tasks: the digits, and `keras_dist.datasets.load_teacher`, a
generated teacher-student task that separates methods where the digits
put every good one at 96-97%.

What makes it fair (issue 15's method, kept):

- **Same examples for everyone.** `--epochs` passes of batch 32 over the
  same training split, whatever the method or N (local steps: k batches a
  push; synchronous SGD: N batches an update).
- **Each method at its own best learning rate**: a grid per method (8
  values, a factor of about 3 apart), the best chosen on a validation split
  (20% of the training set) averaged over `--sweep_seeds` seeds; then
  `--seeds` seeds at that rate, *test* accuracy reported as mean [min-max].
  A best rate on the grid's edge is starred.
- **Baselines**: sequential SGD (one worker) with and without momentum;
  synchronous SGD with momentum 0.9, linear scaling and warm-up (Goyal et
  al. 2017), without and with backup workers (the slowest b of N + b
  gradients dropped each step, b = max(1, round(0.05 N)); Chen et al. 2016).

The equal-examples table uses equal workers (log-normal step times, sigma
0.2). The **simulated-time view** then runs every method at its chosen rate
with workers of unequal speed: each worker's steps are slowed by a factor
drawn once from a heavy-tailed Pareto law (shape 2.5, mean 1; the same
factors for every method), on top of the per-step log-normal draws. Times
are in one-batch step units (a push of k local steps counts k); network
time is not modelled (`docs/scaling-beyond-one-machine.md`). It reports
each method's accuracy, its simulated time for the epochs, and the time
it takes to reach a target accuracy on validation.

Writes benchmarks/results/staleness_convergence.{json,png} and prints the tables.
"""

import json
import multiprocessing
import os
import statistics
import time

import numpy as np
from absl import app
from absl import flags

_TASKS = flags.DEFINE_list("tasks", ["digits", "teacher"], "Tasks: digits, teacher.")
_WORKERS = flags.DEFINE_list("workers", ["16", "64", "256"], "Simulated worker counts.")
_TIME_WORKERS = flags.DEFINE_list("time_workers", ["64", "256"],
                                  "Worker counts of the simulated-time view (empty: none).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds trained at each method's chosen rate.")
_SWEEP_SEEDS = flags.DEFINE_integer("sweep_seeds", 2, "Seeds averaged to choose each rate.")
_EPOCHS = flags.DEFINE_integer("epochs", 40, "Passes over the training split (all methods).")
_JOBS = flags.DEFINE_integer("jobs", 2, "Processes running simulations side by side.")
_TARGET = flags.DEFINE_float("target_gap", 0.05, "The simulated-time view's target: "
                             "tuned sequential SGD's test accuracy minus this.")
_BUDGETS = flags.DEFINE_list("budgets", [], "Larger example budgets (epochs) for the budget "
                             "table at --budget_workers, e.g. 100,200 (issue 15's); default none.")
_BUDGET_WORKERS = flags.DEFINE_list("budget_workers", ["64", "256"],
                                    "Worker counts of the budget table.")
_OUT = flags.DEFINE_string("output", "benchmarks/results/staleness_convergence",
                           "Output path without extension.")
BATCH = 32
MOMENTUM = 0.9
LOCAL_STEPS = 4
PARETO_SHAPE = 2.5
GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)  # SGD without momentum
SLOW = tuple(lr / 10 for lr in GRID)  # momentum 0.9: ten times the step

# name -> (kind, options, learning-rate grid). kind: "sequential", "sync" or
# "async"; options say how to build and run it (see `optimizer`, `run`).
METHODS = {
    "sequential SGD": ("sequential", {}, GRID),
    "sequential SGD, momentum 0.9": ("sequential", {"momentum": MOMENTUM}, SLOW),
    "sync SGD, momentum 0.9": ("sync", {"momentum": MOMENTUM}, SLOW),
    "sync SGD, momentum 0.9, backup workers": ("sync", {"momentum": MOMENTUM, "backup": True},
                                               SLOW),
    "plain async": ("async", {}, GRID),
    "DANA (momentum 0.9)": ("async", {"wrapper": "DANA"}, SLOW),
    "GapAware(DANA)": ("async", {"wrapper": "GapAware(DANA)"}, GRID),
    "DelayAdaptive": ("async", {"wrapper": "DelayAdaptive"}, GRID),
    "DelayAdaptive(DANA)": ("async", {"wrapper": "DelayAdaptive(DANA)"}, SLOW),
    "Ringmaster (adaptive R, stops)": ("async", {"wrapper": "Ringmaster", "stops": True}, GRID),
    "Ringmaster(DANA) (adaptive R, stops)": (
        "async", {"wrapper": "Ringmaster(DANA)", "stops": True}, SLOW),
    "async local SGD k=4, DelayedNesterov": ("async", {"local": LOCAL_STEPS}, GRID),
}
# Only where workers differ in speed: DyLU gives each its share of k.
TIME_ONLY = {
    "async local SGD k=4, DelayedNesterov, DyLU": (
        "async", {"local": LOCAL_STEPS, "dylu": True}, "async local SGD k=4, DelayedNesterov"),
}
BUDGET_METHODS = ("sequential SGD", "sync SGD, momentum 0.9", "plain async",
                  "DANA (momentum 0.9)", "GapAware(DANA)")


def backups(workers):
    """Chen et al. 2016's b for N workers (ALGORITHMS.md section 7)."""
    return max(1, round(0.05 * workers))


def optimizer(options, lr):
    import keras

    import keras_dist as kd

    wrapper = options.get("wrapper")
    sgd = keras.optimizers.SGD(lr, momentum=options.get("momentum", 0.0))
    if wrapper == "DANA":
        return kd.optimizers.DANA(sgd, momentum=MOMENTUM)
    if wrapper == "GapAware(DANA)":
        return kd.optimizers.GapAware(kd.optimizers.DANA(sgd, momentum=MOMENTUM))
    if wrapper == "DelayAdaptive":
        return kd.optimizers.DelayAdaptive(sgd)
    if wrapper == "DelayAdaptive(DANA)":
        return kd.optimizers.DelayAdaptive(kd.optimizers.DANA(sgd, momentum=MOMENTUM))
    if wrapper == "Ringmaster":
        return kd.optimizers.Ringmaster(sgd, threshold="adaptive")
    if wrapper == "Ringmaster(DANA)":
        return kd.optimizers.Ringmaster(kd.optimizers.DANA(sgd, momentum=MOMENTUM),
                                        threshold="adaptive")
    return sgd


def slow_factors(workers, seed=2024):
    """Each worker's persistent slowdown, drawn once from a Pareto law with
    shape PARETO_SHAPE and mean 1 (the same for every method)."""
    rng = np.random.default_rng(seed)
    minimum = (PARETO_SHAPE - 1) / PARETO_SHAPE
    return {w: float(minimum * (1 + rng.pareto(PARETO_SHAPE))) for w in range(workers)}


# ------------------------------------------------------------ one run (a job)
_DATA = {}


def _init(tasks):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from keras_dist import datasets

    for task in tasks:
        (x, y), (x_test, y_test) = getattr(datasets, f"load_{task}")()
        order = np.random.default_rng(12345).permutation(len(x))
        cut = int(0.8 * len(x))
        _DATA[task] = dict(train=(x[order[:cut]], y[order[:cut]]),
                           val=(x[order[cut:]], y[order[cut:]]), test=(x_test, y_test))


def run(job):
    """One training run: {"val", "test", "tau"}; with `timed`, also each
    epoch's validation accuracy and simulated end time."""
    import warnings

    import keras

    import keras_dist as kd
    from keras_dist import simulate

    task, kind, options, lr, workers, seed, epochs, timed = job
    data = _DATA[task]
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(optimizer(options, lr), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x, y = data["train"]
    common = dict(epochs=epochs, batch_size=BATCH, seed=seed,
                  validation_data=data["val"] if timed else None)
    n = 1 if kind == "sequential" else workers
    tau, stopped, scale = 0.0, 0, 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrappers outside async training: none here
        if kind == "sync":
            b = backups(n) if options.get("backup") else 0
            speed = {"stragglers": slow_factors(n + b)} if timed else {}
            history, sched = simulate.sync_fit(model, x, y, workers=n, backup=b, **common,
                                               **speed)
        else:
            extra = {}
            if timed and kind == "async":
                extra["stragglers"] = slow_factors(n)
            if options.get("stops"):
                extra["restart_stale"] = "adaptive"
            if options.get("local"):
                scale = options["local"]
                extra.update(local_steps=scale, outer_optimizer=kd.optimizers.DelayedNesterov(),
                             dynamic_local_steps=bool(options.get("dylu")))
            history, sched = simulate.fit(model, x, y, workers=n, **common, **extra)
            tau, stopped = sched.mean_staleness, sched.stopped

    def accuracy(split):
        xs, ys = data[split]
        pred = model.predict(xs, batch_size=512, verbose=0)
        return float(np.mean(np.argmax(pred, axis=1) == ys)) if np.all(
            np.isfinite(pred)) else 0.0

    out = {"val": accuracy("val"), "test": accuracy("test"), "tau": tau, "stopped": stopped}
    if timed:  # one-batch step units: a push of k local steps took k
        out["times"] = (scale * simulate.epoch_times(sched, epochs)).tolist()
        out["val_curve"] = [float(a) if np.isfinite(a) else 0.0
                            for a in history["val_accuracy"]]
    return out


# ------------------------------------------------------------------- study
class Runner:
    """Runs jobs in `--jobs` processes, each job once (cached by its key)."""

    def __init__(self):
        self.cache = {}

    @staticmethod
    def key(task, name, lr, n, seed, epochs=None, timed=False):
        kind = (METHODS.get(name) or TIME_ONLY[name])[0]
        return (task, name, lr, 1 if kind == "sequential" else n, seed,
                epochs or _EPOCHS.value, timed)

    def run(self, keys):
        todo = sorted(set(keys) - set(self.cache))
        jobs = []
        for task, name, lr, n, seed, epochs, timed in todo:
            kind, options = (METHODS.get(name) or TIME_ONLY[name])[:2]
            jobs.append((task, kind, options, lr, n, seed, epochs, timed))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(_JOBS.value, initializer=_init, initargs=(tuple(_TASKS.value),)) as pool:
            for k, result in zip(todo, pool.imap(run, jobs)):
                self.cache[k] = result

    def __getitem__(self, key):
        return self.cache[key]


def per_n(kind, counts):
    return counts if kind != "sequential" else [1]


def study(task, counts, runner, seeds, start):
    """Tunes every method on `task`; returns results, best rates, sequential."""
    sweep_seeds = range(_SWEEP_SEEDS.value)
    runner.run([runner.key(task, name, lr, n, s) for name, (kind, _, grid) in METHODS.items()
                for n in per_n(kind, counts) for lr in grid for s in sweep_seeds])
    print(f"{task}: sweep done ({time.perf_counter() - start:.0f} s)", flush=True)
    best = {}
    for name, (kind, _, grid) in METHODS.items():
        for n in per_n(kind, counts):
            vals = [statistics.mean(runner[runner.key(task, name, lr, n, s)]["val"]
                                    for s in sweep_seeds) for lr in grid]
            i = int(np.argmax(vals))
            best[name, n] = (grid[i], i in (0, len(grid) - 1) and vals[i] > 0.2, vals)
    runner.run([runner.key(task, name, best[name, n][0], n, s)
                for name, (kind, _, _) in METHODS.items() for n in per_n(kind, counts)
                for s in seeds])
    print(f"{task}: seeds done ({time.perf_counter() - start:.0f} s)", flush=True)
    results = {}
    for name, (kind, _, grid) in METHODS.items():
        results[name] = {}
        for n in counts:
            m = 1 if kind == "sequential" else n
            lr, edge, vals = best[name, m]
            runs = [runner[runner.key(task, name, lr, m, s)] for s in seeds]
            results[name][str(n)] = {
                "learning_rate": lr, "on_grid_edge": edge,
                "validation_sweep": dict(zip(map(str, grid), vals)),
                "test": [r["test"] for r in runs],
                "mean_tau": statistics.mean(r["tau"] for r in runs),
                "stopped": statistics.mean(r["stopped"] for r in runs)}
    sequential = max(statistics.mean(results[name][str(counts[0])]["test"])
                     for name, (kind, _, _) in METHODS.items() if kind == "sequential")
    return results, best, sequential


def timed_view(task, best, runner, seeds, sequential, start):
    """Every method at its chosen rate, workers of Pareto-drawn speeds:
    accuracy, simulated time, time to the target on validation."""
    counts = [int(n) for n in _TIME_WORKERS.value]
    if not counts:
        return None
    names = [n for n, (kind, _, _) in METHODS.items() if kind != "sequential"]
    names += list(TIME_ONLY)

    def rate(name, n):
        return best[TIME_ONLY[name][2] if name in TIME_ONLY else name, n][0]

    runner.run([runner.key(task, name, rate(name, n), n, s, timed=True)
                for name in names for n in counts for s in seeds])
    print(f"{task}: simulated-time view done ({time.perf_counter() - start:.0f} s)",
          flush=True)
    target = sequential - _TARGET.value
    out = {"target": target, "workers": counts, "methods": {}}
    for name in names:
        out["methods"][name] = {}
        for n in counts:
            runs = [runner[runner.key(task, name, rate(name, n), n, s, timed=True)]
                    for s in seeds]
            times = np.mean([r["times"] for r in runs], axis=0)
            curve = np.mean([r["val_curve"] for r in runs], axis=0)
            out["methods"][name][str(n)] = {
                "test": [r["test"] for r in runs], "time": float(times[-1]),
                "time_to_target": time_to(curve, times, target),
                "times": times.tolist(), "val_curve": curve.tolist()}
    add_time_to_sync(out)
    return out


def time_to(curve, times, target):
    """The simulated time of the first epoch whose validation accuracy (mean
    of the seeds) reaches `target`, or `None`."""
    reached = np.flatnonzero(np.asarray(curve) >= target - 1e-9)
    return float(times[reached[0]]) if len(reached) else None


def add_time_to_sync(timed):
    """Each method's time to the final validation accuracy of synchronous
    SGD with momentum (the baseline to beat by the clock)."""
    for n in map(str, timed["workers"]):
        sync = timed["methods"]["sync SGD, momentum 0.9"][n]["val_curve"][-1]
        for by_n in timed["methods"].values():
            r = by_n[n]
            r["sync_accuracy"] = sync
            r["time_to_sync"] = time_to(r["val_curve"], r["times"], sync)


def budget_table(task, best, runner, seeds, counts):
    """Issue 15's extra table (`--budgets`): the best methods with more
    examples, each rate re-chosen among its 40-epoch choice x 1/3, 1, 3."""
    budgets = [int(e) for e in _BUDGETS.value]
    workers = [int(n) for n in _BUDGET_WORKERS.value if int(n) in counts]
    if not budgets or not workers:
        return None
    sweep_seeds = range(_SWEEP_SEEDS.value)

    def grid(name, n):
        lr = best[name, 1 if METHODS[name][0] == "sequential" else n][0]
        return [lr / 3, lr, lr * 3]

    out = {}
    for epochs in budgets:
        runner.run([runner.key(task, name, lr, n, s, epochs) for name in BUDGET_METHODS
                    for n in workers for lr in grid(name, n) for s in sweep_seeds])
        out[str(epochs)] = {}
        for name in BUDGET_METHODS:
            out[str(epochs)][name] = {}
            for n in workers:
                lrs = grid(name, n)
                vals = [statistics.mean(runner[runner.key(task, name, lr, n, s, epochs)]["val"]
                                        for s in sweep_seeds) for lr in lrs]
                lr = lrs[int(np.argmax(vals))]
                runner.run([runner.key(task, name, lr, n, s, epochs) for s in seeds])
                out[str(epochs)][name][str(n)] = {
                    "learning_rate": lr,
                    "test": [runner[runner.key(task, name, lr, n, s, epochs)]["test"]
                             for s in seeds]}
    return out


def verdict(results, counts, sequential, timed):
    """The issue's goals, as measured."""
    out = {}
    for n in counts:
        mean = {name: statistics.mean(results[name][str(n)]["test"]) for name in results}
        top = max((m, name) for name, m in mean.items() if METHODS[name][0] == "async")
        sync = mean["sync SGD, momentum 0.9"]
        entry = {"best_async": top[1], "accuracy": top[0], "gap_to_sequential": sequential - top[0],
                 "sync_momentum": sync, "ahead_of_sync": top[0] > sync}
        if timed and str(n) in map(str, timed["workers"]):
            view = timed["methods"]
            sync_run = view["sync SGD, momentum 0.9"][str(n)]
            # By the clock: the time the best asynchronous method (of the
            # equal-examples table) takes to the synchronous baseline's final
            # validation accuracy, against the baseline's own.
            entry["time_to_sync_best_async"] = view[top[1]][str(n)]["time_to_sync"]
            entry["time_to_sync_sync"] = sync_run["time_to_sync"]
            fastest = min(((r[str(n)]["time_to_sync"], name) for name, r in view.items()
                           if r[str(n)]["time_to_sync"] is not None and not name.startswith(
                               "sync")), default=(None, None))
            entry["fastest_async_to_sync"] = {"method": fastest[1], "time": fastest[0]}
        out[str(n)] = entry
    return out


def main(argv):
    del argv
    counts = [int(n) for n in _WORKERS.value]
    seeds = list(range(_SEEDS.value))
    start = time.perf_counter()
    runner = Runner()
    report = {"epochs": _EPOCHS.value, "batch": BATCH, "seeds": seeds,
              "sweep_seeds": _SWEEP_SEEDS.value, "workers": counts, "tasks": {},
              "grids": {name: list(grid) for name, (_, _, grid) in METHODS.items()}}
    for task in _TASKS.value:
        results, best, sequential = study(task, counts, runner, seeds, start)
        timed = timed_view(task, best, runner, seeds, sequential, start)
        report["tasks"][task] = {
            "results": results, "sequential": sequential, "timed": timed,
            "verdict": verdict(results, counts, sequential, timed),
            "budget": budget_table(task, best, runner, seeds, counts)}
        show(task, report["tasks"][task], counts, seeds)
    report["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
    with open(_OUT.value + ".json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report)
    print(f"wrote {_OUT.value}.json and .png ({report['seconds']:.0f} s)")


def show(task, data, counts, seeds):
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    table = Table(title=f"{task}: test accuracy (%), mean [min-max] of {len(seeds)} seeds at "
                        f"each method's best rate on validation; {_EPOCHS.value} epochs of "
                        f"batch {BATCH} for every method; equal workers")
    table.add_column("method")
    for n in counts:
        table.add_column(f"N={n}", justify="right")
    for name, by_n in data["results"].items():
        cells = []
        for n in counts:
            r = by_n[str(n)]
            acc = [100 * a for a in r["test"]]
            cells.append(f"{statistics.mean(acc):.1f} [{min(acc):.1f}-{max(acc):.1f}] "
                         f"lr {r['learning_rate']:g}{'*' if r['on_grid_edge'] else ''}")
        table.add_row(name, *cells)
    console.print(table)
    for n, v in data["verdict"].items():
        print(f"{task} N={n}: best asynchronous {v['best_async']} {100 * v['accuracy']:.1f}%, "
              f"{100 * v['gap_to_sequential']:.1f} points below sequential SGD "
              f"({100 * data['sequential']:.1f}%); sync SGD momentum "
              f"{100 * v['sync_momentum']:.1f}%")
    timed = data["timed"]
    if timed:
        view = Table(title=f"{task}: workers of Pareto-drawn speeds; test accuracy (%), "
                           f"simulated time of {_EPOCHS.value} epochs, time to "
                           f"{100 * timed['target']:.1f}% on validation, time to sync SGD "
                           "with momentum's final validation accuracy (step units)")
        view.add_column("method")
        for n in timed["workers"]:
            view.add_column(f"N={n}", justify="right")
        for name, by_n in timed["methods"].items():
            cells = []
            for n in timed["workers"]:
                r = by_n[str(n)]
                reach = "never" if r["time_to_target"] is None else f"{r['time_to_target']:.0f}"
                sync = "never" if r["time_to_sync"] is None else f"{r['time_to_sync']:.0f}"
                cells.append(f"{100 * statistics.mean(r['test']):.1f}; {r['time']:.0f}; "
                             f"{reach}; {sync}")
            view.add_row(name, *cells)
        console.print(view)


def plot(report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["tasks"])
    fig, axes = plt.subplots(len(tasks), 2, figsize=(13, 4.6 * len(tasks)), squeeze=False)
    counts = report["workers"]
    names = list(METHODS) + list(TIME_ONLY)
    palette = plt.get_cmap("tab20")
    color = {name: palette(i % 20) for i, name in enumerate(names)}  # one per method
    for row, task in zip(axes, tasks):
        data = report["tasks"][task]
        for name, by_n in data["results"].items():
            mean = [100 * statistics.mean(by_n[str(n)]["test"]) for n in counts]
            dashed = METHODS[name][0] != "async"
            row[0].plot(counts, mean, marker="o", label=name, color=color[name],
                        linestyle="--" if dashed else "-")
        row[0].set_xscale("log", base=2)
        row[0].set_xticks(counts, [str(n) for n in counts])
        row[0].set_xlabel("simulated workers N (equal speeds)")
        row[0].set_ylabel(f"{task}: test accuracy (%)")
        row[0].grid(alpha=0.3)
        row[0].legend(fontsize=6)
        timed = data["timed"]
        if timed:
            n = str(timed["workers"][-1])
            for name, by_n in timed["methods"].items():
                r = by_n[n]
                row[1].plot(r["times"], [100 * a for a in r["val_curve"]], label=name,
                            color=color[name],
                            linestyle="--" if name.startswith("sync") else "-")
            row[1].axhline(100 * timed["target"], color="grey", linewidth=0.8)
            row[1].set_xscale("log")
            row[1].set_xlabel(f"simulated time (step units), N={n}, Pareto-drawn speeds")
            row[1].set_ylabel("validation accuracy (%)")
            row[1].grid(alpha=0.3)
            row[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(_OUT.value + ".png", dpi=110)


if __name__ == "__main__":
    app.run(main)
