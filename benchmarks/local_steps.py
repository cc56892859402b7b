"""Local steps against one process: speed, accuracy, epoch length, where the time goes.

Run it as the chief of a local cluster (every task runs the same script):

    keras-dist-run --workers 2 --ps 1 -- python benchmarks/local_steps.py

The model is the digits MLP 64-64-10, SGD(0.05), batch 32. In one run, with
the settings interleaved (the machine is noisy), it measures:

- the one-process limit: Keras' own `model.fit` of the same model in the
  chief alone (no RPC), steps_per_execution 50, epochs of `--long_steps`;
- for each setting `k x spe` of `--settings` (`AsyncModel.fit(local_steps=k)`
  compiled with steps_per_execution `spe`; `spe` a multiple of `k` chains
  `spe / k` rounds per execution; k = 1 is plain asynchronous training),
  the steady examples/s on epochs of `--long_steps` and of `--short_steps`
  steps, the same number of steps in all (`--total_steps`), and test
  accuracy at the end (equal examples for every setting; mean over runs,
  one seed per run);
- where a round's time goes, on the long epochs: the pull, the steps on the
  worker's copy and the push (each worker measures them, `StepRecord.pull`,
  `.compute`, `.push`), the share of the epoch the workers spend in an
  execution (the rest is the round trip to the chief and its bookkeeping),
  and the chief's CPU per execution.

It also reports the CPU bound: the machine's cores over the cores the one
process keeps busy. At the one process's examples per CPU-second, that is
the most any cluster sharing this machine could reach against it, with no
overhead at all.

Rates are the median over epochs after the first two (the first traces,
the second may be the other worker's first run of a function), then the
median over `--repeats` runs. Writes benchmarks/results/local_steps.json
and local_steps.png.

Targets (issue 34): `16x64` >= 1.0x the limit, `64x256` >= 1.5x, a 45-step
epoch >= 0.9x a 450-step one at `1x1`, `1x10` and `16x1`, accuracy within
one point of `1x1`.
"""

import json
import os
import statistics
import time

import tensorflow as tf
from absl import app
from absl import flags

import keras_dist as kd

_SETTINGS = flags.DEFINE_list(
    "settings", ["1x1", "1x10", "16x1", "16x64", "64x1", "64x256"],
    "local_steps x steps_per_execution to measure.")
_SHORT = flags.DEFINE_list(
    "short_settings", ["1x1", "1x10", "16x1", "16x64"],
    "Settings also measured on short epochs.")
_LONG_STEPS = flags.DEFINE_integer("long_steps", 450, "Steps of a long epoch.")
_SHORT_STEPS = flags.DEFINE_integer("short_steps", 45, "Steps of a short epoch (digits once).")
_TOTAL = flags.DEFINE_integer("total_steps", 3600, "Steps of every run (equal examples).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per setting, interleaved.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/local_steps.json",
                              "Where to write the JSON.")


