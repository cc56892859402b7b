"""Writes tests/data/saved-<version>/*.keras: models saved by this version of
keras_dist, which later versions must keep loading (tests/test_saved_files.py).

Run once per released layout: `python tools/make_saved_fixtures.py`.
"""

import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402


def mlp(cls=keras.Model):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3)(hidden))


def main():
    out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / f"saved-{kd.__version__}"
    out.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.arange(16) % 3
    cases = {
        "async_model_dynsgd": (kd.AsyncModel, kd.optimizers.DynSGD(keras.optimizers.SGD(0.1))),
        "gap_aware_dana": (keras.Model, kd.optimizers.GapAware(kd.optimizers.DANA(
            keras.optimizers.SGD(0.05), momentum=0.9))),
        "dcasgd": (keras.Model, kd.optimizers.DCASGD(keras.optimizers.SGD(0.1))),
        "staleness_limit_scaled": (keras.Model, kd.optimizers.StalenessLimit(
            kd.optimizers.StalenessScaled(keras.optimizers.Adam(1e-3)), max_staleness=4)),
    }
    for name, (cls, optimizer) in cases.items():
        model = mlp(cls)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(x, y, epochs=1, batch_size=8, verbose=0)
        model.save(out / f"{name}.keras")
        np.save(out / f"{name}.predict.npy", model.predict(x, verbose=0))
    np.save(out / "inputs.npy", x)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
