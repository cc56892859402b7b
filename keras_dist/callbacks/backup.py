"""`BackupAndRestore`: resume training after a crash or a preemption, from a
backup that is always whole, at the step it was taken."""

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import keras
import numpy as np

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.cluster.config import DEFAULT_GRACE_PERIOD
from keras_dist.cluster.config import PREEMPTED_EXIT_CODE  # noqa: F401  (kd.callbacks' too)

logger = logging.getLogger("keras_dist")

CHECK_EVERY = 10
"""Under MultiWorkerMirrored the workers agree on the step to stop at every
this many steps (one small all-reduce): one worker told to stop makes every
worker save at the same step (saving reads the mirrored weights)."""

_POINTER = "latest.json"
_WEIGHTS = "checkpoint.weights.h5"  # what keras_dist's first backups held
_ARRAYS = "variables.npz"
_METRICS = "metrics.npz"
_STATE = "state.json"
_LOCK = ".lock"
_PREFIX = "backup-"
_SIGNALS = ("SIGTERM", "SIGUSR1")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up as it goes; a rerun of the same command resumes it
    at the step the backup was taken, and a preempted task saves and exits.

    Each backup holds the model's variables (weights, non-trainable state,
    seed generators), the optimizer's state, the epoch and the step within
    it, the metrics' state of that epoch so far and (asynchronous training)
    the parameter version; with local steps, also the outer optimizer's
    state and EASGD's per-worker copies of the weights. The training thread
    reads it all at once (one round trip under parameter servers); a thread
    of its own writes it into a new directory under `backup_dir` with a
    checksum of every file while training goes on (an epoch's backup is in
    force before the next epoch starts), and only then does
    `backup_dir/latest.json` point at it (an atomic rename): a crash at any
    moment leaves a whole backup in force. The previous backup is kept
    (`keep=2`) and a newest one found damaged when restoring (a truncated
    or corrupted file) is skipped for the one before, with one warning naming
    the file.

    When training starts and a backup is there, it is restored: same
    weights and optimizer state, and training resumes at the epoch and step
    of the backup on the same batches an uninterrupted run would read there
    (keras_dist's loop positions the input: arrays always, a dataset whose
    order does not depend on how often it was read before, a `dataset_fn`
    by skipping; see docs/fault-tolerance.md). The resumed epoch's logs
    count all its steps, before and after the interruption.

    **Preemption.** While `fit` runs, SIGTERM and SIGUSR1 (what Kubernetes
    and SLURM's `--signal` send before SIGKILL) are caught: training stops
    at the next step -- under MultiWorkerMirrored every worker at the same
    one, agreed within `CHECK_EVERY` steps -- a backup is written and the
    process exits with `PREEMPTED_EXIT_CODE` (75). If that has not happened
    within 80% of `grace_period`, the process exits with that code without
    saving: the previous backup stays in force.

    Mid-epoch backups (`save_freq` in steps) and resuming mid-epoch need
    keras_dist's loop (`keras_dist.fit`, `AsyncModel.fit`); under Keras'
    own `model.fit` this callback backs up every epoch and refuses the rest
    with an error saying so. In a multi-worker job every worker must see
    `backup_dir` (a shared filesystem); only the chief writes it (other
    workers write throwaway copies, so that any collective reads stay
    matched). Two jobs writing the same `backup_dir` at once are refused.

    Args:
        backup_dir: Directory for the backups (created if needed).
        save_freq: `"epoch"` (after every epoch) or an integer: every that
            many steps (counted across epochs; asynchronous training counts
            updates). Defaults to `"epoch"`.
        delete_checkpoint: Boolean. Delete the backups when training
            finishes normally (default True: a later run starts afresh).
        keep: Integer >= 1. Backups kept; older ones are deleted once a
            newer one is in force. Defaults to 2 (a damaged newest backup
            falls back on the one before).
        save_on_preemption: Boolean. Catch SIGTERM and SIGUSR1 as above.
            Defaults to True.
        grace_period: Seconds between the scheduler's SIGTERM and its
            SIGKILL (Kubernetes' `terminationGracePeriodSeconds`, default
            30; with SLURM, the time given in `--signal=B:TERM@<time>`).

    Attributes:
        restored_epoch: Integer or `None`: the epoch training resumed at.
        restored_step: Integer or `None`: the step within it.
        restored_history: Dict or `None`: the epoch logs (`History`) of
            the epochs finished before the backup.

    Example:

    >>> import tempfile, numpy as np, keras, keras_dist as kd
    >>> backup = tempfile.mkdtemp()
    >>> def build():
    ...     inputs = keras.Input((4,))
    ...     model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     return model
    >>> x, y = np.ones((32, 4)), np.ones((32, 1))
    >>> class Crash(keras.callbacks.Callback):
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         if batch == 2:   # mid-epoch 1, after the backup of its step 2
    ...             raise RuntimeError("the machine went away")
    ...     def on_epoch_begin(self, epoch, logs=None):
    ...         self.on_train_batch_end = (Crash.on_train_batch_end.__get__(self)
    ...                                    if epoch == 1 else lambda *a, **k: None)
    >>> try:
    ...     kd.fit(build, x, y, epochs=3, batch_size=8, verbose=0, callbacks=[
    ...         kd.callbacks.BackupAndRestore(backup, save_freq=2), Crash()])
    ... except RuntimeError:
    ...     pass
    >>> restorer = kd.callbacks.BackupAndRestore(backup, save_freq=2)
    >>> history = kd.fit(build, x, y, epochs=3, batch_size=8, verbose=0,
    ...                  callbacks=[restorer])
    >>> restorer.restored_epoch, restorer.restored_step, history.epoch
    (1, 2, [1, 2])
    """

    _kd_ignores_batch_logs = True  # its batch hook counts steps (driver.reads_batch_logs)

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True, keep=2,
                 save_on_preemption=True, grace_period=DEFAULT_GRACE_PERIOD):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(
                "BackupAndRestore: `backup_dir` must be a non-empty directory path. "
                f"Received: backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and (isinstance(save_freq, bool)
                                     or not isinstance(save_freq, (int, np.integer))
                                     or save_freq < 1):
            raise ValueError(
                "BackupAndRestore: `save_freq` must be \"epoch\" or an integer number of "
                f"steps >= 1. Received: save_freq={save_freq!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"BackupAndRestore: `keep` must be an integer >= 1. Received: keep={keep!r}.")
        if (isinstance(grace_period, bool) or not isinstance(grace_period, (int, float))
                or not grace_period > 0):
            raise ValueError(
                "BackupAndRestore: `grace_period` must be a number of seconds > 0 (the "
                "time the scheduler leaves between SIGTERM and SIGKILL; Kubernetes' "
                f"default is 30). Received: grace_period={grace_period!r}.")
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        if os.path.exists(self.backup_dir) and not os.path.isdir(self.backup_dir):
            raise ValueError(
                f"BackupAndRestore: backup_dir={self.backup_dir!r} exists and is not a "
                "directory.")
        self.save_freq = save_freq if save_freq == "epoch" else int(save_freq)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.keep = keep
        self.save_on_preemption = bool(save_on_preemption)
        self.grace_period = float(grace_period)
        self.restored_epoch = self.restored_step = None
        self.restored_history = None
        # What the run's plan says (`_kd_bind_plan`, when keras_dist's loop
        # starts); until then, one process that leads and no launcher.
        self._chief = True
        self._workers = 1
        self._run_state = self._lock = None
        self._writer = None  # the thread writing the last backup
        self._write_error = None
        self._reader = None  # (variables' ids, the function reading them all)
        self._agree = None  # (strategy, the function summing the workers' stop flags)
        self._watchdog = None
        self._signalled_exit = False  # exiting for a preemption: the watchdog stays
        self._previous_handlers = {}
        self._signalled = None  # the name of the signal received, once one was
        self._epoch = 0
        self._done = 0  # steps done in the epoch in progress
        self._since = 0  # steps since the last backup
        self._history = {}

    def _kd_bind_plan(self, plan):
        """Takes what the run's `RunPlan` decided: whether this task leads,
        how many tasks train together, the launcher's run-state directory."""
        self._chief = bool(plan.is_chief)
        self._workers = plan.replica_workers
        self._run_state = plan.run_state

    # ------------------------------------------------------------- restoring
    def latest(self):
        """The backup in force: a dict (`epoch`, `step`, `path`, ...) or `None`.

        The newest whole backup: one whose files fail their checksum (torn
        or corrupted) is passed over for the one before, with a warning
        naming the file."""
        for path in self._candidates():
            state, problem = _read_backup(path)
            if problem is None:
                return dict(state, path=path)
            warnings.warn(f"BackupAndRestore: skipping the damaged backup {path!r}: "
                          f"{problem}. Using the one before it.", stacklevel=2)
        return None

    def _candidates(self):
        """Backup directories, newest first: the one `latest.json` names,
        then the others by the position they resume at."""
        if not os.path.isdir(self.backup_dir):
            return []
        names = [n for n in os.listdir(self.backup_dir)
                 if (n.startswith(_PREFIX) or n.startswith("epoch-"))
                 and os.path.isdir(os.path.join(self.backup_dir, n))]
        names.sort(key=_position_of, reverse=True)
        pointer = os.path.join(self.backup_dir, _POINTER)
        try:
            with open(pointer) as f:
                first = json.load(f)["directory"]
        except (OSError, ValueError, KeyError):
            first = None
        if first in names:
            names.remove(first)
            names.insert(0, first)
        return [os.path.join(self.backup_dir, n) for n in names]

    def on_train_begin(self, logs=None):
        self.restored_epoch = self.restored_step = None
        own_loop = bool(self.model.__dict__.get("_kd_loop"))
        if self.save_freq != "epoch" and not own_loop:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}): backups within an epoch "
                "need keras_dist's training loop, which can resume mid-epoch; Keras' own "
                "model.fit cannot. Train with keras_dist.fit(...), or use "
                "save_freq=\"epoch\".")
        self._take_lock()
        self._history = {}
        self._epoch, self._done, self._since = 0, 0, 0
        self._signalled = None
        checkpoint = self.latest()
        if checkpoint is not None:
            self._restore(checkpoint, own_loop)
        if self.save_on_preemption:
            self._catch_signals()

    def _restore(self, checkpoint, own_loop):
        model = self.model
        step = int(checkpoint.get("step", 0))
        if step and not own_loop:
            raise ValueError(
                f"BackupAndRestore: the backup {checkpoint['path']!r} was taken at step "
                f"{step} of epoch {checkpoint['epoch']}; only keras_dist's loop can resume "
                "there. Train with keras_dist.fit(...) (or delete the backup to start "
                "afresh).")
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
                path = os.path.join(checkpoint["path"], _ARRAYS)
                if os.path.exists(path):
                    _assign(_model_state(model), path, _local_state(model),
                            {id(v) for v in _elastic_copies(model)})
                else:  # a backup of keras_dist <= 0.x: Keras' weights file
                    model.load_weights(os.path.join(checkpoint["path"], _WEIGHTS))
            skipped = [str(w.message) for w in caught if "Skipping variable loading"
                       in str(w.message)]
            if skipped:  # Keras only warns, and the optimizer would start afresh
                raise ValueError(skipped[0])
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"BackupAndRestore: the backup {checkpoint['path']!r} (epoch "
                f"{checkpoint['epoch']}) does not fit this model: {error}. Was "
                "backup_dir used by another model? Delete it to start afresh.") from error
        counter = getattr(model, "version_counter", None)
        if counter is not None and checkpoint.get("version") is not None:
            counter.variable.assign(checkpoint["version"])
        self.restored_epoch, self.restored_step = checkpoint["epoch"], step
        self._epoch, self._done = checkpoint["epoch"], step
        self._history = checkpoint.get("history") or {}
        self.restored_history = {k: list(v) for k, v in self._history.items()}
        # Keras' own loop reads this after on_train_begin; so do keras_dist's.
        _compat.set_initial_epoch(model, checkpoint["epoch"])
        if own_loop:
            metrics = []
            if step:
                metrics = _read_arrays(os.path.join(checkpoint["path"], _METRICS))
            model.__dict__["_kd_resume"] = {"step": step, "metrics": metrics}
        if self._chief:
            logger.info("keras_dist: resuming from %s at epoch %d, step %d",
                        checkpoint["path"], checkpoint["epoch"] + 1, step)

    # ---------------------------------------------------------------- saving
    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._done = 0
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # Keras numbers a short last execution as a whole one (7 batches at
        # 3 per call end at batch 8): the steps done are at most the epoch's.
        done = batch + 1
        if (self.params or {}).get("steps"):
            done = min(done, int(self.params["steps"]))
        steps = done - self._done
        self._done = done
        self._since += steps
        # Under MultiWorkerMirrored: agree at the first batch end past each
        # multiple of CHECK_EVERY steps (the same batch ends on every worker).
        check = (self._done - steps) // CHECK_EVERY != self._done // CHECK_EVERY
        if self.save_on_preemption and self._stop_agreed(check):
            self._stop_here()
        if self.save_freq != "epoch" and self._since >= self.save_freq:
            self.save(self._epoch, step=self._done)

    def on_test_batch_end(self, batch, logs=None):
        # Preempted during validation: the epoch's training steps are done.
        if self.save_on_preemption and self._signalled and self._workers == 1:
            self._stop_here()

    def on_epoch_end(self, epoch, logs=None):
        for name, value in (logs or {}).items():
            if np.ndim(value) == 0:
                self._history.setdefault(name, []).append(float(value))
        if self.save_freq == "epoch":  # rare enough to be in force before going on
            self.save(epoch + 1, wait=True)
        if self.save_on_preemption and self._stop_agreed(True):
            self._preempted(epoch + 1, 0)

    def save(self, epoch, step=0, wait=False):
        """Writes a backup that resumes at `step` of 0-based `epoch`, then puts
        it in force.

        The training thread takes a snapshot (every variable of the model
        and the optimizer read at once, the parameter version first, the
        metrics' state); a thread of its own writes it and puts it in force
        while training goes on, unless `wait`. A save waits for the one
        before to be in force, and raises the error it met, if any."""
        self._since = 0
        self.wait_for_writes()
        counter = getattr(self.model, "version_counter", None)
        # The version before the weights: under parameter servers a backup
        # is a snapshot taken while updates go on.
        version = None if counter is None else counter.value
        executor = self.model.__dict__.get("_kd_executor")
        # The metrics' state, mid-epoch: kept by the chief under parameter
        # servers, else read with the rest (reads that sum the replicas'
        # state: collectives under MultiWorkerMirrored, so every worker).
        own_metrics = executor is not None and executor.parameter_server
        arrays = self._read(self.model, metrics=bool(step) and not own_metrics)
        metrics = None
        if step:
            if executor is not None:
                step = executor.position(step, version)
            if own_metrics:
                metrics = executor.metric_state()
            else:
                count = len(self.model.metrics_variables)
                arrays, metrics = arrays[:len(arrays) - count], arrays[len(arrays) - count:]
        if not self._chief:
            return  # only the chief writes; the others took part in the reads
        state = {"epoch": int(epoch), "step": int(step), "version": version,
                 "history": {k: list(v) for k, v in self._history.items()},
                 "saved_at": time.time()}
        if wait:
            self._write(state, arrays, metrics)
            return
        self._writer = threading.Thread(target=self._write_noting_errors,
                                        args=(state, arrays, metrics),
                                        name="keras_dist_backup_writer", daemon=True)
        self._writer.start()

    def wait_for_writes(self):
        """Waits until the backup being written is in force; raises the error
        writing it met, if any (a full disk, a lost mount)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    def _write_noting_errors(self, *args):
        try:
            self._write(*args)
        except BaseException as error:  # noqa: BLE001 (raised in the training thread)
            self._write_error = error

    def _write(self, state, arrays, metrics):
        epoch, step = state["epoch"], state["step"]
        os.makedirs(self.backup_dir, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".writing-", dir=self.backup_dir)
        try:
            files = [_ARRAYS]
            _write_arrays(os.path.join(staging, _ARRAYS), arrays)
            if metrics is not None:
                _write_arrays(os.path.join(staging, _METRICS), metrics)
                files.append(_METRICS)
            state["files"] = {name: _digest(os.path.join(staging, name)) for name in files}
            _write_json(os.path.join(staging, _STATE), state)
            _fsync_dir(staging)
            name = f"{_PREFIX}{epoch:06d}-{step:09d}"
            final = os.path.join(self.backup_dir, name)
            if os.path.exists(final):  # the same position again, after a restore
                shutil.rmtree(final)
            os.replace(staging, final)
            staging = None
            _write_json(os.path.join(self.backup_dir, _POINTER), {"directory": name},
                        atomic=True)
            _fsync_dir(self.backup_dir)
            self._prune(keep_name=name)
            _tell_launcher(self._run_state, final)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _read(self, model, metrics=False):
        """Every variable a backup holds (and with `metrics` the metrics'
        state after them), read in one call: under parameter servers one
        round trip, not one per variable; under MultiWorkerMirrored the
        metrics' sums in one go, not an all-reduce per variable."""
        variables = _state_variables(model)
        if metrics:
            variables += list(model.metrics_variables)
        key = tuple(id(v) for v in variables)
        if self._reader is None or self._reader[0] != key:
            import tensorflow as tf

            # Read inside the function (every call reads them anew); a
            # sharded variable converts to its shards concatenated.
            self._reader = (key, tf.function(
                lambda: [tf.identity(tf.convert_to_tensor(v)) for v in variables]))
        return [np.asarray(v) for v in self._reader[1]()]

    def _prune(self, keep_name):
        names = sorted((n for n in os.listdir(self.backup_dir)
                        if n.startswith(_PREFIX) or n.startswith("epoch-")), key=_position_of)
        for name in names[:-self.keep]:
            if name != keep_name:
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)
        for name in os.listdir(self.backup_dir):
            if name.startswith(".writing-"):  # left by a crash mid-write
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)

    def on_train_end(self, logs=None):
        _compat.set_initial_epoch(self.model, None)  # Keras would reuse it in the next fit
        self._restore_signals()
        self.wait_for_writes()
        if self.delete_checkpoint and self._chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        self._release_lock()

    def end_after_error(self):
        """What `on_train_end` undoes, for a `fit` that an exception ended
        (Keras calls no hook then): the signal handlers this callback set are
        the previous ones again, a backup being written is waited for, and
        the backup directory's lock is released. The backups stay. keras_dist's
        `fit` (and `AsyncModel.fit`) call it; after Keras' own `model.fit`
        raised, call it yourself.

        Example:

        >>> import signal, tempfile, keras_dist as kd
        >>> before = signal.getsignal(signal.SIGTERM)
        >>> backup = kd.callbacks.BackupAndRestore(tempfile.mkdtemp())
        >>> backup.end_after_error()  # nothing to undo: a no-op
        >>> signal.getsignal(signal.SIGTERM) is before
        True
        """
        self._restore_signals()
        try:
            self.wait_for_writes()
        finally:
            self._release_lock()

    # ------------------------------------------------------------ preemption
    def _catch_signals(self):
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("BackupAndRestore: fit() runs outside the main thread, where "
                          "signal handlers cannot be set: SIGTERM is not caught (no backup "
                          "on preemption).", stacklevel=3)
            return
        for name in _SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous_handlers[number] = signal.signal(number, self._on_signal)

    def _restore_signals(self):
        if self._watchdog is not None and not self._signalled_exit:
            self._watchdog.cancel()
        self._watchdog = None
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}

    def _on_signal(self, signum, frame):
        if self._signalled:
            return
        self._signalled = signal.Signals(signum).name
        # Never outlive the grace period: exit before SIGKILL can cut a write
        # short (the previous backup stays in force).
        self._watchdog = threading.Timer(0.8 * self.grace_period, self._give_up)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _give_up(self):
        sys.stderr.write(
            f"keras_dist: {self._signalled} received {0.8 * self.grace_period:.0f} s ago and "
            "training has not reached a step to stop at; exiting without a new backup (the "
            f"previous one stays in force), code {PREEMPTED_EXIT_CODE}.\n")
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def _stop_agreed(self, check):
        """Whether to stop here: a signal was received (by any worker, under
        MultiWorkerMirrored, where the workers agree where `check` is true:
        every `CHECK_EVERY` steps and at each epoch's end)."""
        if self._workers == 1 or not self._multi_worker():
            return bool(self._signalled)
        if not check:
            return False
        import tensorflow as tf

        strategy = self.model.distribute_strategy
        if self._agree is None or self._agree[0] is not strategy:
            # One compiled all-reduce (an eager one costs several ms a call).
            self._agree = (strategy, tf.function(lambda flag: strategy.reduce(
                "SUM", strategy.run(lambda: tf.identity(flag)), axis=None)))
        total = self._agree[1](tf.constant(1.0 if self._signalled else 0.0))
        if float(total) > 0 and not self._signalled:
            self._signalled = "a peer's signal"
        return float(total) > 0

    def _multi_worker(self):
        import tensorflow as tf

        strategy = getattr(self.model, "distribute_strategy", None)
        return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)

    def _stop_here(self):
        """Stops for a preemption at the current step. keras_dist's loop
        first lets what is in flight finish (parameter servers) and then
        calls back; Keras' own loop cannot resume mid-epoch, so there the
        process exits without a new backup (the last epoch's is in force)."""
        if self.model.__dict__.get("_kd_executor") is not None:
            self.model.__dict__["_kd_preempt"] = lambda: self._preempted(self._epoch,
                                                                         self._done)
            return
        if self._done == 0:
            self._preempted(self._epoch, 0)
        print(f"keras_dist: {self._signalled} at step {self._done} of epoch "
              f"{self._epoch + 1}: Keras' own loop cannot resume mid-epoch, so the backup "
              f"of the last epoch stays in force; exiting with code {PREEMPTED_EXIT_CODE}. "
              "Train with keras_dist.fit to back up and resume at the step.",
              file=sys.stderr, flush=True)
        self._signalled_exit = True
        self._restore_signals()
        self._release_lock()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _preempted(self, epoch, step):
        self._signalled_exit = True
        self.save(epoch, step=step, wait=True)
        self.wait_for_writes()
        if self._chief:
            print(f"keras_dist: {self._signalled}: backed up at epoch {epoch + 1}, step "
                  f"{step} in {self.backup_dir}; exiting with code {PREEMPTED_EXIT_CODE} "
                  "(preempted: rerun to resume)", file=sys.stderr, flush=True)
        self._restore_signals()
        self._release_lock()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    # ------------------------------------------------------------- the lock
    def _take_lock(self):
        """Refuses a backup_dir another running job is writing (a lock held
        while fit runs; the system drops it when a process dies)."""
        if not self._chief or self._lock is not None:
            return
        import fcntl

        os.makedirs(self.backup_dir, exist_ok=True)
        path = os.path.join(self.backup_dir, _LOCK)
        held = _HELD.get(path)
        if held is not None:  # this process, a fit that ended by an exception
            self._lock = held
            return
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            f.seek(0)
            owner = f.read().strip() or "another process"
            f.close()
            raise ValueError(
                f"BackupAndRestore: backup_dir={self.backup_dir!r} is in use by another "
                f"running job ({owner}). Two jobs writing one backup directory would "
                "resume each other's training; give each job its own backup_dir.") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}")
        f.flush()
        self._lock = _HELD[path] = f

    def _release_lock(self):
        if self._lock is None:
            return
        _HELD.pop(os.path.join(self.backup_dir, _LOCK), None)
        self._lock.close()
        self._lock = None