def main(argv):
    del argv
    strategy = kd.resolve_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()  # worker and ps tasks serve until the launcher stops them

    import keras
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from keras_dist.datasets import load_digits
    from keras_dist._runtime import quiet_tf_logger

    (x, y), (x_test, y_test) = load_digits()
    batch = 32

    def mlp():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(10, activation="softmax")])

    class Timer(keras.callbacks.Callback):
        """Wall and chief CPU seconds of each epoch."""

        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(time.perf_counter() - self._wall)
            self.cpu.append(time.process_time() - self._cpu)

    def limit_run():
        steps = _LONG_STEPS.value
        model = mlp()
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=50)
        reps = -(-steps * batch // len(x))
        xs, ys = np.tile(x, (reps, 1))[:steps * batch], np.tile(y, reps)[:steps * batch]
        timer = Timer()
        with kd.local_fit():  # the chief alone: the bound
            model.fit(xs, ys, batch_size=batch, epochs=4, verbose=0, callbacks=[timer])
        # Cores the one process keeps busy (its threads: Eigen's, tf.data's).
        cores = sum(timer.cpu[1:]) / sum(timer.wall[1:])
        return steps * batch / statistics.median(timer.wall[1:]), cores

    def run(k, spe, steps, seed):
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = kd.AsyncModel.from_model(mlp())
            model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=spe)
        timer = Timer()
        model.fit(x, y, batch_size=batch, epochs=_TOTAL.value // steps, steps_per_epoch=steps,
                  verbose=0, local_steps=k, callbacks=[timer])
        accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
        records = model.staleness_stats.records  # the last epoch's executions
        per_call = max(k, spe)
        executions = -(-steps // per_call)
        timed = slice(2, None)
        return {
            "examples_per_s": steps * batch / statistics.median(timer.wall[timed]),
            "accuracy": accuracy,
            "rounds_per_execution": len(records[0].staleness) if records else 0,
            "execution_ms": 1000 * statistics.median(r.seconds for r in records),
            "pull_ms": 1000 * statistics.median(r.pull for r in records),
            "compute_ms": 1000 * statistics.median(r.compute for r in records),
            "push_ms": 1000 * statistics.median(r.push for r in records),
            "busy_share": sum(r.seconds for r in records) / (timer.wall[-1] * 2),
            "chief_cpu_ms_per_execution": 1000 * statistics.median(timer.cpu[timed])
            / executions,
        }

    settings = [tuple(int(v) for v in s.split("x")) for s in _SETTINGS.value]
    short = {tuple(int(v) for v in s.split("x")) for s in _SHORT.value}
    jobs = [(k, spe, _LONG_STEPS.value) for k, spe in settings]
    jobs += [(k, spe, _SHORT_STEPS.value) for k, spe in settings if (k, spe) in short]
    raw = {f"{k}x{spe}@{steps}": [] for k, spe, steps in jobs}
    limits, limit_cores = [], []
    with quiet_tf_logger("WARNING"):
        for repeat in range(_REPEATS.value):
            rate, cores = limit_run()
            limits.append(rate)
            limit_cores.append(cores)
            for k, spe, steps in (jobs if repeat % 2 == 0 else jobs[::-1]):
                raw[f"{k}x{spe}@{steps}"].append(run(k, spe, steps, seed=repeat))
    limit = statistics.median(limits)
    # The machine's cores over the cores one process keeps busy: what any
    # number of processes sharing this machine could reach at best, against
    # one process, with no overhead at all.
    cores_used = statistics.median(limit_cores)
    cpu_bound = (os.cpu_count() or 1) / cores_used

    def median(key, field):
        return statistics.median(r[field] for r in raw[key])

    rows = []
    for k, spe in settings:
        long_key, short_key = f"{k}x{spe}@{_LONG_STEPS.value}", f"{k}x{spe}@{_SHORT_STEPS.value}"
        row = {"k": k, "spe": spe, "examples_per_s": median(long_key, "examples_per_s"),
               "accuracy": float(np.mean([r["accuracy"] for r in raw[long_key]]))}
        row["share_of_limit"] = row["examples_per_s"] / limit
        for field in ("execution_ms", "pull_ms", "compute_ms", "push_ms", "busy_share",
                      "chief_cpu_ms_per_execution"):
            row[field] = median(long_key, field)
        row["rounds_per_execution"] = raw[long_key][0]["rounds_per_execution"]
        if short_key in raw:
            row["short_examples_per_s"] = median(short_key, "examples_per_s")
            row["short_accuracy"] = float(np.mean([r["accuracy"] for r in raw[short_key]]))
            row["short_over_long"] = row["short_examples_per_s"] / row["examples_per_s"]
        rows.append(row)

    console = Console()
    console.print(f"The one process keeps {cores_used:.2f} of this machine's {os.cpu_count()} "
                  f"cores busy: at its examples per CPU-second, the whole machine gives at "
                  f"most {cpu_bound:.2f}x its examples/s (the CPU bound).")
    table = Table(title=f"Local steps, 2 workers + 1 ps: one-process limit {limit:.0f} "
                        f"examples/s (Keras fit, steps_per_execution 50, "
                        f"{_LONG_STEPS.value}-step epochs); accuracy after "
                        f"{_TOTAL.value * batch} examples")
    for column in ("k x spe", f"ex/s ({_LONG_STEPS.value}-step epochs)", "÷ limit",
                   "test accuracy", f"ex/s ({_SHORT_STEPS.value}-step)",
                   f"{_SHORT_STEPS.value} ÷ {_LONG_STEPS.value}"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(f"{r['k']}x{r['spe']}", f"{r['examples_per_s']:.0f}",
                      f"{r['share_of_limit']:.3f}", f"{r['accuracy']:.4f}",
                      f"{r.get('short_examples_per_s', float('nan')):.0f}",
                      f"{r.get('short_over_long', float('nan')):.3f}")
    console.print(table)
    keras_step_ms = 1000 * batch / limit
    table = Table(title=f"Where the time goes ({_LONG_STEPS.value}-step epochs; medians per "
                        f"execution; Keras' own loop: {keras_step_ms:.3f} ms per step)")
    for column in ("k x spe", "rounds/exec", "execution ms", "pull ms", "steps ms (per step)",
                   "push ms", "workers busy", "chief CPU ms/exec"):
        table.add_column(column, justify="right")
    for r in rows:
        steps = r["spe"] if r["spe"] > r["k"] else r["k"]
        table.add_row(f"{r['k']}x{r['spe']}", str(r["rounds_per_execution"]),
                      f"{r['execution_ms']:.2f}", f"{r['pull_ms']:.2f}",
                      f"{r['compute_ms']:.2f} ({r['compute_ms'] / steps:.3f})",
                      f"{r['push_ms']:.2f}", f"{r['busy_share']:.2f}",
                      f"{r['chief_cpu_ms_per_execution']:.2f}")
    console.print(table)
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    plot(rows, os.path.join(os.path.dirname(_OUTPUT.value), "local_steps.png"))
    with open(_OUTPUT.value, "w") as f:
        json.dump({"limit_examples_per_s": limit, "raw_limit": limits, "rows": rows,
                   "limit_cores": limit_cores, "cpu_bound": cpu_bound,
                   "cpu_count": os.cpu_count(),
                   "raw": raw, "long_steps": _LONG_STEPS.value,
                   "short_steps": _SHORT_STEPS.value, "total_steps": _TOTAL.value,
                   "batch": batch, "repeats": _REPEATS.value}, f, indent=2)


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['k']}x{r['spe']}" for r in rows]
    fig, left = plt.subplots(figsize=(6.4, 3.6))
    left.bar(labels, [r["share_of_limit"] for r in rows], color="tab:blue")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xlabel("local_steps x steps_per_execution")
    left.set_ylabel("examples/s ÷ one process", color="tab:blue")
    right = left.twinx()
    right.plot(labels, [r["accuracy"] for r in rows], "s--", color="tab:red")
    right.set_ylabel("test accuracy", color="tab:red")
    fig.suptitle("Local steps on 2 workers + 1 ps (digits MLP)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
