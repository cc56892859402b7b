"""`StragglerDetector`: which worker (or replica) is slow, and by how much."""

import collections
import logging
import math
import time

import numpy as np

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.callbacks.base import ReplicaCallback

logger = logging.getLogger("keras_dist")


class StragglerError(RuntimeError):
    """Raised by `StragglerDetector(action="raise")` when a straggler appears.

    Example:

    >>> import keras_dist as kd
    >>> from keras_dist.callbacks import ReplicaStep
    >>> detector = kd.callbacks.StragglerDetector(window=2, action="raise")
    >>> detector.on_epoch_begin(0)
    >>> for batch in (1, 3):  # an epoch's first execution is not judged
    ...     detector.on_replica_steps(batch, [ReplicaStep("worker0", 2, 0.02, waited=0.06),
    ...                                       ReplicaStep("worker1", 2, 0.08, waited=0.0)])
    >>> try:
    ...     detector.on_train_batch_end(3, {})
    ... except kd.callbacks.StragglerError as error:
    ...     print(str(error)[:35])
    worker1 is a straggler at batch 3: 
    """


def _check(name, value, types, valid, rule):
    """Refuses the argument `name` unless `value` is of `types` (a bool is
    not a number here) and `valid(value)`; `rule` says what it must be."""
    if isinstance(value, bool) or not isinstance(value, types) or not valid(value):
        raise ValueError(
            f"StragglerDetector: `{name}` must be {rule}. Received: {name}={value!r}.")


