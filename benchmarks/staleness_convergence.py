"""Accuracy under controlled staleness: plain async vs each wrapper vs sync.

    python benchmarks/staleness_convergence.py --workers 4,16,64 --seeds 3

Simulates N asynchronous workers in one process with `keras_dist.simulate`:
each worker computes its gradient on the weights it pulled when it started,
step times are log-normal (sigma 0.2) around one unit, and updates are
applied in order of completion, so each update's staleness tau follows the
distribution of N equally fast workers (mean about N - 1). The model is the
digits MLP (64-64-10, Keras); updates go through the real keras_dist
wrappers, exactly as `AsyncModel` drives them.

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
    from keras_dist import simulate
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

    def build(seed, optimizer):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
        model.compile(optimizer, "sparse_categorical_crossentropy")
        return model

    def accuracy(model):
        pred = np.argmax(model.predict(x_test, batch_size=512, verbose=0), axis=1)
        return float((pred == y_test).mean())

    def run_async(make_optimizer, workers, seed):
        model = build(seed, make_optimizer())
        _, sched = simulate.fit(model, x_train, y_train, workers=workers,
                                epochs=_EPOCHS.value, batch_size=BATCH, seed=seed)
        return accuracy(model), sched.mean_staleness

    def run_sync(workers, seed):
        """N workers, one update per N batches: their gradients averaged."""
        model = build(seed, keras.optimizers.SGD(_LR.value))
        model.optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()

        @tf.function(reduce_retracing=True)
        def step(xs, ys):
            with tf.GradientTape() as tape:
                losses = [loss_fn(yb, model(xb, training=True)) for xb, yb in zip(xs, ys)]
                loss = tf.add_n(losses) / len(losses)
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables)

        rng = np.random.default_rng(seed)
        steps = len(x_train) // BATCH
        batches = []
        for _ in range(_EPOCHS.value):
            order = rng.permutation(len(x_train))
            batches += [order[i * BATCH:(i + 1) * BATCH] for i in range(steps)]
        for start in range(0, len(batches) - workers + 1, workers):
            group = batches[start:start + workers]
            step([x_train[i] for i in group], [y_train[i] for i in group])
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