_HELD = {}  # lock path -> open file, for the locks this process holds


def _state_variables(model):
    """What a backup holds, in a fixed order: the model's variables (weights,
    non-trainable state, seed generators'), the optimizer's, then the state
    local steps keep beside them (`_local_state`)."""
    return _model_state(model) + _local_state(model)


def _model_state(model):
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    return variables


def _local_state(model):
    """The state of local-steps training outside the model and its optimizer,
    on the parameter servers: the outer optimizer's variables (its step
    count, momentum, Delayed Nesterov's push buffer) and EASGD's per-worker
    copies of the weights. Without them a resumed run would start its outer
    momentum from zero and its workers' copies from the weights the model
    had before the restore."""
    outer = model.__dict__.get("outer_optimizer")
    return (list(outer.variables) if outer is not None else []) + _elastic_copies(model)


def _elastic_copies(model):
    copies = model.__dict__.get("elastic_copies")
    return list(copies.variables) if copies is not None else []


def _write_arrays(path, arrays):
    with open(path, "wb") as f:
        np.savez(f, **{f"a{i}": np.asarray(a) for i, a in enumerate(arrays)})
        f.flush()
        os.fsync(f.fileno())


def _read_arrays(path):
    with np.load(path, allow_pickle=False) as saved:
        return [saved[f"a{i}"] for i in range(len(saved.files))]


