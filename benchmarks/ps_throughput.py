"""Parameter-server throughput: AsyncModel.fit vs its two peers, side by side.

Run it as the chief of a local cluster (every task runs the same script):

    keras-dist-run --workers 2 --ps 1 -- python benchmarks/ps_throughput.py

On the same cluster, model (digits MLP 64-64-10, SGD) and data it measures,
interleaved, the steady-state updates per second of

  (a) `AsyncModel.fit` (keras_dist: callbacks, batch hooks, staleness
      bookkeeping, atomic metric updates),
  (b) a hand-written `ClusterCoordinator` loop in the shape of TF's
      parameter-server tutorial (schedule `train_step` closures, join), and
  (c) tf-keras (Keras 2) `model.fit` under the same ParameterServerStrategy,
      when the `bench` extra (tf-keras) is installed,

at steps_per_execution 1 and 10, plus (a') `AsyncModel.fit` with
`nonfinite_updates="raise"` (no conditional around the update: what the
default skip costs). Each run trains `--epochs` epochs of `--steps` updates;
the first epoch (tracing, dataset creation) is dropped and the median of the
others is the run's rate. Targets: (a)/(b) >= 1.0 and (a)/(c) >= 1.3.

Local steps are measured by `benchmarks/local_steps.py`.
Writes benchmarks/results/ps_throughput.json.
"""

import json
import os
import statistics
import time

import tensorflow as tf
from absl import app
from absl import flags

import keras_dist as kd

_STEPS = flags.DEFINE_integer("steps", 200, "Updates per epoch.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs per run; the first is warm-up.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 5, "Runs per side and setting (the hand-written loop's rate varies by up "
    "to 1.7x between runs of one process on 2 cores: medians of 5).")
_OUTPUT = flags.DEFINE_string(
    "output", "benchmarks/results/ps_throughput.json", "Where to write the JSON.")


def main(argv):
    del argv
    strategy = kd.resolve_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()  # worker and ps tasks serve until the launcher stops them

    import keras
    from rich.console import Console
    from rich.table import Table

    from keras_dist.datasets import load_digits
    from keras_dist._runtime import quiet_tf_logger

    try:
        import tf_keras
    except ImportError:
        tf_keras = None
    (x, y), _ = load_digits()
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(input_context=None):
        del input_context
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048).repeat().batch(32)

    def rate(epoch_seconds):
        return _STEPS.value / statistics.median(epoch_seconds[1:])

    class Timer:
        """Epoch wall times, as a callback of either Keras."""

        def __init__(self, base):
            timer = self

            class _Callback(base):
                def on_epoch_begin(self, epoch, logs=None):
                    timer.start = time.perf_counter()

                def on_epoch_end(self, epoch, logs=None):
                    timer.seconds.append(time.perf_counter() - timer.start)

            self.callback, self.seconds = _Callback(), []

    def keras_dist_side(k, nonfinite="skip"):
        with strategy.scope():
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(64, activation="relu")(inputs)
            model = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
            model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=k)
            model.nonfinite_updates = nonfinite

        def run():
            timer = Timer(keras.callbacks.Callback)
            model.fit(x, y, batch_size=32, epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value,
                      verbose=0, callbacks=[timer.callback])
            return rate(timer.seconds)
        return run

    def hand_side(k):
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"])
            # Build optimizer and metric state before scheduling (TF's tutorial
            # does the same): variables cannot be created in the closures.
            y_pred = model(x[:2])
            model.compute_loss(x[:2], y[:2], y_pred)
            model.compute_metrics(x[:2], y[:2], y_pred, None)
            model.optimizer.build(model.trainable_variables)
            model.reset_metrics()

        @tf.function
        def step(iterator):
            for _ in range(k):
                logs = strategy.run(model.train_step, args=(next(iterator),))
            return logs

        def run():
            iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
            seconds = []
            for _ in range(_EPOCHS.value):
                start = time.perf_counter()
                for _ in range(_STEPS.value // k):
                    coordinator.schedule(step, args=(iterator,))
                coordinator.join()
                seconds.append(time.perf_counter() - start)
            return rate(seconds)
        return run

    def tf_keras_side(k):
        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input((64,)), tf_keras.layers.Dense(64, activation="relu"),
                tf_keras.layers.Dense(10, activation="softmax")])
            model.compile(tf_keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=k)

        def run():
            timer = Timer(tf_keras.callbacks.Callback)
            model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn),
                      epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value, verbose=0,
                      callbacks=[timer.callback])
            return rate(timer.seconds)
        return run

    sides = {"(a) keras_dist AsyncModel.fit": keras_dist_side,
             "(b) hand-written coordinator loop": hand_side,
             "(a') keras_dist, nonfinite_updates='raise'":
                 lambda k: keras_dist_side(k, nonfinite="raise")}
    if tf_keras is not None:
        sides["(c) tf-keras model.fit"] = tf_keras_side
    results = {}
    with quiet_tf_logger("WARNING"):
        for k in (1, 10):
            runs = {name: make(k) for name, make in sides.items()}
            rates = {name: [] for name in runs}
            for repeat in range(_REPEATS.value):
                order = list(runs.items())
                for name, run in (order if repeat % 2 == 0 else order[::-1]):
                    rates[name].append(run())
            results[k] = rates

    table = Table(title=f"Parameter-server updates/s (2 workers, 1 ps; median of "
                        f"{_REPEATS.value} runs x {_EPOCHS.value - 1} timed epochs of "
                        f"{_STEPS.value} updates)")
    table.add_column("steps_per_execution", justify="right")
    for name in sides:
        table.add_column(name, justify="right")
    table.add_column("(a)/(b)", justify="right")
    table.add_column("(a')/(b)", justify="right")
    if tf_keras is not None:
        table.add_column("(a)/(c)", justify="right")
    summary = {}
    for k, rates in results.items():
        med = {name: statistics.median(v) for name, v in rates.items()}
        names = list(sides)
        ratios = [med[names[0]] / med[names[1]], med[names[2]] / med[names[1]]]
        if tf_keras is not None:
            ratios.append(med[names[0]] / med[names[3]])
        summary[f"spe{k}"] = {"median_updates_per_s": med, "ratios": ratios,
                              "range_updates_per_s": {n: [min(v), max(v)]
                                                      for n, v in rates.items()}}
        table.add_row(str(k), *(f"{med[n]:.1f}" for n in names), *(f"{r:.3f}" for r in ratios))
    Console().print(table)
    if tf_keras is None:
        print("tf-keras not installed: install the bench extra for peer (c).")
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"raw_updates_per_s": {f"spe{k}": v for k, v in results.items()},
                   "summary": summary, "steps": _STEPS.value, "epochs": _EPOCHS.value,
                   "sides": list(sides)},
                  f, indent=2)


if __name__ == "__main__":
    app.run(main)
