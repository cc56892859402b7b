"""A fair convergence study under simulated staleness: every method tuned.

    python benchmarks/staleness_convergence.py --workers 4,16,64,256   # ~20 min on 2 cores

Simulates N asynchronous workers in one process with `keras_dist.simulate`
(each gradient on the weights its worker pulled; log-normal step times,
sigma 0.2; updates through the real keras_dist optimizers in order of
completion). The model is the digits MLP (64-64-10).

What makes it fair:

- **Same examples for everyone.** `--epochs` passes of batch 32 over the
  same training split, whatever the method or N.
- **Each method at its own best learning rate.** A grid per method (8
  values, a factor of about 3 apart, placed where that family's effective
  step lies); the best is chosen on a validation split (20% of the training
  digits), averaged over `--sweep_seeds` seeds, then `--seeds` seeds are
  trained at it and their *test* accuracy is reported (mean and min-max).
  A best value on the grid's edge is marked, since the grid may have cut
  the optimum off.
- **Momentum 0 and 0.9** for every method that takes the inner optimizer's
  momentum.
- **Synchronous SGD as practised:** N batches averaged per update with the
  learning rate scaled linearly with N (Goyal et al. 2017) and warmed up
  linearly over the first 10% of its updates; the grid is over the base
  (one-batch) rate.
- **Baselines:** sequential SGD (one worker, tau = 0) with the same tuning.

Methods: plain asynchronous SGD; `DynSGD`; `DCASGD` (adaptive); `GapAware`
(on gradients, and on the momentum buffer, `measure="momentum"`); `DANA`; `GapAware(DANA)` (the ICLR 2020 paper's best variant); and the
implicit-momentum correction (explicit momentum 0.9 reduced by the 1 - 1/N
that asynchrony adds, `kd.optimizers.implicit_momentum`, floored at 0).

A second table gives the best methods more examples (`--budgets`, 100 and
200 epochs, for everyone, sequential SGD included) at 64 and 256 workers,
each rate re-chosen on validation among its 40-epoch choice x 1/3, 1, 3.

Writes benchmarks/results/staleness_convergence.{json,png} and prints the tables.
"""

import itertools
import json
import multiprocessing
import os
import statistics
import time

import numpy as np
from absl import app
from absl import flags

_WORKERS = flags.DEFINE_list("workers", ["4", "16", "64", "256"], "Simulated worker counts.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds trained at each method's chosen rate.")
_SWEEP_SEEDS = flags.DEFINE_integer("sweep_seeds", 2, "Seeds averaged to choose each rate.")
_EPOCHS = flags.DEFINE_integer("epochs", 40, "Passes over the training split (all methods).")
_JOBS = flags.DEFINE_integer("jobs", 2, "Processes running simulations side by side.")
_BUDGETS = flags.DEFINE_list("budgets", ["100", "200"], "Larger example budgets (epochs) for "
                             "the budget table; empty: none.")
_BUDGET_WORKERS = flags.DEFINE_list("budget_workers", ["64", "256"],
                                    "Worker counts of the budget table.")
BUDGET_METHODS = ("sequential SGD", "sync SGD, momentum 0.9", "plain async",
                  "DANA (momentum 0.9)", "GapAware(DANA)")
_OUT = flags.DEFINE_string("output", "benchmarks/results/staleness_convergence",
                           "Output path without extension.")
BATCH = 32
TARGET_MOMENTUM = 0.9
GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)  # SGD without momentum


def methods():
    """name -> (kind, options, learning-rate grid). kind: "sequential", "sync"
    or "async"; options say how to build the optimizer (see `optimizer`)."""
    slow = tuple(lr / 10 for lr in GRID)  # momentum 0.9: ten times the step
    scaled = tuple(lr * 10 for lr in GRID)  # DynSGD divides by tau + 1
    table = {
        "sequential SGD": ("sequential", {}, GRID),
        "sequential SGD, momentum 0.9": ("sequential", {"momentum": 0.9}, slow),
        "sync SGD (linear scaling, warm-up)": ("sync", {}, GRID),
        "sync SGD, momentum 0.9": ("sync", {"momentum": 0.9}, slow),
        "plain async": ("async", {}, GRID),
        "plain async, momentum 0.9": ("async", {"momentum": 0.9}, slow),
        "async, momentum 0.9 - implicit": ("async", {"momentum": "implicit"}, slow),
        "DynSGD": ("async", {"wrapper": "DynSGD"}, scaled),
        "DynSGD, momentum 0.9": ("async", {"wrapper": "DynSGD", "momentum": 0.9},
                                 tuple(lr / 10 for lr in scaled)),
        "DCASGD adaptive": ("async", {"wrapper": "DCASGD"}, GRID),
        "DCASGD adaptive, momentum 0.9": ("async", {"wrapper": "DCASGD", "momentum": 0.9},
                                          slow),
        "GapAware": ("async", {"wrapper": "GapAware"}, GRID),
        "GapAware, momentum 0.9": ("async", {"wrapper": "GapAware", "momentum": 0.9}, slow),
        "GapAware on momentum, momentum 0.9": (
            "async", {"wrapper": "GapAware-momentum", "momentum": 0.9}, slow),
        "DANA (momentum 0.9)": ("async", {"wrapper": "DANA"}, slow),
        "GapAware(DANA)": ("async", {"wrapper": "GapAware(DANA)"}, GRID),
    }
    return table


