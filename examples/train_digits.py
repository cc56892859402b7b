"""Trains a small MLP on the bundled 8x8 digits with `keras_dist.fit`.

The same script runs on one machine and as one task of a cluster: the strategy
is resolved first (explicit flag > `KERAS_DIST_STRATEGY` > `TF_CONFIG` /
SLURM > local GPUs > default), before TensorFlow creates anything, because
MultiWorkerMirroredStrategy must configure collective ops at start-up.

Usage:

    keras-dist-run --workers 2 --ps 1 -- python examples/train_digits.py  # async
    python examples/train_digits.py
    python examples/train_digits.py --strategy=mirrored --epochs=10
    keras-dist-run --workers 2 --ps 1 -- python examples/train_digits.py --staleness=dynsgd
    keras-dist-run --workers 2 --ps 1 -- python examples/train_digits.py --local_steps=4

Besides its own flags it takes keras_dist's (`keras_dist.flags`: strategy,
staleness-aware optimizer, local steps, straggler detection, TensorBoard;
`--help` lists them).

As one of two workers (run once per index, each in its own shell):

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
                "task": {"type": "worker", "index": 0}}' \
        python examples/train_digits.py
"""

from absl import app
from absl import flags

import keras_dist as kd
from keras_dist import flags as kd_flags

kd_flags.define_flags()  # --strategy, --staleness, --local_steps, --tensorboard_dir, ...
_EPOCHS = flags.DEFINE_integer("epochs", 20, "Passes over the training set.")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 64, "Global batch size, split over all replicas.")
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 0.05, "SGD learning rate (momentum 0.9).")
_SEED = flags.DEFINE_integer(
    "seed", 0, "Seed of the initial weights and the data split; every worker "
    "must use the same one.")


def build_model():
    """Builds and compiles the digits MLP: 64 features -> 10 classes."""
    import keras

    # Same seed on every worker: replicas must start from the same weights.
    keras.utils.set_random_seed(_SEED.value)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="digits_mlp")
    model.compile(
        # Wrapped as --staleness / --max_staleness say (unchanged by default).
        optimizer=kd_flags.wrap_optimizer(
            keras.optimizers.SGD(_LEARNING_RATE.value, momentum=0.9)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    # First, before any TensorFlow op: see the module docstring.
    strategy = kd_flags.strategy_from_flags()

    from keras_dist.datasets import load_digits

    (x_train, y_train), (x_test, y_test) = load_digits(seed=_SEED.value)
    history = kd.fit(
        build_model, x_train, y_train,
        epochs=_EPOCHS.value, batch_size=_BATCH_SIZE.value,
        validation_split=0.1, verbose=2,
        **kd_flags.fit_kwargs(strategy=strategy))  # strategy, local steps, callbacks
    results = kd.evaluate(history.model, x_test, y_test,
                          return_dict=True, verbose=0)
    kind = kd.choose_strategy(flags.FLAGS.strategy).kind.value
    print(f"test accuracy: {results['accuracy']:.4f} "
          f"(strategy: {kind}, replicas: {strategy.num_replicas_in_sync})")
    if "staleness_mean" in history.history:
        means = history.history["staleness_mean"]
        print(f"asynchronous updates: {history.model.version}, staleness mean "
              f"{sum(means) / len(means):.2f} (last epoch {means[-1]:.2f}), max "
              f"{max(history.history['staleness_max']):.0f}")


if __name__ == "__main__":
    app.run(main)
