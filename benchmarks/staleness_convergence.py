"""Accuracy under controlled staleness: plain async vs each wrapper vs sync.

    python benchmarks/staleness_convergence.py --workers 4,16,64 --seeds 3

Simulates N asynchronous workers in one process with a gradient delay queue:
each worker computes its gradient on the weights it pulled when it started,
step times are log-normal (sigma 0.2) around one unit, and updates are
applied in order of completion, so each update's staleness tau follows the
distribution of N equally fast workers (mean about N - 1). The model is the
digits MLP (64-64-10, Keras), gradients come from `Model.stateless_call` on
the pulled weights, and updates go through the real keras_dist wrappers
(`set_pending(tau, pulled)` then `apply`), exactly as `AsyncModel` drives them.

Every method sees the same number of examples (`--epochs` passes of batch 32)
and the same seeds. Baselines: sequential SGD (tau = 0, what one worker
would do) and synchronous SGD over N workers (gradients of N batches
averaged per update, so N times fewer updates).

Writes benchmarks/results/staleness_convergence.{json,png} and prints a table.
"""

import json
import os
import statistics
import time

import numpy as np
from absl import app
from absl import flags

_WORKERS = flags.DEFINE_list("workers", ["4", "16", "64"], "Simulated worker counts.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per setting.")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Passes over the training data.")
_LR = flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate (no momentum).")
_OUT = flags.DEFINE_string("output", "benchmarks/results/staleness_convergence",
                           "Output path without extension.")
BATCH = 32


def main(argv):
    del argv
    import keras
    import tensorflow as tf
    from rich.console import Console
    from rich.table import Table

    import keras_dist as kd
    from keras_dist.datasets import load_digits

    (x_train, y_train), (x_test, y_test) = load_digits()
    O = kd.optimizers
    methods = {
        "plain async": lambda: keras.optimizers.SGD(_LR.value),
        "StalenessScaled": lambda: O.StalenessScaled(keras.optimizers.SGD(_LR.value)),
        "DynSGD": lambda: O.DynSGD(keras.optimizers.SGD(_LR.value)),
        "DCASGD-c": lambda: O.DCASGD(keras.optimizers.SGD(_LR.value)),
        "DCASGD-a": lambda: O.DCASGD(keras.optimizers.SGD(_LR.value), mode="adaptive"),
        "GapAware": lambda: O.GapAware(keras.optimizers.SGD(_LR.value)),
    }

    def build(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))

    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def make_grad_fn(model):
        @tf.function(reduce_retracing=True)
        def grad(weights, x, y):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred, _ = model.stateless_call(weights, [], x, training=True)
                loss = loss_fn(y, y_pred)
            return tape.gradient(loss, weights)
        return grad

    def make_apply_fn(model, optimizer):
        aware = O.StalenessAwareOptimizer

        @tf.function(reduce_retracing=True)
        def apply(grads, pulled, tau):
            if isinstance(optimizer, aware):
                optimizer.set_pending(tau, pulled)
            optimizer.apply(grads, model.trainable_variables)
        return apply

    def accuracy(model):
        pred = np.argmax(model.predict(x_test, batch_size=512, verbose=0), axis=1)
        return float((pred == y_test).mean())

    def batches(rng):
        while True:
            order = rng.permutation(len(x_train))
            for i in range(0, len(order) - BATCH + 1, BATCH):
                idx = order[i:i + BATCH]
                yield x_train[idx], y_train[idx]

    updates = _EPOCHS.value * (len(x_train) // BATCH)

    def run_async(make_optimizer, workers, seed):
        model = build(seed)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
        grad, apply = make_grad_fn(model), make_apply_fn(model, optimizer)
        rng = np.random.default_rng(seed)
        data = batches(rng)
        current = lambda: [tf.identity(v.value) for v in model.trainable_variables]  # noqa: E731
        # Each worker: (finish time, its pulled weights, version it read).
        finish = rng.lognormal(0.0, 0.2, size=workers)
        pulled = [current() for _ in range(workers)]
        read_at = [0] * workers
        taus = []
        for version in range(updates):
            w = int(np.argmin(finish))
            xb, yb = next(data)
            grads = grad(pulled[w], xb, yb)
            tau = version - read_at[w]
            taus.append(tau)
            apply(grads, pulled[w], tf.constant(tau, tf.int64))
            pulled[w], read_at[w] = current(), version + 1
            finish[w] += rng.lognormal(0.0, 0.2)
        return accuracy(model), float(np.mean(taus))

    def run_sync(workers, seed):
        model = build(seed)
        optimizer = keras.optimizers.SGD(_LR.value)
        optimizer.build(model.trainable_variables)
        grad, apply = make_grad_fn(model), make_apply_fn(model, optimizer)
        data = batches(np.random.default_rng(seed))
        for _ in range(max(1, updates // workers)):
            weights = [tf.identity(v.value) for v in model.trainable_variables]
            parts = [grad(weights, *next(data)) for _ in range(workers)]
            mean = [tf.add_n(list(g)) / workers for g in zip(*parts)]
            apply(mean, weights, tf.constant(0, tf.int64))
        return accuracy(model)

    counts = [int(n) for n in _WORKERS.value]
    seeds = list(range(_SEEDS.value))
    raw = {"sequential SGD (tau=0)": {}, "sync SGD (N batches/update)": {}}
    raw.update({name: {} for name in methods})
    taus = {}
    start = time.perf_counter()
    sequential = [run_async(methods["plain async"], 1, s)[0] for s in seeds]
    for n in counts:
        raw["sequential SGD (tau=0)"][n] = sequential
        raw["sync SGD (N batches/update)"][n] = [run_sync(n, s) for s in seeds]
        for name, make in methods.items():
            results = [run_async(make, n, s) for s in seeds]
            raw[name][n] = [r[0] for r in results]
            taus[n] = statistics.mean(r[1] for r in results)
        print(f"N={n} done ({time.perf_counter() - start:.0f} s)", flush=True)

    table = Table(title=f"Digits test accuracy (mean of {len(seeds)} seeds; "
                        f"{_EPOCHS.value} epochs, batch {BATCH}, SGD lr {_LR.value})")
    table.add_column("method")
    for n in counts:
        table.add_column(f"N={n} (mean tau {taus[n]:.1f})", justify="right")
    for name, by_n in raw.items():
        table.add_row(name, *(f"{100 * statistics.mean(by_n[n]):.2f}" for n in counts))
    Console().print(table)

    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
    with open(_OUT.value + ".json", "w") as f:
        json.dump({"accuracy": {k: {str(n): v for n, v in d.items()} for k, d in raw.items()},
                   "mean_tau": {str(n): t for n, t in taus.items()},
                   "epochs": _EPOCHS.value, "learning_rate": _LR.value, "seeds": seeds}, f,
                  indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_n in raw.items():
        ax.plot(counts, [100 * statistics.mean(by_n[n]) for n in counts], marker="o",
                label=name, linestyle="--" if name.startswith(("sequential", "sync")) else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("simulated workers N")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Digits MLP under asynchronous staleness")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_OUT.value + ".png", dpi=120)
    print(f"wrote {_OUT.value}.json and .png")


if __name__ == "__main__":
    app.run(main)
