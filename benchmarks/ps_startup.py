"""Whole-process time of parameter-server training: keras_dist against tf-keras.

    python benchmarks/ps_startup.py            # the driver: launches the runs

For each side it starts a fresh local cluster (`keras-dist-run --workers 2
--ps 1`, four new processes) running this script in `--side` mode, and
measures the wall time from launching it to the chief's "fit done" mark:
imports, cluster start, model creation, tracing and `--epochs` epochs of
`--steps` updates of the digits MLP (SGD, steps_per_execution `--spe`).
The sides alternate, `--repeats` times each; the medians are compared.
Target: keras_dist / tf-keras >= 1.0 in speed (time ratio tf-keras /
keras_dist). Needs the `bench` extra (tf-keras). Writes
benchmarks/results/ps_startup.json.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

_SIDE = flags.DEFINE_enum("side", None, ["keras_dist", "tf_keras"],
                          "Run one side as a cluster task (set by the driver).")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs per run.")
_STEPS = flags.DEFINE_integer("steps", 200, "Updates per epoch.")
_SPE = flags.DEFINE_integer("spe", 1, "steps_per_execution.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per side.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/ps_startup.json",
                              "Where to write the JSON.")
_MARK = "KD_STARTUP_FIT_DONE"


def run_side(side):
    import tensorflow as tf

    import keras_dist as kd

    strategy = kd.resolve_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()  # worker and ps tasks serve until the launcher stops them
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    if side == "keras_dist":
        import keras

        with strategy.scope():
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(64, activation="relu")(inputs)
            model = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
            model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=_SPE.value)
        model.fit(x, y, batch_size=32, epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value,
                  verbose=0)
    else:
        import tf_keras

        def dataset_fn(input_context=None):
            del input_context
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048).repeat().batch(32)

        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input((64,)), tf_keras.layers.Dense(64, activation="relu"),
                tf_keras.layers.Dense(10, activation="softmax")])
            model.compile(tf_keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=_SPE.value)
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn),
                  epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value, verbose=0)
    print(f"{_MARK} {time.time():.6f}", flush=True)


def launch(side):
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-dist-run")
    cmd = [launcher, "--workers", "2", "--ps", "1", "--", sys.executable, __file__,
           f"--side={side}", f"--epochs={_EPOCHS.value}", f"--steps={_STEPS.value}",
           f"--spe={_SPE.value}"]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    marks = [line for line in proc.stdout.splitlines() if _MARK in line]
    if proc.returncode != 0 or not marks:
        raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-2000:]}")
    return float(marks[-1].split()[-1]) - start


def main(argv):
    del argv
    if _SIDE.value:
        run_side(_SIDE.value)
        return
    seconds = {"keras_dist": [], "tf_keras": []}
    for repeat in range(_REPEATS.value):
        order = ["keras_dist", "tf_keras"] if repeat % 2 == 0 else ["tf_keras", "keras_dist"]
        for side in order:
            seconds[side].append(launch(side))
            print(f"{side}: {seconds[side][-1]:.1f} s", flush=True)
    med = {side: statistics.median(v) for side, v in seconds.items()}
    ratio = med["tf_keras"] / med["keras_dist"]
    print(f"whole-process seconds to the end of fit (median of {_REPEATS.value}): "
          f"keras_dist {med['keras_dist']:.1f}, tf-keras {med['tf_keras']:.1f}; "
          f"speed ratio keras_dist / tf-keras = {ratio:.3f}")
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"seconds": seconds, "median_seconds": med, "speed_ratio": ratio,
                   "epochs": _EPOCHS.value, "steps": _STEPS.value, "spe": _SPE.value}, f,
                  indent=2)


if __name__ == "__main__":
    app.run(main)
