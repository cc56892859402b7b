"""Finds a slow worker: StragglerDetector and PerReplicaMetrics on digits.

One worker is made slower on purpose (`keras_dist.testing`, the same as
`KERAS_DIST_SLOW_WORKER=1:10`); the detector names it within a window of
steps, and the per-worker metrics show what it costs. Run it under the
launcher, asynchronously (with a parameter server) or synchronously:

    keras-dist-run --workers 2 --ps 1 -- python examples/straggler_demo.py
    keras-dist-run --workers 2 -- python examples/straggler_demo.py
    keras-dist-run --workers 2 --ps 1 -- python examples/straggler_demo.py --slow=

`--tensorboard_dir` writes TensorBoard runs, one per worker, and Keras' own:
`tensorboard --logdir /tmp/straggler_demo`. The detector's flags are
keras_dist's (`keras_dist.flags`), with this demo's defaults; `--threshold`
and `--window` are short for `--straggler_threshold` and `--straggler_window`.
"""

import os

from absl import app
from absl import flags

import keras_dist as kd
from keras_dist import flags as kd_flags

kd_flags.define_flags(staleness=False, local_steps=False, sharding=False)
# This demo's defaults: the detector on, a shorter window, the per-worker table.
flags.FLAGS.set_default("straggler_threshold", 0.2)
flags.FLAGS.set_default("straggler_window", 30)
flags.FLAGS.set_default("per_replica_metrics", True)
flags.DEFINE_alias("threshold", "straggler_threshold")
flags.DEFINE_alias("window", "straggler_window")
_SLOW = flags.DEFINE_string(
    "slow", "1:10", "Slowed worker and factor, `index:factor` (empty: none). "
    "The index is a worker's in asynchronous training and a replica's in "
    "synchronous training (one per worker here).")
_EPOCHS = flags.DEFINE_integer("epochs", 6, "Passes over the training set.")
_VERBOSE = flags.DEFINE_integer("verbose", 0, "Keras verbosity (2: one line per "
                                "epoch with every per-worker number).")


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="digits_mlp")
    model.compile(keras.optimizers.SGD(0.02, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if _SLOW.value:
        os.environ[kd.testing.SLOW_WORKER_ENV] = _SLOW.value
        kd.testing.slow_workers_from_env()  # a bad --slow fails here, clearly
    strategy = kd_flags.strategy_from_flags()  # before any TensorFlow op

    import keras

    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    cluster = kd.ClusterConfig.from_env()
    is_chief = cluster is None or cluster.is_chief

    class EpochLine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            costs = "  ".join(f"{k.split('/')[1]} {v:.0%}" for k, v in sorted(logs.items())
                              if k.startswith("straggler_cost/"))
            if is_chief:
                print(f"epoch {epoch + 1}: loss {logs['loss']:.3f}  cost of each worker: "
                      f"{costs or '(not yet: the detector needs a window of steps)'}",
                      flush=True)

    # StragglerDetector and PerReplicaMetrics (and TensorBoard) from the flags.
    kwargs = kd_flags.fit_kwargs(strategy=strategy, cluster=cluster, callbacks=[EpochLine()])
    detectors = [c for c in kwargs["callbacks"]
                 if isinstance(c, kd.callbacks.StragglerDetector)]
    history = kd.fit(build_model, x, y, epochs=_EPOCHS.value, batch_size=64,
                     verbose=_VERBOSE.value, **kwargs)
    result = kd.evaluate(history.model, x_test, y_test, return_dict=True, verbose=0)
    if is_chief:
        flagged = sorted({e[1] for d in detectors for e in d.events if e[3] == "flagged"})
        print(f"test accuracy {result['accuracy']:.4f}; flagged: {flagged or 'nobody'}")


if __name__ == "__main__":
    app.run(main)
