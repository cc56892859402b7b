"""Executions in flight under parameter servers, counted as they finish.

TF's `ClusterCoordinator` hands scheduled closures from one shared queue to
whichever worker asks, and each worker runs one at a time. A worker that
stops (SIGSTOP, a long GC pause, a VM live migration, a frozen container)
therefore holds exactly the one execution it had started; the others go
to the workers that answer. The chief must not wait on that one either:
`InFlight` learns of every execution's end as it happens, in any order
(each execution's `RemoteValue.fetch()` waits in a thread of its own), so
the asynchronous executor refills its window from whichever execution
finished and ends an epoch once its steps have finished, whoever ran them.

An execution still running after `stuck_after()` seconds -- a multiple
(`STUCK_FACTOR`) of the median time executions take from being scheduled
to being finished, at least `STUCK_FLOOR`; `FIRST_STUCK_AFTER` until one
has finished -- is *stuck*: it stays in
flight (when it lands, its update and logs count like any other, in the
epoch it lands in: it is *late*), and the executor no longer counts on it
to finish the epoch, so it schedules a *speculative* replacement, as
MapReduce runs backup copies of its last tasks. At the end of `fit`,
executions still stuck are waited for up to `AsyncOptions.end_wait` seconds
(`keras_dist.training.plan`; 30 by default), then
reported as *lost*.

`StepCounts` keeps the books, in steps: every step scheduled ends up
either finished (its results counted) or lost, never both and never twice.
"""

import collections
import dataclasses
import queue
import threading
import time
from typing import Any

STUCK_FLOOR = 2.0
"""Seconds: no execution is judged stuck sooner than this after it was scheduled."""

FIRST_STUCK_AFTER = 20.0
"""Seconds after which an execution is judged stuck while no execution of
this `fit` has finished yet: the first ones carry each worker's set-up of
the step function, and on a loaded host they outlast `STUCK_FLOOR` (a
2-core machine running two clusters took >2 s for the first execution of
4 steps, and its speculative copy applied those steps twice)."""

STUCK_FACTOR = 8.0
"""An execution is stuck once it has been in flight this many times the
median time recent executions took from being scheduled to finishing."""

"""Seconds the end of `fit` waits for stuck executions before reporting them lost."""

_RECENT = 64  # executions the median time to finish is taken over


@dataclasses.dataclass
class StepCounts:
    """What happened to the steps of asynchronous training, in steps.

    Attributes:
        scheduled: Steps scheduled (an execution of `k` steps counts `k`),
            speculative replacements included.
        finished: Steps whose results the chief counted (late ones included).
        speculative: Steps scheduled beyond the epochs' own steps:
            replacements for stuck executions, less those made up because
            a stuck one landed in time to count towards a later epoch.
        late: Steps that finished after being judged stuck.
        lost: Steps whose results never came: still stuck when `fit`
            ended, or lost with a worker that became unreachable after its
            update was applied.

    Every step scheduled is finished or lost: `scheduled == finished + lost`
    once nothing is in flight. The parameter version counts the updates
    applied: `finished` plus whatever of `lost` was applied, plus steps TF
    ran twice (it promises at-least-once for steps it retries after a
    worker failure).

    Example:

    >>> from keras_dist.training.inflight import StepCounts
    >>> counts = StepCounts(scheduled=100, finished=99, lost=1)
    >>> counts.as_dict()["lost"]
    1
    """

    scheduled: int = 0
    finished: int = 0
    speculative: int = 0
    late: int = 0
    lost: int = 0

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False)
class Execution:
    """One scheduled closure of `steps` steps, from the chief's side."""

    steps: int
    fn: Any
    remote: Any
    started: float
    stuck: bool = False


