"""A user's first minute with an installed keras-dist, away from the source tree.

Run by tests/test_packaging.py with the Python of an environment where the
wheel was installed (a fresh one): checks the installed metadata (version,
SPDX license, the console script), that keras_dist comes from that
environment's site-packages, `keras-dist-run --help`, the bundled digits,
and a short `kd.fit`. Prints one JSON line with what it found; exits
non-zero on the first failed check.
"""

import importlib.metadata
import json
import os
import subprocess
import sys


def check(condition, message):
    if not condition:
        print(f"installed_smoke: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    import keras

    import keras_dist as kd
    from keras_dist.datasets import load_digits

    location = os.path.realpath(kd.__file__)
    check(location.startswith(os.path.realpath(sys.prefix)),
          f"keras_dist was imported from {location}, not from this environment "
          f"({sys.prefix})")
    meta = importlib.metadata.metadata("keras-dist")
    check(meta["Version"] == kd.__version__,
          f"metadata version {meta['Version']} != keras_dist.__version__ {kd.__version__}")
    check(meta["License-Expression"] == "Apache-2.0",
          f"License-Expression is {meta['License-Expression']!r}, not 'Apache-2.0'")
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    check(scripts.get("keras-dist-run") == "keras_dist.cluster.launch:main",
          f"console script keras-dist-run -> {scripts.get('keras-dist-run')!r}")
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-dist-run")
    help_run = subprocess.run([launcher, "--help"], capture_output=True, text=True,
                              timeout=120)
    check(help_run.returncode == 0 and "usage:" in help_run.stdout,
          f"keras-dist-run --help exited {help_run.returncode}: {help_run.stderr[-500:]}")

    (x_train, y_train), (x_test, y_test) = load_digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = kd.fit(model, x_train, y_train, epochs=5, batch_size=64, verbose=0)
    _, accuracy = history.model.evaluate(x_test, y_test, verbose=0)
    check(accuracy > 0.85, f"digits test accuracy {accuracy:.3f} after 5 epochs")
    print(json.dumps({"keras_dist": location, "version": kd.__version__,
                      "keras": keras.version(), "accuracy": round(float(accuracy), 4)}))


if __name__ == "__main__":
    main()
