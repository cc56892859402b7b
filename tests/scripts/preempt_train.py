"""Digits training with mid-epoch backups, to be preempted from outside.

argv: out_dir backup_dir epochs save_freq [strategy]
strategy: "auto" (default: the cluster's, under keras-dist-run) or "mirrored"
(two logical CPUs in this process).

Deterministic (`keras.utils.set_random_seed`, `enable_op_determinism`; but
asynchronous training, where each update's order is a race), and
each step takes at least STEP_SECONDS so a test can signal mid-epoch. After
each batch the chief writes out_dir/progress ("<epoch> <step>", 0-based
epoch, steps done); at the end out_dir/result.json (History, what was
restored, the parameter version) and out_dir/final.npz (weights, optimizer
variables).
"""

import json
import os
import sys
import time

import keras_dist as kd

WHICH = sys.argv[5] if len(sys.argv) > 5 else "auto"
if WHICH == "mirrored":
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = kd.resolve_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
else:
    strategy = kd.resolve_strategy()  # MultiWorkerMirrored must come before any TF op

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

STEP_SECONDS = 0.02


def build_model():
    return digits_model(keras.optimizers.Adam(2e-3), hidden=32, seed=0)


class Progress(keras.callbacks.Callback):
    def __init__(self, out_dir, chief):
        super().__init__()
        self.path, self.chief = os.path.join(out_dir, "progress"), chief
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(STEP_SECONDS)
        if self.chief:
            with open(self.path + ".tmp", "w") as f:
                f.write(f"{self.epoch} {batch + 1}")
            os.replace(self.path + ".tmp", self.path)


def main(out_dir, backup_dir, epochs, save_freq):
    cluster = kd.ClusterConfig.from_env()
    if cluster is None or not cluster.num_ps:  # refused there: not deterministic
        tf.config.experimental.enable_op_determinism()
    chief = cluster is None or cluster.is_chief  # the task that writes the results
    (x, y), (x_test, y_test) = load_digits()
    backup = kd.callbacks.BackupAndRestore(
        backup_dir, save_freq=save_freq if save_freq == "epoch" else int(save_freq),
        delete_checkpoint=False)
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=epochs, batch_size=64,
                     validation_data=(x_test, y_test), verbose=2,
                     callbacks=[backup, Progress(out_dir, chief)])
    if not chief:
        return
    model = history.model
    np.savez(os.path.join(out_dir, "final.npz"),
             *[np.asarray(w) for w in model.get_weights()],
             *[np.asarray(v) for v in model.optimizer.variables])
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"history": history.history, "epochs": history.epoch,
                   "restored_epoch": backup.restored_epoch,
                   "restored_step": backup.restored_step,
                   "restored_history": backup.restored_history,
                   "version": getattr(model, "version", None),
                   "step_counts": model.__dict__.get("step_counts")}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
