"""How long this process could not run: stopped, or starved of CPU.

In synchronous training the replicas meet in several collectives per step
(the gradient all-reduce, the reductions of the logs). A worker stopped by
a container CPU quota or a `SIGSTOP`, or starved by a noisy neighbour,
mostly stalls the others *inside* those collectives, where everybody waits
alike and the arrival times say nothing about who was late. The process
itself knows, though: a thread that sleeps a few milliseconds at a time and
wakes much later than it asked was not allowed to run. `StallProbe` counts
that time, on this process's own clock.

Delays under `tolerance` (10 ms) are not counted: they are what the Python
interpreter lock and an ordinary busy machine cause, on every worker alike.
"""

import threading
import time


class StallProbe:
    """Counts the time this process was stopped or starved of CPU.

    One daemon thread per process, shared: `acquire()` starts it (if it is
    not running), `release()` stops it when the last user is done. It
    sleeps `interval` seconds at a time; whenever it wakes more than
    `tolerance` late, the whole delay counts as stalled.

    Example:

    >>> from keras_dist.training.stall import StallProbe
    >>> probe = StallProbe.acquire()
    >>> before = probe.stalled()
    >>> probe.stalled() - before < 0.01   # nothing stopped this process
    True
    >>> StallProbe.release()
    """

    _lock = threading.Lock()
    _shared = None
    _users = 0

    def __init__(self, interval=0.005, tolerance=0.01):
        self.interval, self.tolerance = interval, tolerance
        self._total = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keras_dist-stall-probe",
                                        daemon=True)

    @classmethod
    def acquire(cls):
        """The process's probe, started if needed."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
                cls._shared._thread.start()
            cls._users += 1
            return cls._shared

    @classmethod
    def release(cls):
        """Stops the probe once nobody uses it any more."""
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users or cls._shared is None:
                return
            probe, cls._shared = cls._shared, None
        probe._done.set()
        probe._thread.join()

    def stalled(self):
        """Seconds stalled since the probe started (grows only)."""
        return self._total

    def _run(self):
        clock, interval, tolerance = time.perf_counter, self.interval, self.tolerance
        while not self._done.is_set():
            start = clock()
            self._done.wait(interval)
            late = clock() - start - interval
            if late > tolerance:
                self._total += late
