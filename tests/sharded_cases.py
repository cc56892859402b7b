"""The recommender-style model and data of the sharded-variable tests,
shared by tests/test_sharded.py (one device) and tests/scripts/ps_sharded.py
(on a parameter-server cluster)."""

import keras
import numpy as np

VOCAB, DIM = 600, 16  # a 38 KB table: MinSizePartitioner(1 KB) splits it


def data(n, seed):
    """Ids of 8 items per example; the label is a rule over the ids."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(n, 8)).astype("int32")
    return tokens, ((tokens % 2).sum(axis=1) > 4).astype("float32")


def recommender(optimizer, cls=keras.Model, steps_per_execution=1):
    """Embedding, pooling, a hidden layer (its kernel is sharded too), a
    sigmoid; compiled with `optimizer`."""
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="table")(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    model = cls(inputs, keras.layers.Dense(1, activation="sigmoid", name="out")(x))
    model.compile(optimizer, "binary_crossentropy", metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model
