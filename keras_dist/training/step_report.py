"""What one execution of train steps reports: one schema, packed and unpacked here.

Both executors measure, on the replica or worker that ran an execution of
`steps_per_execution` train steps, the same fields, and send them back as
one float64 vector (one tensor: a single copy to the chief):

    [state..., logs..., worker, seconds, examples, loss_sum, loss_count, skipped,
     waited, stalled, claimed, pull, compute, push, tau_1 ... tau_k]

`logs` are the execution's metric results (asynchronous training only; the
synchronous executor reduces its logs the Keras way). `loss_sum` and
`loss_count` are this execution's additions to Keras' loss tracker (the
"loss" metric), so the execution's mean loss is their ratio. The taus are
the staleness of each update (asynchronous only; none in synchronous
training). `waited` is the time a synchronous replica spent at the
all-reduce waiting for the others, and `stalled` the time its process
could not run (`keras_dist.training.stall`); both NaN in asynchronous training.
`claimed` is the time from the execution's start to its last update's
claim of a version (asynchronous only): the window in which other updates
make it stale. `pull`, `compute` and `push` split a round of local steps
(summed over an execution's rounds): from the round's start until the
pulled weights are on the worker, the steps on its copy, and from there
until the push's writes are done (NaN for executions of plain steps).
"""

import dataclasses
import math
import time
from typing import Dict, Sequence, Tuple

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import staleness