def _assign(variables, path, local=(), per_worker=frozenset()):
    """Assigns the arrays saved at `path` to `variables` and then `local`
    (`_local_state`; `per_worker`: the ids of those with a row per worker,
    EASGD's copies), refusing any mismatch (count, shape) before assigning
    anything. A backup of an earlier keras_dist holds no `local` state: it is
    restored without it (the outer optimizer and EASGD's copies start
    afresh), with a warning."""
    arrays = _read_arrays(path)
    if local and len(arrays) == len(variables):
        logger.warning(
            "keras_dist: the backup %s holds no outer-optimizer or EASGD state (an earlier "
            "keras_dist wrote it); the model and its optimizer are restored, that state "
            "starts afresh.", os.path.dirname(path))
    else:
        variables = list(variables) + list(local)
    if len(arrays) != len(variables):
        what = ("this model, its optimizer and its local steps' state" if local
                else "this model and its optimizer")
        raise ValueError(f"it holds {len(arrays)} variables, {what} have {len(variables)}")
    for i, (variable, array) in enumerate(zip(variables, arrays)):
        if (id(variable) in per_worker and variable.shape[0] != array.shape[0]
                and tuple(variable.shape[1:]) == array.shape[1:]):
            raise ValueError(
                f"EASGD keeps one copy of the weights per worker: the backup holds "
                f"{array.shape[0]}, this run has {variable.shape[0]} workers. Resume with "
                f"{array.shape[0]} workers")
        if tuple(variable.shape) != array.shape:
            raise ValueError(f"variable {i} ({getattr(variable, 'path', variable.name)}) "
                             f"has shape {tuple(variable.shape)} here and {array.shape} "
                             "in the backup")
    for variable, array in zip(variables, arrays):
        variable.assign(array)


