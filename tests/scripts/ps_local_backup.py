"""Backups of local-steps training hold the state kept beside the model; run
by keras-dist-run (in the shared cluster).

For an outer SGD with Nesterov momentum (DiLoCo), Delayed Nesterov and EASGD
(`elastic`): a first `fit` with `BackupAndRestore` stops with an error at the
start of its second epoch, after the first epoch's backup; a second `fit`
of a fresh model (other initial weights, a fresh outer optimizer) restores
that backup and finishes. Three snapshots of the model's weights, the
outer optimizer's variables and EASGD's per-worker copies:

- "crashed": when the first fit stopped (what the backup holds: nothing
  ran after it);
- "fresh": the second fit's, before the restore (a callback listed before
  `BackupAndRestore`);
- "restored": after the restore (a callback listed after it).

The chief writes out_dir/result.json: per variant, for each group of
variables (model, outer, outer_slots: the outer optimizer's momentum and
push buffer, elastic), each variable's largest difference between
"restored" and "crashed", and between "fresh" and "crashed"; the epoch the
second fit resumed at and the epochs it ran.

argv: out_dir.
"""

import json
import os
import sys

import numpy as np

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

(X, Y), _ = load_digits()
K, STEPS = 4, 36  # 9 pushes an epoch: Delayed Nesterov's buffer holds one (N = 2)


def snapshot(model):
    groups = {"model": [v.numpy() for v in model.weights]}
    outer = model.__dict__.get("outer_optimizer")
    if outer is not None:
        groups["outer"] = [v.numpy() for v in outer.variables]
        # Its slots: momentum, Delayed Nesterov's push buffer (not the counts).
        groups["outer_slots"] = [v.numpy() for v in outer.variables if "float" in str(v.dtype)
                                 and v is not outer.learning_rate]
    copies = model.__dict__.get("elastic_copies")
    if copies is not None:
        groups["elastic"] = [v.numpy() for v in copies.variables]
    return groups


class Snapshot(keras.callbacks.Callback):
    def __init__(self, crash_at=None):
        super().__init__()
        self.crash_at, self.taken = crash_at, None

    def on_train_begin(self, logs=None):
        if self.crash_at is None:
            self.taken = snapshot(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.crash_at:
            self.taken = snapshot(self.model)
            raise RuntimeError("stopped after the first epoch's backup")


def difference(a, b):
    return {group: [float(np.abs(np.asarray(x, np.float64) - y).max())
                    for x, y in zip(a[group], b[group])] for group in a}


def variant(out_dir, name, local):
    backup_dir = os.path.join(out_dir, name)

    def fit(callbacks, epochs=3):
        with strategy.scope():
            model = kd.AsyncModel.from_model(digits_model(keras.optimizers.SGD(0.05)))
        return model.fit(X, Y, batch_size=32, epochs=epochs, steps_per_epoch=STEPS, verbose=0,
                         local_steps=K, callbacks=callbacks, **local())

    crashed = Snapshot(crash_at=1)
    try:
        fit([kd.callbacks.BackupAndRestore(backup_dir), crashed])
    except RuntimeError:
        pass
    fresh, restored = Snapshot(), Snapshot()
    backup = kd.callbacks.BackupAndRestore(backup_dir)
    history = fit([fresh, backup, restored])
    return {"groups": sorted(crashed.taken),
            "restored": difference(restored.taken, crashed.taken),
            "fresh": difference(fresh.taken, crashed.taken),
            "restored_epoch": backup.restored_epoch,
            "epochs_run": len(history.history["loss"])}


def main(out_dir):
    result = {
        "nesterov": variant(out_dir, "nesterov", lambda: {
            "outer_optimizer": keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)}),
        "delayed_nesterov": variant(out_dir, "delayed_nesterov", lambda: {
            "outer_optimizer": kd.optimizers.DelayedNesterov(0.7, momentum=0.3)}),
        "elastic": variant(out_dir, "elastic", lambda: {"elastic": 0.3}),
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
