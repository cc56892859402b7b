"""Two MultiWorkerMirrored workers whose inputs disagree in shape (worker 1
has 32 features instead of 64); run by keras-dist-run."""

import json
import os

import numpy as np

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402


def build_model():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
features = 64 if index == 0 else 32
x = np.random.default_rng(0).normal(size=(256, features)).astype("float32")
y = np.zeros(256, dtype="int32")
kd.fit(build_model, x, y, strategy=strategy, epochs=2, verbose=0)
print("finished", flush=True)
