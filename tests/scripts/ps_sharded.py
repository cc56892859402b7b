"""A large Embedding on 2 parameter servers; run by keras-dist-run.

argv: out_dir mode, mode "partitioned" (MinSizePartitioner: Keras 3's
optimizer cannot update the shards, so a clear error is expected) or "whole"
(no partitioner: variables are placed round-robin over both ps tasks).
The chief writes out_dir/result.json.
"""

import json
import os
import sys

import tensorflow as tf

import keras_dist as kd

MODE = sys.argv[2]
partitioner = (tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=64 * 1024, max_shards=2) if MODE == "partitioned" else None)
strategy = kd.resolve_strategy(variable_partitioner=partitioner)
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402
import numpy as np  # noqa: E402

VOCAB, DIM = 5000, 32  # 640 KB of float32: shardable


def main(out_dir):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(4000, 8))
    labels = ((tokens % 2).sum(axis=1) > 4).astype("float32")  # a rule over the ids
    with strategy.scope():
        inputs = keras.Input((8,), dtype="int32")
        embedded = keras.layers.Embedding(VOCAB, DIM, name="table")(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        outputs = keras.layers.Dense(1, activation="sigmoid")(
            keras.layers.Dense(32, activation="relu")(pooled))
        model = kd.AsyncModel(inputs, outputs)
        model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                      metrics=["accuracy"])
    result = {"devices": sorted({w.value.device for w in model.weights
                                 if hasattr(w.value, "device")})}
    try:
        history = model.fit(tokens, labels, epochs=6, batch_size=64, verbose=2)
        result.update(history=history.history, version=model.version)
    except ValueError as error:
        result["error"] = str(error)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