class StragglerDetector(ReplicaCallback):
    """Flags the workers (or replicas) that cost the job a share of its time.

    A worker is a straggler when it costs the job more than `threshold` of
    its wall time (20% by default), over the last `window` steps (100). How that cost is measured depends on the training:

    - **Synchronous** (`MirroredStrategy`, `MultiWorkerMirroredStrategy`
      under `keras_dist.fit`): every replica reads, on its own clock, how
      long it waited at the gradient all-reduce for the others to arrive.
      The replica that arrives last waits the least, so the time the others
      waited *for it* is the median of the others' waits minus its own.
      That catches whatever makes a replica late: a slow computation, a
      pause before the all-reduce, a busy host loop. A worker stopped or
      starved *inside* a collective makes everybody wait alike there, so
      each worker's process also counts the time it could not run
      (`keras_dist.training.stall`: a thread that wakes much later than it asked);
      its excess over the others' is time the job lost to it. The cost is
      the larger of the two, summed over the window, divided by the window's
      wall time. Only intervals on one clock are compared, so clock
      differences between hosts cannot raise a flag.
    - **Asynchronous** (parameter servers): nobody waits for a slow worker;
      it does fewer of the updates. Each worker's throughput is its steps
      in the window per wall second (the chief's clock). The job loses
      `1 - throughput / reference` of that worker's share of the cluster,
      where the reference is the median throughput of the other workers;
      its cost is that loss divided by the number of workers. A worker that
      is paused, gets its work late or stops reporting does fewer steps,
      whatever its computation time.

    A flagged worker stays flagged until its cost falls below `recovery`
    (half the threshold by default), so a worker near the threshold does not
    flap; every change of state runs `action`. Equal workers on a busy
    machine trade small costs back and forth, which mostly cancel over a
    window: with 20-30% step-to-step jitter and every worker now and then a
    whole step late, their net costs stay under 15% over 100-step windows,
    hence the default threshold of 20% (a worker stopped half the time costs
    about 50%). On a quiet cluster, 0.1 with a longer window catches
    milder stragglers. `min_gap` also ignores costs under a millisecond per
    step.

    To explain *why* a worker is late, the detector keeps each worker's
    compute time per step (batch to gradients): `scores` holds the fastest
    worker's median compute time divided by each worker's (1.0 for the
    fastest, 0.33 for a computation three times slower). A straggler with a
    normal score is late for another reason: paused, descheduled, or its
    host busy between steps.

    The epoch logs get `straggler_cost/<worker>` and
    `straggler_score/<worker>` for every worker scored, so `History`,
    `CSVLogger` and `TensorBoard` record them. Under
    `MultiWorkerMirroredStrategy` every worker sees the same numbers and
    takes the same decision (so `"raise"` stops them all at the same step);
    only the chief logs. With one replica (Keras' own loop) there is nobody
    to wait for and nothing is flagged.

    Args:
        window: Integer >= 2. Steps in the rolling window (asynchronous:
            steps per worker, `window x workers` in all). Defaults to 100.
        threshold: Float in (0, 1). Share of the job's time a worker must
            cost to be flagged. Defaults to `0.2`.
        action: `"warn"` (one log line on the chief per change of state),
            `"raise"` (a `StragglerError` stops training when a straggler
            appears), or a callable `action(worker, cost, logs)` called on
            every change of state (`worker in detector.stragglers`: newly
            flagged; otherwise recovered). `logs` are the batch logs.
        min_steps: Integer in [2, window]: steps the window needs (per
            worker, asynchronous) before anybody is judged. Defaults to
            `window`.
        recovery: Float in [0, threshold): cost under which a flagged worker
            counts as recovered. Defaults to `threshold / 2`.
        min_gap: Float >= 0, seconds. A worker is flagged only if it also
            costs at least this much per step (synchronous: what the others
            wait for it; asynchronous: how much longer its steps take than
            the reference's). Defaults to 1 ms.

    Attributes:
        costs: Dict `worker -> cost` (latest; share of the wall time).
        scores: Dict `worker -> compute score` (latest; 1.0 for the fastest).
        stragglers: Set of the workers flagged now.
        events: List of `(batch, worker, cost, "flagged" | "recovered")`.

    Example:

    Synchronous replicas: replica 1 arrives 20 ms late at every all-reduce,
    so replica 0 waits 20 ms a step for it.

    >>> import time
    >>> import keras_dist as kd
    >>> from keras_dist.callbacks import ReplicaStep
    >>> detector = kd.callbacks.StragglerDetector(window=4, action=lambda *a: None)
    >>> detector.on_epoch_begin(0)
    >>> for batch in range(5):  # an epoch's first execution is not judged
    ...     time.sleep(0.04)   # the step's wall time
    ...     detector.on_replica_steps(batch, [
    ...         ReplicaStep("replica0", steps=1, seconds=0.010, waited=0.021),
    ...         ReplicaStep("replica1", steps=1, seconds=0.030, waited=0.001)])
    >>> detector.stragglers, round(detector.scores["replica1"], 2)
    ({'replica1'}, 0.33)
    >>> 0.3 < detector.costs["replica1"] <= 0.5   # 20 ms of each ~40 ms step
    True
    """

    def __init__(self, window=100, threshold=0.2, action="warn", min_steps=None,
                 recovery=None, min_gap=0.001):
        super().__init__()
        _check("window", window, int, lambda v: v >= 2,
               "an integer >= 2 (steps in the rolling window)")
        _check("threshold", threshold, (int, float), lambda v: 0.0 < v < 1.0,
               "a number strictly between 0 and 1: the share of the job's time a worker "
               "must cost to be flagged (0.2 is the default)")
        if not (callable(action) or action in ("warn", "raise")):
            raise ValueError(
                "StragglerDetector: `action` must be 'warn', 'raise' or a callable "
                f"action(worker, cost, logs). Received: action={action!r}.")
        min_steps = window if min_steps is None else min_steps
        _check("min_steps", min_steps, int, lambda v: 2 <= v <= window,
               f"an integer in [2, window={window}]")
        recovery = threshold / 2.0 if recovery is None else recovery
        _check("recovery", recovery, (int, float), lambda v: 0.0 <= v < threshold,
               f"a number in [0, threshold={threshold!r})")
        _check("min_gap", min_gap, (int, float), lambda v: v >= 0,
               "a number of seconds >= 0")
        self.window, self.threshold, self.action = window, float(threshold), action
        self.min_steps, self.recovery, self.min_gap = min_steps, float(recovery), float(min_gap)
        self._clock = time.perf_counter  # the wall clock of this process
        self._reset()

    def _reset(self):
        self._compute = collections.defaultdict(
            lambda: collections.deque(maxlen=self.window))
        # Executions in the window: (steps, wall seconds, {worker: (steps, waited)}).
        self._executions = collections.deque()
        self._workers = set()
        self._mark = None
        self._epoch_start = False  # the next synchronous execution opens an epoch
        self.costs, self.scores, self.stragglers, self.events = {}, {}, set(), []
        self._pending = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._reset()

    def on_epoch_begin(self, epoch, logs=None):
        # Time between epochs (evaluation, checkpoints) is nobody's straggling.
        self._mark = self._clock()
        self._epoch_start = True

    def medians(self):
        """Dict `worker -> median compute seconds per step` of the workers
        with `min_steps` steps."""
        return {worker: float(np.median(times)) for worker, times in self._compute.items()
                if len(times) >= self.min_steps}

    # ------------------------------------------------------------ measuring
    def on_replica_steps(self, batch, steps):
        now = self._clock()
        wall = 0.0 if self._mark is None else now - self._mark
        self._mark = now
        if not steps or (len(steps) > 1 and not all(np.isfinite(s.waited) for s in steps)):
            return  # nothing, or an execution that was traced: no timing to judge by
        if len(steps) > 1 and self._epoch_start:
            # The first all-reduce of an epoch is where the replicas meet
            # again after the epoch's end, which the chief spends longer in
            # (its callbacks: TensorBoard, tables): the others' wait there
            # is between-epoch work, not straggling. (With one input
            # iterator for every epoch the others arrive at once and wait.)
            self._epoch_start = False
            return
        self._epoch_start = False
        for step in steps:
            self._workers.add(step.replica)
            if step.steps > 0:
                self._compute[step.replica].extend([step.seconds / step.steps] * step.steps)
        medians = self.medians()
        if len(medians) > 1:
            fastest = min(medians.values())
            self.scores = {w: (fastest / m if m > 0 else 1.0) for w, m in sorted(medians.items())}
        synchronous = len(steps) > 1
        self._executions.append((max(s.steps for s in steps) if synchronous
                                 else sum(s.steps for s in steps), wall,
                                 {s.replica: (s.steps, s.waited, s.stalled) for s in steps}))
        limit = self.window * (1 if synchronous else max(1, len(self._workers)))
        while sum(e[0] for e in self._executions) - self._executions[0][0] >= limit:
            self._executions.popleft()
        if len(self._workers) < 2:
            return
        costs = self._sync_costs() if synchronous else self._async_costs()
        if costs is None:
            return
        self.costs = {worker: cost for worker, (cost, _) in sorted(costs.items())}
        for worker, (cost, gap) in sorted(costs.items()):
            was_flagged = worker in self.stragglers
            flagged = (cost >= self.recovery if was_flagged else
                       cost >= self.threshold and gap >= self.min_gap)
            if flagged == was_flagged:
                continue
            if flagged:
                self.stragglers.add(worker)
            else:
                self.stragglers.discard(worker)
            event = (batch, worker, cost, "flagged" if flagged else "recovered")
            self.events.append(event)
            self._pending.append((event, gap, dict(self.scores)))

    def _sync_costs(self):
        """`{replica: (share of the wall time the others waited for it,
        seconds per step)}` over the window; `None` before `min_steps`."""
        steps = sum(e[0] for e in self._executions)
        wall = sum(e[1] for e in self._executions)
        if steps < self.min_steps or wall <= 0:
            return None
        workers = sorted({w for e in self._executions for w in e[2]})
        # [execution, replica]: its wait at the all-reduce, and the time its
        # process stalled (0 if it was absent or the value unknown).
        waited, stalled = (
            np.nan_to_num(np.array([[e[2].get(w, (0, 0.0, 0.0))[i] for w in workers]
                                    for e in self._executions]))
            for i in (1, 2))
        # A process stopped while it waited at the all-reduce (arrived
        # first, then paused) reads the pause on its own clock as waiting:
        # time its process could not run is not time it waited for others.
        waited = np.maximum(0.0, waited - stalled)
        costs = {}
        for r, worker in enumerate(workers):
            # Late at the all-reduce: the others waited for it there.
            late = np.median(np.delete(waited, r, axis=1), axis=1) - waited[:, r]
            # Stopped or starved anywhere (inside a collective too, where
            # everybody waits alike): the job could not go on without it.
            stopped = stalled[:, r] - np.median(np.delete(stalled, r, axis=1), axis=1)
            lost = max(0.0, float(late.sum()), float(stopped.sum()))
            costs[worker] = (min(1.0, lost / wall), lost / steps)
        return costs

    def _async_costs(self):
        """`{worker: (share of the cluster's throughput lost to it, extra
        seconds per step)}` over the window; `None` before every worker has
        had `min_steps` steps' worth of it."""
        workers = sorted(self._workers)
        total = sum(e[0] for e in self._executions)
        wall = sum(e[1] for e in self._executions)
        if total < self.min_steps * len(workers) or wall <= 0:
            return None
        done = collections.Counter()
        for _, _, per_worker in self._executions:
            for worker, (count, _, _) in per_worker.items():
                done[worker] += count
        rate = {w: done[w] / wall for w in workers}
        costs = {}
        for worker in workers:
            reference = float(np.median([rate[w] for w in workers if w != worker]))
            if reference <= 0:
                costs[worker] = (0.0, 0.0)
                continue
            lost = max(0.0, 1.0 - rate[worker] / reference)
            gap = math.inf if rate[worker] == 0 else max(
                0.0, 1.0 / rate[worker] - 1.0 / reference)
            costs[worker] = (lost / len(workers), gap)
        return costs

    # ------------------------------------------------------------- deciding
    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        pending, self._pending = self._pending, []
        for (batch_index, worker, cost, what), gap, scores in pending:
            self._act(batch_index, worker, cost, what, gap, scores, logs or {})

    def _act(self, batch, worker, cost, what, gap, scores, logs):
        detail = f"it costs {cost:.0%} of the job's time"
        if gap > 0 and math.isfinite(gap):
            detail += f" ({gap * 1e3:.1f} ms per step)"
        if worker in scores:
            score = scores[worker]
            detail += (f"; its computation takes {1 / score:.1f}x the fastest's"
                       if score < 0.8 else "; its computation is not slower "
                       "(late for another reason: paused, descheduled or busy between steps)")
        detail += f", last {self.window} steps"
        if callable(self.action):
            self.action(worker, cost, logs)
        elif what == "flagged" and self.action == "raise":
            raise StragglerError(
                f"{worker} is a straggler at batch {batch}: {detail} (threshold "
                f"{self.threshold:.0%}). (StragglerDetector(action='raise'); use "
                "action='warn' to keep training.)")
        elif self.action == "warn" and self.is_chief:
            if what == "flagged":
                logger.warning("%s is a straggler: %s (threshold %.0f%%).", worker, detail,
                               self.threshold * 100)
            else:
                logger.warning("%s is no longer a straggler: it costs %.0f%% of the job's "
                               "time.", worker, cost * 100)

    def replica_logs(self):
        logs = {f"straggler_cost/{worker}": cost for worker, cost in self.costs.items()}
        logs.update({f"straggler_score/{worker}": score
                     for worker, score in self.scores.items()})
        return logs

