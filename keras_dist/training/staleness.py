"""Staleness bookkeeping for asynchronous training.

A parameter version counter lives on the parameter servers. Every step reads
it before its forward pass and increments it once its update is applied, so

    staleness (tau) = version just before this step's increment
                      - version this step read

is the number of updates other workers applied between this step reading the
weights and writing its own. With N equally fast workers its mean approaches
N - 1. Each step also reports which worker ran it and how long it took.

The counter is updated with an atomic `assign_add` on the parameter server,
so no two steps can claim the same version (dist-keras read its clock outside
its lock; this does not).
"""

import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


def fetch_add(variable):
    """Adds one to an integer variable and returns its value before, atomically.

    `Variable.assign_add(..., read_value=True)` is an add followed by a
    separate read: two workers adding at once can both read the sum of both
    adds (and one value is never seen). TF's `CountUpTo` holds the
    variable's lock from its read to its write. Runs where the variable is.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training.staleness import fetch_add
    >>> v = tf.Variable(tf.constant(5, tf.int64))
    >>> int(fetch_add(v)), int(v.numpy())
    (5, 6)
    """
    with tf.device(variable.device):
        return tf.raw_ops.ResourceCountUpTo(resource=variable.handle,
                                            limit=variable.dtype.max, T=variable.dtype)


class VersionCounter:
    """An int64 parameter version on the parameter servers.

    Create it inside the `ParameterServerStrategy` scope; its variable is then
    placed on a parameter server and shared by every worker.

    Example:

    >>> from keras_dist.training.staleness import VersionCounter
    >>> counter = VersionCounter()
    >>> read = counter.read()
    >>> int(counter.increment() - 1 - read)   # nobody else updated: tau = 0
    0
    """

    def __init__(self, name="keras_dist_version"):
        self.variable = tf.Variable(
            0, dtype=tf.int64, trainable=False, name=name,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def read(self):
        """The current version (a scalar int64 tensor)."""
        return self.variable.read_value()

    def increment(self, one=1):
        """Atomically adds one; returns the new version.

        `one` may be a tensor (equal to 1) computed where the claim should
        wait: the increment waits for it.
        """
        deps = [one] if tf.is_tensor(one) else []
        with tf.control_dependencies(deps):
            return fetch_add(self.variable) + 1

    def claim(self, read, one=1):
        """Claims the next version; returns tau, the claims since `read`.

        `read` is this step's earlier `read()`. The subtraction runs where
        the counter lives, so only tau travels back (not the read and the
        new version). `one`: see `increment`.
        """
        new = self.increment(one)
        with tf.device(self.variable.device):
            return new - 1 - read

    @property
    def value(self):
        """The current version as a Python int (reads the parameter server)."""
        return int(self.variable.numpy())


@dataclasses.dataclass
class StepRecord:
    """What one scheduled execution reported.

    Attributes:
        worker: Integer. Index of the worker that ran it.
        staleness: List of integers, one tau per step in the execution.
        seconds: Float. Wall time the worker spent on the execution.
        claimed: Float. Seconds from the execution's start to its last
            update's version claim: the window in which other workers'
            updates make it stale (NaN when unknown).
        pull, compute, push: Floats. For rounds of local steps, the seconds
            spent pulling, stepping on the worker's copy and pushing, summed
            over the execution's rounds (NaN otherwise).
    """

    worker: int
    staleness: List[int]
    seconds: float
    claimed: float = float("nan")
    pull: float = float("nan")
    compute: float = float("nan")
    push: float = float("nan")


class StalenessStats:
    """Accumulates `StepRecord`s over an epoch and summarizes them for logs.

    Example:

    >>> from keras_dist.training.staleness import StalenessStats, StepRecord
    >>> stats = StalenessStats()
    >>> stats.add(StepRecord(worker=0, staleness=[0, 1], seconds=0.02))
    >>> stats.add(StepRecord(worker=1, staleness=[1], seconds=0.01))
    >>> stats.logs()["staleness_mean"], stats.logs()["staleness_max"]
    (0.6666666666666666, 1)
    >>> stats.updates_per_worker()
    {0: 2, 1: 1}
    """

    def __init__(self):
        self.records: List[StepRecord] = []
        self.lost_results = 0
        """Executions whose result was lost with an unreachable worker (their
        updates were applied; their records are missing)."""

    def add(self, record):
        self.records.append(record)

    def reset(self):
        self.records = []
        self.lost_results = 0

    @property
    def steps(self):
        """Integer. Updates recorded so far."""
        return sum(len(r.staleness) for r in self.records)

    def updates_per_worker(self) -> Dict[int, int]:
        counts: Dict[int, int] = {}
        for record in self.records:
            counts[record.worker] = counts.get(record.worker, 0) + len(record.staleness)
        return dict(sorted(counts.items()))

    def logs(self):
        """`staleness_mean` and `staleness_max` for the epoch logs."""
        taus = [t for r in self.records for t in r.staleness]
        if not taus:
            return {}
        return {"staleness_mean": float(np.mean(taus)), "staleness_max": int(max(taus))}


def record_synchronous(model):
    """After a synchronous `fit` (one device, Mirrored, MultiWorkerMirrored):
    `model.staleness_stats` holds one record (worker 0) with a staleness of 0
    for each update of that `fit` call (every update is applied everywhere
    before the next step reads the weights); and a model without
    its own `version` (not an `AsyncModel`) gets `model.version`, the
    optimizer's `iterations`. What a parameter-server run gives there, so
    a script reads them in every cluster shape.

    Example:

    >>> import numpy as np, keras
    >>> from keras_dist.training import staleness
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0)
    >>> staleness.record_synchronous(model)
    >>> model.version, model.staleness_stats.logs()
    (2, {'staleness_mean': 0.0, 'staleness_max': 0})
    """
    iterations = int(model.optimizer.iterations.numpy()) if model.optimizer is not None else 0
    before = model.__dict__.get("_kd_iterations_recorded", 0)
    stats = StalenessStats()
    updates = max(0, iterations - before)
    if updates:
        stats.add(StepRecord(worker=0, staleness=[0] * updates, seconds=float("nan")))
    model.__dict__["_kd_iterations_recorded"] = iterations
    model.__dict__["staleness_stats"] = stats
    if not isinstance(getattr(type(model), "version", None), property):
        model.__dict__["version"] = iterations