def _tell_launcher(state, path):
    """Notes the backup in force where `keras-dist-run` looks (`state`, its
    run-state directory, or `None`): it names it when it restarts the job."""
    if state and os.path.isdir(state):
        with contextlib.suppress(OSError):
            _write_json(os.path.join(state, "backup.json"), {"path": path}, atomic=True)


def _position_of(name):
    """`(epoch, step)` a backup directory's name resumes at."""
    try:
        if name.startswith(_PREFIX):
            epoch, step = name[len(_PREFIX):].split("-")
            return int(epoch), int(step)
        return int(name[len("epoch-"):]), 0
    except ValueError:
        return -1, -1


def _read_backup(path):
    """`(state, None)` for a whole backup, `(None, problem)` otherwise."""
    try:
        with open(os.path.join(path, _STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as error:
        return None, f"{os.path.join(path, _STATE)} cannot be read ({error})"
    for name, expected in (state.get("files") or {}).items():
        file = os.path.join(path, name)
        try:
            found = _digest(file)
        except OSError as error:
            return None, f"{file} cannot be read ({error})"
        if found != expected:
            return None, (f"{file} is damaged ({found['size']} bytes, checksum "
                          f"{found['sha256'][:12]}; written as {expected['size']} bytes, "
                          f"{expected['sha256'][:12]})")
    return state, None


def _digest(path):
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
            size += len(block)
    return {"size": size, "sha256": sha.hexdigest()}


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