class InFlight:
    """Scheduled executions, reported in the order they finish.

    Args:
        threads: Integer. How many fetches may wait at once: at least the
            most executions ever in flight (the window plus the stuck ones).
        clock: Function returning seconds (monotonic). Defaults to
            `time.monotonic`.

    Example:

    >>> from keras_dist.training.inflight import InFlight
    >>> class Done:  # anything with fetch(), like a TF RemoteValue
    ...     def __init__(self, value): self.value = value
    ...     def fetch(self): return self.value
    >>> flight = InFlight(threads=2)
    >>> execution = flight.add(Done(7.0), steps=1, fn=None)
    >>> done, value, error = flight.next(timeout=10)
    >>> done is execution, value, error
    (True, 7.0, None)
    >>> flight.counts.finished
    1
    >>> flight.close()
    """

    def __init__(self, threads, clock=time.monotonic):
        self.clock = clock
        self.counts = StepCounts()
        self.pending = []  # in the order scheduled
        self._times = collections.deque(maxlen=_RECENT)
        self._jobs = queue.SimpleQueue()
        self._done = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._fetch_loop, daemon=True,
                                          name=f"keras_dist_fetch_{i}")
                         for i in range(max(1, int(threads)))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ fetching
    def _fetch_loop(self):
        # Daemon threads: one waiting forever on a worker that never comes
        # back must not keep the process from exiting.
        while True:
            execution = self._jobs.get()
            if execution is None:
                return
            try:
                value, error = execution.remote.fetch(), None
            except Exception as e:  # noqa: BLE001 (handed to the chief's thread)
                value, error = None, e
            self._done.put((execution, value, error))
            # Nothing of it stays referenced here: when its remote result is
            # let go is the caller's choice (`AsyncExecutor._hold`).
            del execution, value, error

    def add(self, remote, steps, fn, count=True):
        """Starts waiting for `remote` (an execution of `steps` steps of
        `fn`); `count=False` for a rerun of one already counted."""
        execution = Execution(steps=steps, fn=fn, remote=remote, started=self.clock())
        self.pending.append(execution)
        if count:
            self.counts.scheduled += steps
        self._jobs.put(execution)
        return execution

    def next(self, timeout):
        """The next execution to finish, as `(execution, value, error)`,
        waiting up to `timeout` seconds; `None` if none finished by then.
        `error` is the exception its fetch raised (then it is not counted
        as finished: the caller reruns it, `add(count=False)`, or counts it
        lost, `lose`)."""
        try:
            execution, value, error = self._done.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        self.pending.remove(execution)
        if error is None:
            self._times.append(self.clock() - execution.started)
            self.counts.finished += execution.steps
            if execution.stuck:
                self.counts.late += execution.steps
        return execution, value, error

    def lose(self, execution):
        """Counts `execution`'s steps lost (its result will never come)."""
        self.counts.lost += execution.steps

    # ------------------------------------------------------------ judging
    def stuck_after(self):
        """Seconds after which an execution in flight is judged stuck."""
        if not self._times:  # nothing measured yet: the first carry the set-up
            return FIRST_STUCK_AFTER
        typical = sorted(self._times)[len(self._times) // 2]
        return max(STUCK_FLOOR, STUCK_FACTOR * typical)

    def judge(self):
        """Marks executions in flight longer than `stuck_after()` stuck;
        returns the newly stuck ones."""
        limit, now = self.stuck_after(), self.clock()
        newly = [e for e in self.pending if not e.stuck and now - e.started > limit]
        for execution in newly:
            execution.stuck = True
        return newly

    def next_judgement(self):
        """Seconds until the oldest execution not yet stuck would be judged."""
        live = [e.started for e in self.pending if not e.stuck]
        if not live:
            return None
        return max(0.0, min(live) + self.stuck_after() - self.clock())

    @property
    def live_steps(self):
        """Steps in flight that are expected to finish (not stuck)."""
        return sum(e.steps for e in self.pending if not e.stuck)

    @property
    def live(self):
        return sum(1 for e in self.pending if not e.stuck)

    @property
    def stuck_steps(self):
        return sum(e.steps for e in self.pending if e.stuck)

    @property
    def stuck(self):
        return [e for e in self.pending if e.stuck]

    def close(self, timeout=2.0):
        """Stops the fetch threads, waiting up to `timeout` seconds in all
        for those still fetching a finished execution's result (a thread
        waiting on an execution that never ends stays, as a daemon)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