def optimizer(options, lr, workers):
    import keras

    import keras_dist as kd

    momentum = options.get("momentum", 0.0)
    if momentum == "implicit":
        momentum = kd.optimizers.compensated_momentum(TARGET_MOMENTUM, workers)
    wrapper = options.get("wrapper")
    if wrapper == "DANA":
        return kd.optimizers.DANA(keras.optimizers.SGD(lr), momentum=TARGET_MOMENTUM)
    if wrapper == "GapAware(DANA)":
        return kd.optimizers.GapAware(
            kd.optimizers.DANA(keras.optimizers.SGD(lr), momentum=TARGET_MOMENTUM))
    inner = keras.optimizers.SGD(lr, momentum=momentum)
    if wrapper == "DynSGD":
        return kd.optimizers.DynSGD(inner)
    if wrapper == "DCASGD":
        return kd.optimizers.DCASGD(inner, mode="adaptive")
    if wrapper == "GapAware":
        return kd.optimizers.GapAware(inner)
    if wrapper == "GapAware-momentum":
        return kd.optimizers.GapAware(inner, measure="momentum")
    return inner


# ------------------------------------------------------------ one run (a job)
_DATA = {}


def _init():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    order = np.random.default_rng(12345).permutation(len(x))
    cut = int(0.8 * len(x))
    _DATA.update(train=(x[order[:cut]], y[order[:cut]]), val=(x[order[cut:]], y[order[cut:]]),
                 test=(x_test, y_test))


def run(job):
    """One training run: {"val": accuracy, "test": accuracy, "tau": mean tau}."""
    import warnings

    import keras

    from keras_dist import simulate

    kind, options, lr, workers, seed, epochs = job
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    x, y = _DATA["train"]
    tau = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrappers outside async training: none here
        if kind == "sync":
            model.compile(optimizer(options, lr, workers), "sparse_categorical_crossentropy")
            _sync_fit(model, x, y, lr, workers, seed, epochs)
        else:
            n = 1 if kind == "sequential" else workers
            model.compile(optimizer(options, lr, n), "sparse_categorical_crossentropy")
            _, sched = simulate.fit(model, x, y, workers=n, epochs=epochs, batch_size=BATCH,
                                    seed=seed)
            tau = sched.mean_staleness

    def accuracy(split):
        xs, ys = _DATA[split]
        pred = model.predict(xs, batch_size=512, verbose=0)
        return float(np.mean(np.argmax(pred, axis=1) == ys)) if np.all(
            np.isfinite(pred)) else 0.0

    return {"val": accuracy("val"), "test": accuracy("test"), "tau": tau}