FIELDS = ("worker", "seconds", "examples", "loss_sum", "loss_count", "skipped", "waited",
          "stalled", "claimed", "pull", "compute", "push")


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One execution's report, as the chief reads it.

    Attributes:
        worker: Integer. Worker index (asynchronous) or replica index
            (synchronous, `replica_id_in_sync_group`).
        seconds: Float. Wall time of the execution on that worker.
        examples: Integer or `None` when unknown.
        loss: Float. Mean loss of the execution's examples (NaN if unknown).
        staleness: Tuple of integers, one tau per update (empty when synchronous).
        skipped: Integer. Updates the execution skipped as non-finite, where
            it counts them itself (asynchronous, gated updates).
        logs: Dict of the execution's metric results (asynchronous only).
        state: Float64 array. What the execution added to the metrics'
            variables, flattened (asynchronous only; empty otherwise).
        waited: Float. Seconds this replica waited at the gradient
            all-reduce for the others to arrive, summed over the execution's
            steps (synchronous only; NaN otherwise).
        stalled: Float. Seconds this replica's process could not run since
            the previous execution (synchronous only; NaN otherwise).
        claimed: Float. Seconds from the execution's start to its last
            update's version claim (asynchronous only; NaN otherwise).
        pull, compute, push: Floats. Seconds a round of local steps spent
            pulling, stepping on the worker's copy and pushing, summed over
            the execution's rounds (NaN for executions of plain steps).
    """

    worker: int
    seconds: float
    examples: object
    loss: float
    staleness: Tuple[int, ...] = ()
    skipped: int = 0
    logs: Dict[str, float] = dataclasses.field(default_factory=dict)
    state: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    waited: float = math.nan
    stalled: float = math.nan
    claimed: float = math.nan
    pull: float = math.nan
    compute: float = math.nan
    push: float = math.nan


def start_clock(batches):
    """`(start, batches)`: the execution's start time, taken once its first
    batch is there, and `batches` with the first one read after it (in a
    traced function on the worker).

    The edge is local to the worker (no transfer). Without it TF may take the
    timestamp after the step's gradients (nothing else depends on it), and
    an execution's `seconds` came out as 0 (seen on TF 2.16).
    """
    batches = list(batches)
    with tf.control_dependencies([t for t in tf.nest.flatten(batches[0]) if t is not None]):
        start = tf.timestamp()
    with tf.control_dependencies([start]):
        batches[0] = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t),
                                           batches[0])
    return start, batches


def pack(worker, seconds, examples, loss_sum, loss_count, taus=(), logs=None, names=(),
         state=(), skipped=0, waited=math.nan, stalled=math.nan, claimed=math.nan,
         phases=(math.nan, math.nan, math.nan)):
    """The float64 vector of one execution (in a traced function).

    Args:
        worker, seconds, examples, loss_sum, loss_count: Scalar tensors.
        taus: Sequence of scalar tensors, one per update.
        logs: Dict of scalar tensors, packed in the order of `names`.
        names: Sequence of the `logs` keys to pack.
        state: Sequence of tensors of any shape, flattened in front.
        skipped: Scalar tensor (or 0): updates skipped as non-finite.
        waited: Scalar tensor (or NaN): seconds waited at the all-reduce.
        stalled: Scalar tensor (or NaN): seconds the process could not run.
        claimed: Scalar tensor (or NaN): seconds to the last version claim.
        phases: `(pull, compute, push)` scalar tensors (or NaN): a local
            round's phases.
    """
    head = [tf.cast(tf.reshape(t, [-1]), tf.float64) for t in state]
    head += [tf.reshape(tf.cast(logs[n], tf.float64), [1]) for n in names]
    fields = [tf.cast(v, tf.float64)
              for v in (worker, seconds, examples, loss_sum, loss_count, skipped, waited,
                        stalled, claimed, *phases)]
    tail = [tf.cast(t, tf.float64) for t in taus]
    return tf.concat(head + [tf.stack(fields + tail)], axis=0)


def unpack(vector, names: Sequence[str] = (), state_size: int = 0) -> StepReport:
    """The `StepReport` of one packed vector (a tensor or array)."""
    values = vector.numpy() if hasattr(vector, "numpy") else np.asarray(vector)
    state, values = values[:state_size], values[state_size:]
    n = len(names)
    worker, seconds, examples, loss_sum, loss_count, skipped, waited, stalled, claimed, \
        pull, compute, push = values[n:n + len(FIELDS)]
    taus = tuple(int(t) for t in values[n + len(FIELDS):])
    return StepReport(
        worker=int(worker), seconds=float(seconds),
        examples=None if np.isnan(examples) else int(examples),
        loss=float(loss_sum / loss_count) if loss_count > 0 else math.nan,
        staleness=taus, skipped=int(skipped), waited=float(waited),
        stalled=float(stalled), claimed=float(claimed), pull=float(pull),
        compute=float(compute), push=float(push),
        logs={name: float(v) for name, v in zip(names, values[:n])},
        state=state)


def loss_tracker(model):
    """The `(total, count)` variables of Keras' loss tracker (the "loss"
    metric), or `None` when the model has none."""
    for metric in model.metrics:
        if metric.name == "loss":
            values = {v.name: v for v in metric.variables}
            if "total" in values and "count" in values:
                return values["total"], values["count"]
    return None


def loss_state(model):
    """This replica's loss tracker state `(total, count)` as float64 tensors
    (NaN when the model has no Keras loss tracker)."""
    tracker = loss_tracker(model)
    if tracker is None:
        nan = tf.constant(np.nan, tf.float64)
        return nan, nan
    return tuple(tf.cast(v.value, tf.float64) for v in tracker)


def batch_examples(data):
    """Examples in one batch `(x, y, sample_weight)`: float64 (NaN if unknown)."""
    import keras

    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    first = next((t for t in tf.nest.flatten(x) if t is not None), None)
    if first is None:
        return tf.constant(np.nan, tf.float64)
    return tf.cast(tf.shape(first)[0], tf.float64)


HOLE_WAIT = 2.0
"""Seconds a claimed report slot may stay unwritten behind a written later
one before the chief counts it lost (`ReportRing.take`)."""


class ReportRing:
    """Execution reports collected on a parameter server, read in batches.

    Under parameter servers a function's result stays on its worker until
    the chief copies it: returning a report costs the worker a result to
    keep and the chief a copy per execution, about a third of a small
    model's update rate (`benchmarks/ps_throughput.py`). Instead each
    execution writes its report as one row of a ring on a parameter server
    (the slot claimed there by an atomic `staleness.fetch_add`), and the chief reads the
    whole ring now and then: one read for many executions.

    A row is `[slot + 1, k, skipped, n, report (n values), 0...]`. The
    report may be finished on the parameter server: `write` appends the
    taus and sums the skips that were computed there (they never travel to
    the worker). The first column tells the chief whether the row holds
    the slot it expects, so rows are taken in slot order (the order the
    executions finished) and never twice.

    Create it in the `ParameterServerStrategy` scope, colocated with
    another variable (`strategy.extended.colocate_vars_with`) so that a
    `variable_partitioner` leaves it whole. A report without room
    (`fits`) is returned by its execution as a result instead.

    Args:
        width: Columns per row (the four header columns included).
        capacity: Rows. The chief must read before `capacity` executions
            finish past the oldest one it has not taken.
        clock: Function returning seconds (monotonic), for the wait on a
            hole (`HOLE_WAIT`). Defaults to `time.monotonic`.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training.step_report import ReportRing
    >>> ring = ReportRing(width=8, capacity=4)
    >>> ring.write(tf.constant([1.0, 2.0], tf.float64), 1, taus=[tf.constant(3)])
    >>> [(k, skipped, report.tolist()) for k, skipped, report in ring.take()]
    [(1, 0, [1.0, 2.0, 3.0])]
    >>> ring.take()   # nothing new
    []
    """

    HEADER = 4

    def __init__(self, width, capacity, clock=time.monotonic):
        if width <= self.HEADER or capacity < 1:
            raise ValueError(f"ReportRing needs width > {self.HEADER} and capacity >= 1; "
                             f"got width={width}, capacity={capacity}.")
        self.width, self.capacity = int(width), int(capacity)
        once = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.rows = tf.Variable(tf.zeros([self.capacity, self.width], tf.float64),
                                trainable=False, name="keras_dist_reports", aggregation=once)
        self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                 name="keras_dist_report_count", aggregation=once)
        self.next = 0  # on the chief: the oldest slot not taken yet
        self.lost = 0  # slots claimed but never written (their execution failed)
        self.clock = clock
        self._hole = None  # (slot, when first seen unwritten behind a written one)

    def fits(self, report, extra=0):
        """Whether a traced report vector, plus `extra` values appended by
        `write`, has room in a row."""
        return report.shape.rank == 1 and report.shape[0] is not None \
            and report.shape[0] + extra + self.HEADER <= self.width

    def write(self, report, k, taus=(), skipped=()):
        """Writes one execution's report of `k` steps (in a traced function),
        with `taus` (scalar tensors) appended and `skipped` (0/1 tensors)
        summed where the ring lives.

        The slot is claimed only once everything the row holds is where the
        ring lives (the report received from the worker, the taus and skips
        computed there): claim and write are then two local operations in a
        row, so a worker that stops or loses its link mid-execution leaves
        no claimed slot unwritten (a *hole*) behind it. Left unordered, TF
        would claim the slot as soon as the parameter server's part of the
        function starts, and a link cut while the gradients are on their
        way left a hole (`tests/test_multihost.py`)."""
        n = int(report.shape[0]) + len(taus)
        with tf.device(self.rows.device):
            skips = tf.add_n([tf.cast(s, tf.float64) for s in skipped]) if skipped \
                else tf.constant(0.0, tf.float64)
            payload = tf.concat([tf.cast(report, tf.float64)]
                                + [tf.reshape(tf.cast(t, tf.float64), [1]) for t in taus],
                                axis=0)
            with tf.control_dependencies([payload, skips]):
                slot = staleness.fetch_add(self.count)
            header = tf.stack([tf.cast(slot + 1, tf.float64), tf.constant(k, tf.float64),
                               skips, tf.constant(n, tf.float64)])
            row = tf.concat([header, payload,
                             tf.zeros([self.width - self.HEADER - n], tf.float64)], axis=0)
            index = tf.math.floormod(slot, self.capacity)
            self.rows.scatter_update(tf.IndexedSlices(row[tf.newaxis], index[tf.newaxis]))

    def take(self, final=False, in_flight=None, limit=None):
        """`(k, skipped, report)` of the rows written since the last `take`,
        in slot order (eager, on the chief). Stops at the first slot not
        written yet, unless it is lost: with `final` (no execution running),
        when at least `in_flight` (the most executions that can run at
        once) later slots are written, or when a later slot was already
        written `HOLE_WAIT` seconds ago (claim and write are adjacent: a
        slot claimed that long without its row never gets one; its
        execution failed between the two). Lost slots are counted in
        `lost`. With `limit`, at most that many rows."""
        rows = self.rows.numpy()
        end = int(self.count.numpy()) if final else self.next + self.capacity
        stamps = rows[:, 0].astype(np.int64)
        out = []
        slot = self.next
        while slot < end and (limit is None or len(out) < limit):
            row = rows[slot % self.capacity]
            stamp = int(row[0])
            if stamp == slot + 1:
                n = int(row[3])
                out.append((int(row[1]), int(row[2]), row[self.HEADER:self.HEADER + n]))
            elif stamp > slot + 1:
                raise RuntimeError(
                    f"keras_dist: report slot {slot} was overwritten before the chief read "
                    f"it (ring of {self.capacity} rows); this is a keras_dist bug.")
            elif final or self._hole_lost(slot, stamps, in_flight):
                self.lost += 1
            else:
                break
            slot += 1
        self.next = slot
        return out

    def _hole_lost(self, slot, stamps, in_flight):
        later = int(np.sum(stamps > slot + 1))  # slots after it written: it was claimed
        if in_flight is not None and later >= in_flight:
            return True
        if not later:
            self._hole = None  # maybe not claimed yet: nothing to judge
            return False
        now = self.clock()
        if self._hole is None or self._hole[0] != slot:
            self._hole = (slot, now)
        return now - self._hole[1] >= HOLE_WAIT
