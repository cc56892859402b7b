"""How often keras_dist traces under parameter servers; run by keras-dist-run.

A model counts, in Python, each trace of its train_step, test_step and
call (Python code in a tf.function runs only while it is traced). The chief
trains 3 epochs with validation, then again (a second fit), evaluates
twice and predicts twice (other sizes each time), with and without local
steps, and writes the counts to out_dir/result.json. argv: out_dir.
"""

import collections
import json
import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402
from keras_dist.training.worker_step import WorkerStep  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

TRACES = collections.Counter()


class CountingLocal(kd.AsyncModel):
    """Counts traces of test_step and call, with Keras' own train_step
    (local steps refuse a train_step of the model's own)."""

    def test_step(self, data):
        TRACES["test_step"] += 1
        return super().test_step(data)

    def call(self, inputs, training=False):
        TRACES["call"] += 1
        return super().call(inputs, training=training)


class Counting(CountingLocal):
    def train_step(self, data):
        TRACES["train_step"] += 1
        return super().train_step(data)


def main(out_dir):
    (x, y), (x_test, y_test) = load_digits()
    with strategy.scope():
        model = digits_model("sgd", hidden=32, cls=Counting)
    counts = {}
    for run in ("first_fit", "second_fit"):
        model.fit(x, y, batch_size=32, epochs=3, steps_per_epoch=20, verbose=0,
                  validation_data=(x_test[:100], y_test[:100]))
        counts[run] = dict(TRACES)
    for n in (70, 150):
        model.evaluate(x_test[:n], y_test[:n], verbose=0)
    counts["evaluate"] = dict(TRACES)
    before = TRACES["call"]
    for n in (50, 77, 130):
        model.predict(x_test[:n], verbose=0)
    counts["predict_call_traces"] = TRACES["call"] - before
    with strategy.scope():
        inputs = keras.Input((64,))
        other = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(inputs))
        other.compile("sgd", "sparse_categorical_crossentropy")
    traces = []
    for _ in range(2):
        other.fit(x, y, batch_size=32, epochs=3, steps_per_epoch=20, verbose=0,
                  local_steps=4)
        functions = WorkerStep.current(other)._functions.values()
        traces.append(sum(f.experimental_get_tracing_count() for f in functions))
    counts["local_step_traces"] = traces
    # Executions of more than 32 steps: tf.data refuses more than 32 `next`
    # calls in a function AutoGraph has not converted.
    long = {}
    for name, kwargs in {"steps_per_execution": {}, "local_steps": {"local_steps": 40}}.items():
        with strategy.scope():
            inputs = keras.Input((64,))
            model = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(inputs))
            model.compile("sgd", "sparse_categorical_crossentropy",
                          steps_per_execution=40 if not kwargs else 1)
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=80, verbose=0, **kwargs)
        long[name] = int(model.optimizer.iterations.numpy())
    counts["updates_of_40_step_executions"] = long
    # Epoch by epoch: after the first epoch (its last execution shorter, a
    # validation at its end) nothing is traced again, for each shape of
    # execution: one step (the report ring), several, rounds of local
    # steps, rounds chained, an outer optimizer, EASGD.
    import procs

    per_epoch = {}
    shapes = {"spe1": (1, {}), "spe3": (3, {}), "local4": (1, {"local_steps": 4}),
              "local4_chained": (8, {"local_steps": 4}),
              "outer": (1, {"local_steps": 4, "outer_optimizer": keras.optimizers.SGD(0.5)}),
              "elastic": (1, {"local_steps": 4, "elastic": 0.3})}
    for name, (spe, kwargs) in shapes.items():
        TRACES.clear()
        with strategy.scope():
            model = digits_model("sgd", hidden=16, cls=CountingLocal if kwargs else Counting,
                                 steps_per_execution=spe)
        callback = procs.epoch_traces(
            TRACES, lambda: WorkerStep.current(model).compiled_functions())
        model.fit(x, y, batch_size=32, epochs=3, steps_per_epoch=10, verbose=0,
                  validation_data=(x_test[:64], y_test[:64]), callbacks=[callback], **kwargs)
        per_epoch[name] = callback.records
    counts["per_epoch"] = per_epoch
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(counts, f)


if __name__ == "__main__":
    main(sys.argv[1])
