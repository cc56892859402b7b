"""`BackupAndRestore`: resume training after a crash, from a checkpoint that is
always whole."""

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings

import keras

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.cluster import ClusterConfig

logger = logging.getLogger("keras_dist")

_POINTER = "latest.json"
_WEIGHTS = "checkpoint.weights.h5"
_STATE = "state.json"


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up every epoch; a rerun of the same command resumes it.

    At the end of every epoch the chief writes the model's weights, the
    optimizer's state, the epoch counter and (asynchronous training) the
    parameter version into a new directory under `backup_dir`, and only then
    points `backup_dir/latest.json` at it, with an atomic rename. A crash at
    any moment leaves either the previous checkpoint or the new one in
    force, never a half-written one. When training starts and a checkpoint
    is there, it is restored: same weights, same optimizer state, and
    training continues at the epoch after the checkpoint (the epoch counter,
    `History` and callbacks see the real epoch numbers).

    Use it instead of `keras.callbacks.BackupAndRestore` with keras_dist's
    loops (MultiWorkerMirrored, parameter servers), where Keras' callback
    cannot set the starting epoch, and wherever a crash may hit during a
    write: Keras' writes the weights in place and its epoch file after them,
    so a crash in between resumes with mismatched weights and epoch, and it
    leaves the starting epoch set on the model for the next `fit` call. In a
    multi-worker job every worker must see `backup_dir` (a shared
    filesystem); only the chief writes it (other workers write throwaway
    copies, so that any collective reads stay matched).

    Args:
        backup_dir: Directory for the checkpoints (created if needed).
        delete_checkpoint: Boolean. Delete the backups when training
            finishes normally (default True: a later run starts afresh).
        keep: Integer >= 1. Checkpoints kept; older ones are deleted once
            a newer one is in force.

    Attributes:
        restored_epoch: Integer or `None`: the epoch training resumed at.

    Example:

    >>> import tempfile, numpy as np, keras, keras_dist as kd
    >>> backup = tempfile.mkdtemp()
    >>> def build():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     return model
    >>> x, y = np.ones((32, 4)), np.ones((32, 1))
    >>> class Crash(keras.callbacks.Callback):
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         if epoch == 1:
    ...             raise RuntimeError("the machine went away")
    >>> model = build()
    >>> try:
    ...     model.fit(x, y, epochs=4, verbose=0, callbacks=[
    ...         kd.callbacks.BackupAndRestore(backup), Crash()])
    ... except RuntimeError:
    ...     pass
    >>> model = build()   # a new process would start here
    >>> history = model.fit(x, y, epochs=4, verbose=0, callbacks=[
    ...     kd.callbacks.BackupAndRestore(backup)])
    >>> history.epoch    # epoch 1 was backed up before the crash
    [2, 3]
    """

    def __init__(self, backup_dir, delete_checkpoint=True, keep=1):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(
                "BackupAndRestore: `backup_dir` must be a non-empty directory path. "
                f"Received: backup_dir={backup_dir!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"BackupAndRestore: `keep` must be an integer >= 1. Received: keep={keep!r}.")
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        if os.path.exists(self.backup_dir) and not os.path.isdir(self.backup_dir):
            raise ValueError(
                f"BackupAndRestore: backup_dir={self.backup_dir!r} exists and is not a "
                "directory.")
        self.delete_checkpoint = bool(delete_checkpoint)
        self.keep = keep
        self.restored_epoch = None
        cluster = ClusterConfig.from_env()
        self._chief = cluster is None or cluster.is_chief

    # ------------------------------------------------------------- restoring
    def latest(self):
        """The checkpoint in force: a dict (`epoch`, `path`, ...) or `None`."""
        pointer = os.path.join(self.backup_dir, _POINTER)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            latest = json.load(f)
        path = os.path.join(self.backup_dir, latest["directory"])
        with open(os.path.join(path, _STATE)) as f:
            state = json.load(f)
        return dict(state, path=path)

    def on_train_begin(self, logs=None):
        self.restored_epoch = None
        checkpoint = self.latest()
        if checkpoint is None:
            return
        model = self.model
        if not model.built:
            raise ValueError(
                "BackupAndRestore: the model must be built before fit() to restore "
                f"{checkpoint['path']!r} into it (keras_dist.fit builds it).")
        strategy = getattr(model, "distribute_strategy", None)
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        try:
            with scope, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if model.optimizer is not None and not model.optimizer.built:
                    model.optimizer.build(model.trainable_variables)
                model.load_weights(os.path.join(checkpoint["path"], _WEIGHTS))
            skipped = [str(w.message) for w in caught if "Skipping variable loading"
                       in str(w.message)]
            if skipped:  # Keras only warns, and the optimizer would start afresh
                raise ValueError(skipped[0])
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"BackupAndRestore: the checkpoint {checkpoint['path']!r} (epoch "
                f"{checkpoint['epoch']}) does not fit this model: {error}. Was "
                "backup_dir used by another model? Delete it to start afresh.") from error
        counter = getattr(model, "version_counter", None)
        if counter is not None and checkpoint.get("version") is not None:
            counter.variable.assign(checkpoint["version"])
        self.restored_epoch = checkpoint["epoch"]
        # Keras' own loop reads this after on_train_begin; so do keras_dist's.
        model._initial_epoch = checkpoint["epoch"]
        if self._chief:
            logger.info("keras_dist: resuming from %s at epoch %d (backed up after "
                        "epoch %d)", checkpoint["path"], checkpoint["epoch"] + 1,
                        checkpoint["epoch"])

    # ---------------------------------------------------------------- saving
    def on_epoch_end(self, epoch, logs=None):
        self.save(epoch + 1)

    def save(self, epoch):
        """Writes a checkpoint that resumes at `epoch`, then puts it in force."""
        os.makedirs(self.backup_dir, exist_ok=True)
        parent = self.backup_dir if self._chief else None
        staging = tempfile.mkdtemp(prefix=".writing-", dir=parent)
        try:
            self.model.save_weights(os.path.join(staging, _WEIGHTS))
            counter = getattr(self.model, "version_counter", None)
            state = {"epoch": epoch,
                     "version": None if counter is None else counter.value}
            _write_json(os.path.join(staging, _STATE), state)
            _fsync_dir(staging)
            if not self._chief:
                return
            name = f"epoch-{epoch:06d}"
            final = os.path.join(self.backup_dir, name)
            if os.path.exists(final):  # the same epoch again, after a restore
                shutil.rmtree(final)
            os.replace(staging, final)
            staging = None
            _write_json(os.path.join(self.backup_dir, _POINTER), {"directory": name},
                        atomic=True)
            _fsync_dir(self.backup_dir)
            self._prune(keep_name=name)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _prune(self, keep_name):
        names = sorted(n for n in os.listdir(self.backup_dir) if n.startswith("epoch-"))
        for name in names[:-self.keep]:
            if name != keep_name:
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)
        for name in os.listdir(self.backup_dir):
            if name.startswith(".writing-"):  # left by a crash mid-write
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)

    def on_train_end(self, logs=None):
        self.model._initial_epoch = None  # Keras would reuse it in the next fit
        if self.delete_checkpoint and self._chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _write_json(path, data, atomic=False):
    target = path + ".tmp" if atomic else path
    with open(target, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