def _sync_fit(model, x, y, base_lr, workers, seed, epochs):
    """N batches per update (their gradients averaged: one batch of N x 32),
    learning rate base_lr * N after a linear warm-up over 10% of the updates."""
    rng = np.random.default_rng(seed)
    steps = len(x) // BATCH
    batches = []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        batches += [order[i * BATCH:(i + 1) * BATCH] for i in range(steps)]
    updates = len(batches) // workers
    warmup = max(1, updates // 10)
    for u in range(updates):
        scale = workers if u >= warmup else 1 + (workers - 1) * u / warmup
        model.optimizer.learning_rate = base_lr * scale
        idx = np.concatenate(batches[u * workers:(u + 1) * workers])
        model.train_on_batch(x[idx], y[idx])


# ------------------------------------------------------------------- study
def main(argv):
    del argv
    counts = [int(n) for n in _WORKERS.value]
    seeds = list(range(_SEEDS.value))
    table = methods()
    start = time.perf_counter()

    def per_n(kind):
        return counts if kind != "sequential" else [1]

    def key(kind, options, lr, n, seed):
        if kind == "async" and options.get("momentum") == "implicit":
            # Floored at 0 it is plain momentum-free async for N >= 10: run once.
            from keras_dist.optimizers import compensated_momentum

            momentum = round(compensated_momentum(TARGET_MOMENTUM, n), 6)
            options = {"momentum": momentum} if momentum else {}
        return (kind, json.dumps(options, sort_keys=True), lr, n, seed, _EPOCHS.value)

    cache = {}

    def run_all(keys):
        """Runs the jobs of `keys` (see `key`) not in the cache yet."""
        todo = sorted(set(keys) - set(cache))
        parsed = [(k[0], json.loads(k[1]), k[2], k[3], k[4], k[5]) for k in todo]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(_JOBS.value, initializer=_init) as pool:
            for k, result in zip(todo, pool.imap(run, parsed)):
                cache[k] = result

    # 1. The sweep: every method, every rate, validation accuracy averaged
    # over the sweep's seeds (one seed's 287 validation digits pick noisily).
    sweep_seeds = range(_SWEEP_SEEDS.value)
    sweep = [(kind, options, lr, n, s) for kind, options, grid in table.values()
             for n in per_n(kind) for lr in grid for s in sweep_seeds]
    run_all([key(*job) for job in sweep])
    print(f"sweep: {len(sweep)} runs ({time.perf_counter() - start:.0f} s)", flush=True)
    best = {}
    for name, (kind, options, grid) in table.items():
        for n in per_n(kind):
            vals = [statistics.mean(cache[key(kind, options, lr, n, s)]["val"]
                                    for s in sweep_seeds) for lr in grid]
            i = int(np.argmax(vals))
            best[name, n] = (grid[i], i in (0, len(grid) - 1) and vals[i] > 0.2, vals)
    # 2. The chosen rate, every seed, test accuracy.
    final = [(kind, options, best[name, n][0], n, s) for name, (kind, options, _) in table.items()
             for n in per_n(kind) for s in seeds]
    run_all([key(*job) for job in final])
    print(f"seeds: {len(final)} runs ({time.perf_counter() - start:.0f} s)", flush=True)

    results = {}
    for name, (kind, options, grid) in table.items():
        results[name] = {}
        for n in counts:
            m = n if kind != "sequential" else 1
            lr, edge, vals = best[name, m]
            runs = [cache[key(kind, options, lr, m, s)] for s in seeds]
            results[name][str(n)] = {
                "learning_rate": lr, "on_grid_edge": edge,
                "validation_sweep": dict(zip(map(str, grid), vals)),
                "test": [r["test"] for r in runs],
                "mean_tau": statistics.mean(r["tau"] for r in runs)}
    budget = budget_table(table, best, run_all, cache, key, seeds, counts)
    report(results, counts, seeds, time.perf_counter() - start, table, budget)


def budget_table(table, best, run_all, cache, key, seeds, counts):
    """The best methods with more examples: for each budget (epochs) and N,
    each method's rate re-chosen on validation among its 40-epoch choice
    times 1/3, 1 and 3, then test accuracy over the seeds."""
    budgets = [int(e) for e in _BUDGETS.value]
    workers = [int(n) for n in _BUDGET_WORKERS.value if int(n) in counts]
    if not budgets or not workers:
        return None
    sweep_seeds = range(_SWEEP_SEEDS.value)

    def grid(name, n):
        lr = best[name, 1 if table[name][0] == "sequential" else n][0]
        return [lr / 3, lr, lr * 3]

    def k(name, lr, n, seed, epochs):
        kind, options, _ = table[name]
        return key(kind, options, lr, 1 if kind == "sequential" else n, seed)[:-1] + (epochs,)

    out = {}
    for epochs in budgets:
        jobs = [k(name, lr, n, s, epochs) for name in BUDGET_METHODS for n in workers
                for lr in grid(name, n) for s in sweep_seeds]
        run_all(jobs)
        out[str(epochs)] = {}
        for name in BUDGET_METHODS:
            out[str(epochs)][name] = {}
            for n in workers:
                lrs = grid(name, n)
                vals = [statistics.mean(cache[k(name, lr, n, s, epochs)]["val"]
                                        for s in sweep_seeds) for lr in lrs]
                lr = lrs[int(np.argmax(vals))]
                run_all([k(name, lr, n, s, epochs) for s in seeds])
                out[str(epochs)][name][str(n)] = {
                    "learning_rate": lr,
                    "test": [cache[k(name, lr, n, s, epochs)]["test"] for s in seeds]}
        print(f"budget {epochs} epochs done", flush=True)
    return out


def report(results, counts, seeds, seconds, table, budget=None):
    from rich.console import Console
    from rich.table import Table

    shown = Table(title=f"Digits test accuracy (%), mean [min-max] of {len(seeds)} seeds at "
                        f"each method's best rate on validation; {_EPOCHS.value} epochs of "
                        f"batch {BATCH} for every method")
    shown.add_column("method")
    for n in counts:
        shown.add_column(f"N={n}", justify="right")
    for name, by_n in results.items():
        cells = []
        for n in counts:
            r = by_n[str(n)]
            acc = [100 * a for a in r["test"]]
            cells.append(f"{statistics.mean(acc):.1f} [{min(acc):.1f}-{max(acc):.1f}] "
                         f"lr {r['learning_rate']:g}{'*' if r['on_grid_edge'] else ''}")
        shown.add_row(name, *cells)
    Console(width=200).print(shown)
    print("* best rate on the edge of the grid")
    sequential = max(statistics.mean(results[name][str(counts[0])]["test"])
                     for name, (kind, _, _) in table.items() if kind == "sequential")
    verdict = {}
    for n in counts:
        top = max((statistics.mean(by_n[str(n)]["test"]), name)
                  for name, by_n in results.items() if table[name][0] == "async")
        verdict[str(n)] = {"best_async": top[1], "accuracy": top[0],
                           "gap_to_sequential": sequential - top[0]}
        print(f"N={n}: best asynchronous method {top[1]} {100 * top[0]:.1f}%, "
              f"{100 * (sequential - top[0]):.1f} points below sequential SGD "
              f"({100 * sequential:.1f}%)")
    if budget:
        extra = Table(title="More examples for everyone: test accuracy (%) at N workers, "
                            "rate re-chosen on validation")
        extra.add_column("method")
        columns = [(e, n) for e in budget for n in next(iter(budget[e].values()))]
        for e, n in columns:
            extra.add_column(f"{e} epochs, N={n}", justify="right")
        for name in BUDGET_METHODS:
            cells = []
            for e, n in columns:
                acc = [100 * a for a in budget[e][name][n]["test"]]
                cells.append(f"{statistics.mean(acc):.1f} [{min(acc):.1f}-{max(acc):.1f}] "
                             f"lr {budget[e][name][n]['learning_rate']:.3g}")
            extra.add_row(name, *cells)
        Console(width=200).print(extra)
    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
    with open(_OUT.value + ".json", "w") as f:
        json.dump({"results": results, "verdict": verdict, "sequential": sequential,
                   "budget": budget,
                   "epochs": _EPOCHS.value, "batch": BATCH, "seeds": seeds,
                   "sweep_seeds": _SWEEP_SEEDS.value,
                   "workers": counts, "seconds": seconds,
                   "grids": {name: list(grid) for name, (_, _, grid) in table.items()}},
                  f, indent=1)
    plot(results, counts)
    print(f"wrote {_OUT.value}.json and .png ({seconds:.0f} s)")


def plot(results, counts):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, with_momentum in zip(axes, (False, True)):
        for name, by_n in results.items():
            if ("momentum" in name or "DANA" in name) != with_momentum:
                continue
            mean = [100 * statistics.mean(by_n[str(n)]["test"]) for n in counts]
            low = [m - 100 * min(by_n[str(n)]["test"]) for m, n in zip(mean, counts)]
            high = [100 * max(by_n[str(n)]["test"]) - m for m, n in zip(mean, counts)]
            dashed = name.startswith(("sequential", "sync"))
            ax.errorbar(counts, mean, yerr=[low, high], marker="o", capsize=3, label=name,
                        linestyle="--" if dashed else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("simulated workers N")
        ax.set_title("momentum 0.9 (or DANA's)" if with_momentum else "no momentum")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("test accuracy (%), each at its tuned rate")
    fig.suptitle("Digits MLP under asynchronous staleness: a tuned comparison")
    fig.tight_layout()
    fig.savefig(_OUT.value + ".png", dpi=120)


if __name__ == "__main__":
    app.run(main)
