"""Parameter-server throughput: AsyncModel.fit vs a hand-written coordinator loop.

Run it as the chief of a local cluster (every task runs the same script):

    keras-dist-run --workers 2 --ps 1 -- python benchmarks/ps_throughput.py

On the same cluster, model and data it measures, interleaved, the steps per
second of

  (a) `AsyncModel.fit` (keras_dist: callbacks, progress, staleness
      bookkeeping, validation-free epochs), and
  (b) a hand-written `ClusterCoordinator` loop in the shape of TF's
      parameter-server tutorial (schedule `train_step` closures, join),

at steps_per_execution 1 and 10, and prints the ratio (a)/(b) (target >= 0.95).
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

_STEPS = flags.DEFINE_integer("steps", 300, "Updates per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per side and setting.")
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

    (x, y), _ = load_digits()
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048).repeat().batch(32)

    def build(k):
        with strategy.scope():
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(64, activation="relu")(inputs)
            model = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
            model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=k)
        return model

    def run_fit(model, k):
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=_STEPS.value, verbose=0)
        return _STEPS.value / (time.perf_counter() - start)

    def make_hand_loop(model, k):
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def step(it):
            for _ in range(k):
                logs = strategy.run(model.train_step, args=(next(it),))
            return logs

        def run():
            start = time.perf_counter()
            for _ in range(_STEPS.value // k):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            return _STEPS.value / (time.perf_counter() - start)
        return run

    rows, raw = [], {}
    for k in (1, 10):
        fit_model, hand_model = build(k), build(k)
        fit_model.build_async_state((x[:2], y[:2]))
        hand_model.build_async_state((x[:2], y[:2]))
        hand = make_hand_loop(hand_model, k)
        run_fit(fit_model, k)  # warm-up: tracing, connections
        hand()
        fit_rates, hand_rates = [], []
        for repeat in range(_REPEATS.value):
            order = [("fit", lambda: run_fit(fit_model, k)), ("hand", hand)]
            for name, fn in (order if repeat % 2 == 0 else order[::-1]):
                (fit_rates if name == "fit" else hand_rates).append(fn())
        raw[f"spe{k}"] = {"asyncmodel_fit": fit_rates, "hand_loop": hand_rates}
        a, b = statistics.median(fit_rates), statistics.median(hand_rates)
        rows.append((k, a, b, a / b))

    table = Table(title=f"PS throughput, {_STEPS.value} updates per run, "
                        f"median of {_REPEATS.value} (steps/s)")
    for column in ("steps_per_execution", "(a) AsyncModel.fit", "(b) hand loop", "(a)/(b)"):
        table.add_column(column, justify="right")
    for k, a, b, ratio in rows:
        table.add_row(str(k), f"{a:.1f}", f"{b:.1f}", f"{ratio:.3f}")
    Console().print(table)
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"steps": _STEPS.value, "raw_steps_per_second": raw,
                   "ratios": {f"spe{k}": r for k, _, _, r in rows}}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
