"""Asynchronous digits training, run on every task by keras-dist-run.

The chief writes what the tests check to out_dir/result.json and saves the
model. argv: out_dir [steps_per_execution].
"""

import json
import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402
from keras_dist.training.worker_step import WorkerStep  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402


def build_model():
    return digits_model(keras.optimizers.SGD(0.05, momentum=0.9), seed=0,
                        steps_per_execution=int(sys.argv[2]) if len(sys.argv) > 2 else 1)


def main(out_dir):
    (x, y), (x_test, y_test) = load_digits()
    batches = []

    counted = []

    class CountBatches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(batch)

        def on_epoch_end(self, epoch, logs=None):
            # The chief writes the epoch's metric sums where Keras reads them:
            # the "loss" mean's count is then the epoch's examples (epochs
            # without validation, which resets the metrics before this).
            counted.append(float(self.model.metrics[0].variables[1].numpy()))

    epochs, steps = 4, 45
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=epochs,
                     steps_per_epoch=steps, batch_size=32, verbose=2,
                     validation_data=(x_test, y_test), validation_freq=[1, 2, 3],
                     callbacks=[CountBatches()])
    model = history.model
    loss_count = counted[-1]
    result = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
    path = os.path.join(out_dir, "model.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    same = np.allclose(reloaded.predict(x_test, verbose=0), model.predict(x_test, verbose=0),
                       atol=1e-6)
    stats = model.staleness_stats
    ring = WorkerStep.current(model).ring
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({
            "history": history.history,
            "test_accuracy": result["accuracy"],
            "version": model.version,
            "iterations": int(model.optimizer.iterations.numpy()),
            "scheduled_steps": epochs * steps,
            "batches_seen": len(batches),
            "updates_per_worker": {str(k): v for k, v in stats.updates_per_worker().items()},
            "windows": [[r.claimed, r.seconds] for r in stats.records],
            "records": [[r.worker, r.staleness, r.seconds, r.claimed] for r in stats.records],
            "ring": None if ring is None else {"taken": ring.next, "lost": ring.lost},
            "last_epoch_examples_counted": loss_count,
            "reloaded_class": type(reloaded).__name__,
            "reloaded_predictions_match": bool(same),
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
