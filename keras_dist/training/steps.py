"""`StepPlanner`: how an epoch splits into executions (Keras' `EpochIterator`).

Keras runs an epoch as executions of `steps_per_execution` steps (one
compiled call each), the last one shorter when the epoch's steps do not
divide evenly. Its callbacks see each execution at one batch index: the
execution's last batch as if it ran all of `steps_per_execution` (7 steps
at 3 per call end at batches 2, 5 and 8). keras_dist runs an input of
unknown length one step per call, so that it stops exactly at the end of
the data; the synchronous executor still shows the callbacks Keras'
executions (`SyncExecutor._steps_of_unknown_count`).

Both executors plan their epochs here:

- the synchronous one walks `executions()` in order;
- the asynchronous one asks `size(done)` each time it schedules (done:
  steps finished plus steps in flight), since executions finish out of
  order and a stuck one may be replaced.

The one reading of `steps_per_execution` is `steps_per_execution(model)`.

Example:

>>> from keras_dist.training.steps import StepPlanner
>>> planner = StepPlanner(per_call=3, total=7)
>>> [(e.begin, e.size, e.batch) for e in planner.executions()]
[(0, 3, 2), (3, 3, 5), (6, 1, 8)]
>>> [(e.begin, e.size) for e in StepPlanner(per_call=3, total=None).executions(limit=2)]
[(0, 1), (1, 1)]
"""

import dataclasses
import itertools
from typing import Optional


def steps_per_execution(model):
    """The model's `steps_per_execution` as an integer >= 1 (Keras stores it
    as an attribute of the compiled model; an uncompiled one runs 1)."""
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


@dataclasses.dataclass(frozen=True)
class Execution:
    """One compiled call: `size` steps from step `begin` of the epoch.

    Attributes:
        begin: Integer. The epoch's step the execution starts at.
        size: Integer. Steps it runs.
        batch: Integer. Keras' batch index for its callbacks.
    """

    begin: int
    size: int
    batch: int


class StepPlanner:
    """Splits an epoch of `total` steps (`None`: until the data ends) into
    executions of at most `per_call` steps, from step `start` on.

    Args:
        per_call: Integer >= 1. `steps_per_execution`, or the local steps
            of a round.
        total: Integer or `None` (unknown length: one step per execution).
        start: Integer. The step the epoch starts at (a resumed one: > 0).
    """

    def __init__(self, per_call, total, start=0):
        self.per_call = max(1, int(per_call))
        self.total = total
        self.start = int(start)

    def size(self, done):
        """Steps the next execution runs once `done` steps are finished or
        in flight (0: the epoch needs no more)."""
        if self.total is None:
            return 1  # unknown length: stop exactly at the end of the data
        return max(0, min(self.per_call, self.total - done))

    def batch(self, begin):
        """Keras' batch index of an execution starting at step `begin`: its
        last batch as if it ran all of `per_call` steps."""
        return begin + self.per_call - 1

    def executions(self, limit=None):
        """The executions in order (`limit`: at most that many; with an
        unknown length they go on until the caller stops at the end of the
        data)."""
        begin = self.start
        for _ in (range(limit) if limit is not None else itertools.count()):
            k = self.size(begin)
            if k == 0:
                return
            yield Execution(begin, k, self.batch(begin))
            begin += k

    @classmethod
    def for_model(cls, model, total, start=0, per_call: Optional[int] = None):
        """A planner with the model's `steps_per_execution` (or `per_call`)."""
        return cls(steps_per_execution(model) if per_call is None else per_call, total, start)
