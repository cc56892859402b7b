"""`StragglerDetector`: which worker (or replica) is slow, and by how much."""

import collections
import logging

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
    >>> detector.on_replica_steps(0, [ReplicaStep("worker0", 2, 0.02),
    ...                               ReplicaStep("worker1", 2, 0.08)])
    >>> try:
    ...     detector.on_train_batch_end(0, {})
    ... except kd.callbacks.StragglerError as error:
    ...     print(str(error)[:35])
    worker1 is a straggler at batch 0: 
    """


class StragglerDetector(ReplicaCallback):
    """Flags workers (or replicas) whose steps are much slower than the fastest's.

    For each worker it keeps the compute time of its last `window` steps and
    their median. Its score is the fastest worker's median divided by its
    own (the rule of NVIDIA's resiliency extension): 1.0 for the fastest,
    0.33 for a worker three times slower. A worker whose score falls below
    `threshold` is a straggler until its score is back at `recovery` or
    above (the gap keeps a worker near the threshold from flapping); when
    that changes (flagged, or recovered), `action` runs.

    Where the times come from: in asynchronous training, the time each
    worker spent on its steps; in synchronous training under
    `keras_dist.fit`, each replica's time from batch to gradients, measured
    *before* the all-reduce (after it every replica waits for the slowest,
    which would hide the straggler). With one replica (Keras' own loop)
    there is nobody to compare with and nothing is flagged.

    The epoch logs get `straggler_score/<worker>` for every scored worker,
    so `History`, `CSVLogger` and `TensorBoard` record them. Under
    `MultiWorkerMirroredStrategy` every worker sees the same numbers and
    makes the same decision (so `"raise"` stops them all at the same step);
    only the chief logs.

    Args:
        window: Integer >= 2. Steps per worker in the rolling median. A
            worker is scored once it has `min_steps` steps.
        threshold: Float in (0, 1). Scores below it are flagged.
        action: `"warn"` (one log line on the chief per change of state),
            `"raise"` (a `StragglerError` stops training when a straggler
            appears), or a callable `action(worker, score, logs)` called on
            every change of state (`score < threshold`: newly flagged;
            otherwise recovered). `logs` are the batch logs.
        min_steps: Integer in [2, window]: steps a worker needs before it is
            scored. Defaults to `window`.
        recovery: Float in (threshold, 1]: score at which a flagged worker
            counts as recovered. Defaults to `(1 + threshold) / 2`.
        min_gap: Float >= 0, seconds. A worker is flagged only if its median
            is also at least this much above the fastest one's: sub-
            millisecond steps jitter by large ratios that cost nothing.

    Attributes:
        scores: Dict `worker -> score` (latest).
        stragglers: Set of the workers flagged now.
        events: List of `(batch, worker, score, "flagged" | "recovered")`.

    Example:

    >>> import keras_dist as kd
    >>> from keras_dist.callbacks import ReplicaStep
    >>> detector = kd.callbacks.StragglerDetector(window=4, action=lambda *a: None)
    >>> for batch in range(4):
    ...     detector.on_replica_steps(batch, [
    ...         ReplicaStep("worker0", steps=1, seconds=0.010),
    ...         ReplicaStep("worker1", steps=1, seconds=0.030)])
    >>> round(detector.scores["worker1"], 2), detector.stragglers
    (0.33, {'worker1'})
    """

    def __init__(self, window=50, threshold=0.75, action="warn", min_steps=None,
                 recovery=None, min_gap=0.001):
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(
                f"StragglerDetector: `window` must be an integer >= 2 (steps in "
                f"the rolling median). Received: window={window!r}.")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not 0.0 < threshold < 1.0:
            raise ValueError(
                "StragglerDetector: `threshold` must be a number strictly between "
                "0 and 1 (a worker is flagged when fastest median / its median "
                f"falls below it; 0.75 is the default). Received: threshold={threshold!r}.")
        if not (callable(action) or action in ("warn", "raise")):
            raise ValueError(
                "StragglerDetector: `action` must be 'warn', 'raise' or a callable "
                f"action(worker, score, logs). Received: action={action!r}.")
        min_steps = window if min_steps is None else min_steps
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) \
                or not 2 <= min_steps <= window:
            raise ValueError(
                f"StragglerDetector: `min_steps` must be an integer in [2, window={window}]. "
                f"Received: min_steps={min_steps!r}.")
        recovery = (1.0 + threshold) / 2.0 if recovery is None else recovery
        if isinstance(recovery, bool) or not isinstance(recovery, (int, float)) \
                or not threshold < recovery <= 1.0:
            raise ValueError(
                f"StragglerDetector: `recovery` must be a number in (threshold={threshold!r}, "
                f"1]. Received: recovery={recovery!r}.")
        self.recovery = float(recovery)
        if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)) \
                or not min_gap >= 0:
            raise ValueError(
                "StragglerDetector: `min_gap` must be a number of seconds >= 0. "
                f"Received: min_gap={min_gap!r}.")
        self.min_gap = float(min_gap)
        self.window, self.threshold, self.action = window, float(threshold), action
        self.min_steps = min_steps
        self._times = collections.defaultdict(lambda: collections.deque(maxlen=window))
        self.scores, self.stragglers, self.events = {}, set(), []
        self._pending = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._times.clear()
        self.scores, self.stragglers, self.events = {}, set(), []

    def medians(self):
        """Dict `worker -> median step seconds` of the workers scored so far."""
        return {worker: float(np.median(times)) for worker, times in self._times.items()
                if len(times) >= self.min_steps}

    def on_replica_steps(self, batch, steps):
        for step in steps:
            if step.steps > 0:
                self._times[step.replica].extend([step.seconds / step.steps] * step.steps)
        medians = self.medians()
        if len(medians) < 2:
            return
        fastest = min(medians.values())
        self.scores = {worker: (fastest / median if median > 0 else 1.0)
                       for worker, median in sorted(medians.items())}
        for worker, score in self.scores.items():
            was_flagged = worker in self.stragglers
            flagged = (score < (self.recovery if was_flagged else self.threshold)
                       and medians[worker] - fastest >= self.min_gap)
            if flagged == was_flagged:
                continue
            if flagged:
                self.stragglers.add(worker)
            else:
                self.stragglers.discard(worker)
            event = (batch, worker, score, "flagged" if flagged else "recovered")
            self.events.append(event)
            self._pending.append((event, medians, fastest))

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        pending, self._pending = self._pending, []
        for (batch_index, worker, score, what), medians, fastest in pending:
            self._act(batch_index, worker, score, what, medians, fastest, logs or {})

    def _act(self, batch, worker, score, what, medians, fastest, logs):
        fastest_worker = min(medians, key=medians.get)
        detail = (f"median step {medians[worker] * 1e3:.1f} ms vs {fastest * 1e3:.1f} ms "
                  f"on {fastest_worker} (last {self.window} steps each), score "
                  f"{score:.2f}")
        if callable(self.action):
            self.action(worker, score, logs)
        elif what == "flagged" and self.action == "raise":
            raise StragglerError(
                f"{worker} is a straggler at batch {batch}: {detail} < threshold "
                f"{self.threshold:g}. (StragglerDetector(action='raise'); use "
                "action='warn' to keep training.)")
        elif self.action == "warn" and self.is_chief:
            if what == "flagged":
                logger.warning("%s is a straggler: %s < threshold %g.", worker, detail,
                               self.threshold)
            else:
                logger.warning("%s is no longer a straggler: %s.", worker, detail)

    def replica_logs(self):
        return {f"straggler_score/{worker}": score for worker, score in self.scores.items()}
