"""Longer asynchronous digits training, for worker-failure tests.

argv: out_dir [epochs]. `epochs` is at most: training stops at the end of
the first epoch that finds out_dir/stop (a test writes it once it has seen
what it waits for). The chief prints each epoch's updates per worker
("updates after epoch N: {...}") and writes out_dir/result.json (version,
scheduled, test accuracy, per-epoch logs, each epoch's updates per worker).
"""

import json
import os
import sys

import tensorflow as tf

import keras_dist as kd

strategy = kd.resolve_strategy()
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
STEPS = 45


def main(out_dir):
    (x, y), (x_test, y_test) = load_digits()
    with strategy.scope():
        model = digits_model(keras.optimizers.SGD(0.05, momentum=0.9), cls=kd.AsyncModel,
                             seed=0)
    per_epoch = []  # each epoch's updates per worker (staleness_stats holds the last)

    def end(epoch, logs):
        per_epoch.append({str(k): v for k, v in
                          model.staleness_stats.updates_per_worker().items()})
        print(f"updates after epoch {epoch + 1}: {json.dumps(per_epoch[-1], sort_keys=True)}",
              flush=True)
        if os.path.exists(os.path.join(out_dir, "stop")):
            model.stop_training = True

    record = keras.callbacks.LambdaCallback(on_epoch_end=end)
    history = model.fit(x, y, epochs=EPOCHS, steps_per_epoch=STEPS, batch_size=32, verbose=2,
                        callbacks=[record])
    accuracy = model.evaluate(x_test, y_test, return_dict=True, verbose=0)["accuracy"]
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"version": model.version, "scheduled": len(per_epoch) * STEPS,
                   "test_accuracy": accuracy, "history": history.history,
                   "updates_per_epoch": per_epoch},
                  f)


if __name__ == "__main__":
    main(sys.argv[1])
