"""Digits training with StragglerDetector + PerReplicaMetrics, run on every
task by keras-dist-run: asynchronous with a ps task, MultiWorkerMirrored
without. Slowdowns come from KERAS_DIST_SLOW_WORKER, set by the test.

The chief writes what the tests check to out_dir/result.json.
argv: out_dir epochs window threshold.
"""

import json
import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()  # MultiWorkerMirrored must come before any TF op

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402


def build_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.SGD(0.02, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class CountSteps(kd.callbacks.ReplicaCallback):
    """Steps each worker has reported so far (listed before the detector)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def on_replica_steps(self, batch, steps):
        for step in steps:
            self.counts[step.replica] = self.counts.get(step.replica, 0) + step.steps


def main(out_dir, epochs, window, threshold):
    (x, y), _ = load_digits()
    x, y = x[:1280], y[:1280]  # 20 batches of 64: equal batches on every replica
    counter = CountSteps()
    events = []

    def action(worker, score, logs):
        events.append({"worker": worker, "score": score,
                       "steps_of_worker": counter.counts.get(worker, 0)})

    detector = kd.callbacks.StragglerDetector(window=window, threshold=threshold,
                                                action=action)
    metrics = kd.callbacks.PerReplicaMetrics(log_dir=os.path.join(out_dir, "tb"))
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=epochs, batch_size=64,
                     verbose=2, callbacks=[counter, detector, metrics])
    if not detector.is_chief:
        return
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({
            "kind": type(strategy).__name__,
            "history": history.history,
            "events": events,
            "detector_events": [list(e) for e in detector.events],
            "scores": detector.scores,
            "totals": metrics.totals,
            "counts": counter.counts,
            "version": getattr(history.model, "version", None),
        }, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
