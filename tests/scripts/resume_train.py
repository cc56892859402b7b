"""Digits training with kd.callbacks.BackupAndRestore, run on every task by
keras-dist-run (asynchronous with a ps task, MultiWorkerMirrored without).

The chief writes out_dir/weights-<epoch>.npz after each epoch (the weights
the backup of that epoch holds) and out_dir/progress-<epoch> as a marker;
with crash_epoch >= 0 it dies hard (os._exit) right after that epoch's
backup. At the end it writes out_dir/result.json.
argv: out_dir backup_dir epochs crash_epoch.
"""

import json
import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()  # MultiWorkerMirrored must come before any TF op

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402


def build_model():
    return digits_model(keras.optimizers.Adam(2e-3), seed=0)


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


class Record(keras.callbacks.Callback):
    """Listed after BackupAndRestore: sees the restored and the saved state."""

    def __init__(self, out_dir, crash_epoch, chief):
        super().__init__()
        self.out_dir, self.crash_epoch, self.chief = out_dir, crash_epoch, chief
        self.at_begin = None

    def on_train_begin(self, logs=None):
        self.at_begin = (flat(self.model.get_weights()),
                         flat([v.numpy() for v in self.model.optimizer.variables]))

    def on_epoch_end(self, epoch, logs=None):
        if not self.chief:
            return
        np.savez(os.path.join(self.out_dir, f"weights-{epoch + 1}.npz"),
                 weights=flat(self.model.get_weights()),
                 optimizer=flat([v.numpy() for v in self.model.optimizer.variables]),
                 version=-1 if getattr(self.model, "version", None) is None
                 else self.model.version)
        open(os.path.join(self.out_dir, f"progress-{epoch + 1}"), "w").close()
        if epoch == self.crash_epoch:
            os._exit(3)  # a crash: no cleanup, no on_train_end


def main(out_dir, backup_dir, epochs, crash_epoch):
    (x, y), (x_test, y_test) = load_digits()
    backup = kd.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    cluster = kd.ClusterConfig.from_env()
    chief = cluster is None or cluster.is_chief  # the task that records and writes results
    record = Record(out_dir, crash_epoch, chief)
    history = kd.fit(build_model, x[:1280], y[:1280], strategy=strategy, epochs=epochs,
                     batch_size=64, verbose=2, callbacks=[backup, record])
    if not chief:
        return
    np.savez(os.path.join(out_dir, "restored.npz"), weights=record.at_begin[0],
             optimizer=record.at_begin[1])
    model = history.model
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"restored_epoch": backup.restored_epoch, "epochs": history.epoch,
                   "version": getattr(model, "version", None),
                   "history": history.history}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
