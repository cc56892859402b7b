"""Sharded against unsharded embedding tables on parameter servers.

Run it as the chief of a local cluster (every task runs the same script):

    keras-dist-run --workers 2 --ps 2 -- python benchmarks/ps_sharded.py

A recommender-style model -- `Embedding(100_000, 32)` (12.8 MB), mean over
the 4 ids of an example (user, item, two context ids; Zipf-like, so some ids
are hot), `Dense(64)`, a sigmoid click -- trains with `AsyncModel.fit` on
synthetic clicks, batch 256, in one cluster of 2 workers and 2 parameter
servers, with the table

  (a) sharded: `MinSizePartitioner(min_shard_bytes=256 KB, max_shards=2)`,
      one half per parameter server (keras_dist looks rows up shard by
      shard, and updates each shard on its own server),
  (b) unsharded: the whole table on one parameter server, looked up row
      by row too (what keras_dist does for every `Embedding` under
      parameter servers), and
  (c) unsharded with Keras' own lookup (`ops.take` reads the whole table,
      then picks rows: what `Embedding` does without keras_dist's change;
      a subclass keeps it),

interleaved (`--repeats` runs of `--steps` updates each after one warm-up
fit), for SGD (sparse updates) and Adam (Keras' Adam updates every row of
its slots each step). It reports updates per second and the bytes every
step moves between the processes: the cluster runs in its own network
namespace (keras-dist-run), so the loopback interface's byte counter
(/proc/net/dev) counts exactly the cluster's traffic, divided by the
updates. Writes benchmarks/results/ps_sharded.json.
"""

import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras_dist as kd

_STEPS = flags.DEFINE_integer("steps", 150, "Updates per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per side.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/ps_sharded.json",
                              "Where to write the JSON.")

VOCAB, DIM, IDS, BATCH = 100_000, 32, 4, 256


class Switchable(tf.distribute.experimental.partitioners.MinSizePartitioner):
    """Off: one shard (one coordinator per process, so both sides share the
    strategy)."""

    on = True

    def __call__(self, shape, dtype, axis=0):
        return super().__call__(shape, dtype, axis) if self.on else [1] * len(shape)


PARTITIONER = Switchable(min_shard_bytes=256 << 10, max_shards=2)


def clicks(n, seed=0):
    """Ids drawn Zipf-like; a click when the ids' hidden scores add up."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, size=(n, IDS)) - 1, VOCAB - 1).astype("int32")
    ids = (ids * 7919) % VOCAB  # hot ids spread over the table, not all in shard 0
    score = np.random.default_rng(99).normal(size=VOCAB).astype("float32")
    return ids, (score[ids].sum(axis=1) > 0).astype("float32")


SIDES = ("sharded", "unsharded", "unsharded_keras_lookup")


def build(strategy, optimizer, side):
    import keras

    class KerasLookup(keras.layers.Embedding):
        def call(self, inputs):  # its own call: keras_dist leaves it alone
            return super().call(inputs)

    embedding = KerasLookup if side == "unsharded_keras_lookup" else keras.layers.Embedding
    PARTITIONER.on = side == "sharded"
    try:
        with strategy.scope():
            inputs = keras.Input((IDS,), dtype="int32")
            x = embedding(VOCAB, DIM, name="table")(inputs)
            x = keras.layers.GlobalAveragePooling1D()(x)
            x = keras.layers.Dense(64, activation="relu")(x)
            model = kd.AsyncModel(inputs, keras.layers.Dense(1, activation="sigmoid")(x))
            model.compile(optimizer(), "binary_crossentropy", metrics=["accuracy"])
    finally:
        PARTITIONER.on = True
    return model


def loopback_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def timed_fit(model, x, y, steps):
    before, start = loopback_bytes(), time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    return steps / seconds, (loopback_bytes() - before) / steps


def main(_):
    import keras

    strategy = kd.resolve_strategy(variable_partitioner=PARTITIONER)
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()
    x, y = clicks(BATCH * 400)
    x_test, y_test = clicks(20_000, seed=1)
    optimizers = {"SGD": lambda: keras.optimizers.SGD(0.5),
                  "Adam": lambda: keras.optimizers.Adam(0.005)}
    results = {}
    for name, optimizer in optimizers.items():
        models = {side: build(strategy, optimizer, side) for side in SIDES}
        shards = {side: [s.device for s in kd.sharded.shards(m.get_layer("table").embeddings)]
                  for side, m in models.items()}
        for model in models.values():  # warm-up: tracing, dataset, first reads
            model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=20, verbose=0)
        runs = {side: [] for side in models}
        for _ in range(_REPEATS.value):
            for side, model in models.items():
                runs[side].append(timed_fit(model, x, y, _STEPS.value))
        result = {}
        for side, model in models.items():
            rates = [r for r, _ in runs[side]]
            result[side] = {
                "updates_per_s": statistics.median(rates), "range": [min(rates), max(rates)],
                "bytes_per_update": statistics.median(b for _, b in runs[side]),
                "test_accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]),
                "table_devices": shards[side]}
        for other in SIDES[1:]:
            result[f"sharded_vs_{other}"] = {
                "speed": result["sharded"]["updates_per_s"] / result[other]["updates_per_s"],
                "bytes": result["sharded"]["bytes_per_update"] / result[other]["bytes_per_update"]}
        results[name] = result
        print(name + ": " + "; ".join(
            f"{side} {result[side]['updates_per_s']:.1f} upd/s, "
            f"{result[side]['bytes_per_update'] / 1e6:.3f} MB/update, "
            f"accuracy {result[side]['test_accuracy']:.3f}" for side in SIDES), flush=True)
    payload = {"config": {"vocab": VOCAB, "dim": DIM, "ids_per_example": IDS, "batch": BATCH,
                          "steps": _STEPS.value, "repeats": _REPEATS.value,
                          "workers": 2, "ps": 2},
               "results": results}
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    app.run(main)
