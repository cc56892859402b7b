"""What keras_dist's loops tell callbacks about each replica and worker.

Keras hands callbacks one averaged set of numbers per batch. keras_dist's
loops also know, for every execution, which replica or worker ran it, how
long its computation took and what loss it saw; they pass that to every
`ReplicaCallback` as a list of `ReplicaStep`s, just before
`on_train_batch_end`.

Where the numbers come from:

- Asynchronous training (parameter servers): each scheduled execution runs
  on one worker, which reports its index, its wall time, the examples and
  loss of its batches, and each update's staleness (`replica` is
  `"worker<i>"`).
- Synchronous training under `MirroredStrategy` or
  `MultiWorkerMirroredStrategy` (`keras_dist.fit`): every replica reports,
  for every execution, the time from its batch arriving to its gradients
  being ready -- measured *before* the gradient all-reduce, after which
  every replica waits for the slowest and the straggler would be hidden
  (`replica` is `"replica<r>"`, `r` = `replica_id_in_sync_group`; with one
  device per worker, replica r is worker r).
- Anywhere else (Keras' own loop: one device, or a plain `model.fit`): the
  callback times each batch on the host and reports it as `"replica0"`.
"""

import dataclasses
import math
import time
from typing import Optional, Tuple

import keras

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


@dataclasses.dataclass(frozen=True)
class ReplicaStep:
    """One replica's (or worker's) share of one execution.

    Attributes:
        replica: String. `"worker<i>"` (asynchronous) or `"replica<r>"`.
        steps: Integer. Train steps in the execution.
        seconds: Float. Compute time of those steps (see the module docs).
        examples: Integer or `None`. Examples the replica trained on.
        loss: Float. Mean training loss over those examples (NaN if unknown).
        staleness: Tuple of integers, one tau per update (asynchronous
            training only; empty otherwise).
        waited: Float. Seconds the replica spent at the gradient all-reduce
            waiting for the others (synchronous training under
            `keras_dist.fit`; NaN elsewhere). The replica everybody waits for
            waits the least.
        stalled: Float. Seconds the replica's process could not run
            (stopped, or starved of CPU; see `keras_dist.training.stall`) during the
            execution (synchronous training under `keras_dist.fit`; NaN
            elsewhere).

    Example:

    >>> from keras_dist.callbacks import ReplicaStep
    >>> step = ReplicaStep("worker1", steps=2, seconds=0.03, examples=64, loss=0.5,
    ...                    staleness=(1, 0))
    >>> step.seconds / step.steps
    0.015
    """

    replica: str
    steps: int
    seconds: float
    examples: Optional[int] = None
    loss: float = math.nan
    staleness: Tuple[int, ...] = ()
    waited: float = math.nan
    stalled: float = math.nan

    @classmethod
    def from_report(cls, report, prefix, steps):
        """From a `keras_dist.training.step_report.StepReport`; `prefix` is
        `"worker"` or `"replica"`."""
        return cls(replica=f"{prefix}{report.worker}", steps=steps, seconds=report.seconds,
                   examples=report.examples, loss=report.loss, staleness=report.staleness,
                   waited=report.waited, stalled=report.stalled)


class ReplicaCallback(keras.callbacks.Callback):
    """Base class for callbacks that look at each replica or worker.

    Subclasses implement `on_replica_steps(batch, steps)`, called with a list
    of `ReplicaStep`s before each `on_train_batch_end`, and may return extra
    epoch logs from `replica_logs()`. keras_dist's loops add those logs to
    the epoch logs before any callback sees them (so `CSVLogger` and
    `TensorBoard` get them wherever they are in the list); under Keras' own
    loop they are added in this callback's `on_epoch_end`, so list it before
    the callbacks that should see them.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> class CountSteps(kd.callbacks.ReplicaCallback):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.seen = {}
    ...     def on_replica_steps(self, batch, steps):
    ...         for step in steps:
    ...             self.seen[step.replica] = self.seen.get(step.replica, 0) + step.steps
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> counter = CountSteps()
    >>> _ = model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16,
    ...               epochs=1, verbose=0, callbacks=[counter])
    >>> counter.seen
    {'replica0': 4}
    """

    def __init__(self):
        super().__init__()
        self._fed_by_loop = False
        self._batch_started = None
        self._chief = None

    # --------------------------------------------------------------- overrides
    def on_replica_steps(self, batch, steps):
        """Called with a list of `ReplicaStep`s before `on_train_batch_end`."""

    def replica_logs(self):
        """Extra epoch logs (a dict); called before `on_epoch_end`."""
        return {}

    # ----------------------------------------------------------- loop protocol
    def _kd_feed(self, batch, steps):
        self._fed_by_loop = True
        self.on_replica_steps(batch, steps)

    def on_train_begin(self, logs=None):
        self._fed_by_loop = False

    def on_train_batch_begin(self, batch, logs=None):
        if not self._fed_by_loop:
            self._batch_started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._fed_by_loop or self._batch_started is None:
            return
        # Keras' own loop: one replica, timed on the host. Its batch logs
        # hold running means, not this batch's loss: the loss stays unknown.
        seconds = time.perf_counter() - self._batch_started
        self._batch_started = None
        self.on_replica_steps(batch, [ReplicaStep("replica0", 1, seconds)])

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and not self._fed_by_loop:
            logs.update(self.replica_logs())

    @property
    def is_chief(self):
        """Whether this process reports (the chief, or the only process)."""
        # Told by keras_dist's loop (`bind_plan`); elsewhere (Keras' own
        # loop in one process) this process is the only one.
        return True if self._chief is None else self._chief


def replica_callbacks(callbacks):
    """The `ReplicaCallback`s in a `CallbackList` or list (may be empty)."""
    items = getattr(callbacks, "callbacks", callbacks) or []
    return [cb for cb in items if isinstance(cb, ReplicaCallback)]


def bind_plan(callbacks, plan):
    """Hands the run's plan (`keras_dist.training.plan.RunPlan`) to the
    callbacks that need what it decided: those that report on the chief only
    learn whether this is it, a `BackupAndRestore` its cluster and the
    launcher's run-state directory. Nothing reads the environment for them."""
    items = getattr(callbacks, "callbacks", callbacks) or []
    for callback in items:
        if hasattr(callback, "_chief"):
            callback._chief = bool(plan.is_chief)
        bind = getattr(callback, "_kd_bind_plan", None)
        if bind is not None:
            bind(plan)


def feed(callbacks, batch, steps):
    """Gives each `ReplicaCallback` the `ReplicaStep`s of one execution."""
    for callback in callbacks:
        callback._kd_feed(batch, steps)


def add_replica_logs(callbacks, logs):
    """Adds every `ReplicaCallback`'s `replica_logs()` to `logs` (in place)."""
    for callback in callbacks:
        logs.update(callback.replica_logs())
    return logs


def end_after_error(callbacks):
    """Calls `end_after_error()` on each callback that has one (keras_dist's
    `BackupAndRestore`: its signal handlers, writer and lock), for a `fit`
    an exception ended: Keras calls no `on_train_end` then. Every one is
    called even if one raises; the first error is raised after."""
    items = getattr(callbacks, "callbacks", callbacks) or []
    first = None
    for callback in items:
        end = getattr(callback, "end_after_error", None)
        if end is None:
            continue
        try:
            end()
        except BaseException as error:  # noqa: BLE001 (the others still end)
            first = first or error
    if first is not None:
        raise first
