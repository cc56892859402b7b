"""`keras_dist.training.inflight`: executions counted as they finish, stuck ones judged.

The remote values here stand in for TF's `RemoteValue` (anything with a
blocking `fetch()`); the clock is a test clock where judgement is timed.
Real clusters with stopped workers: tests/test_stalls.py.
"""

import threading

import pytest

from keras_dist.training import inflight
from keras_dist.training.inflight import InFlight


class Remote:
    """A result that arrives when the test says so (or an error)."""

    def __init__(self, value=None):
        self.value, self.error, self.ready = value, None, threading.Event()

    def land(self, error=None):
        self.error = error
        self.ready.set()
        return self

    def fetch(self):
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def flight():
    clock = Clock()
    flight = InFlight(threads=4, clock=clock)
    flight.test_clock = clock
    yield flight
    flight.close()


def test_results_come_in_the_order_executions_finish_not_the_order_scheduled(flight):
    first, second, third = Remote("a"), Remote("b"), Remote("c")
    executions = [flight.add(r, steps=1, fn=None) for r in (first, second, third)]
    assert flight.next(timeout=0.05) is None  # nothing finished yet
    third.land()
    second.land()
    got = [flight.next(timeout=5), flight.next(timeout=5)]
    assert {g[0] for g in got} == {executions[1], executions[2]}
    assert flight.live == 1 and flight.counts.finished == 2
    first.land()
    execution, value, error = flight.next(timeout=5)
    assert execution is executions[0] and value == "a" and error is None
    assert flight.pending == [] and flight.counts.scheduled == 3


def test_an_execution_is_stuck_after_a_multiple_of_the_median_time_with_a_floor(flight):
    clock = flight.test_clock
    # Nothing measured yet: the first executions carry the workers' set-up.
    assert flight.stuck_after() == inflight.FIRST_STUCK_AFTER > inflight.STUCK_FLOOR
    for _ in range(5):  # executions that take 0.5 s each
        flight.add(Remote().land(), steps=1, fn=None)
        clock.now += 0.5
        flight.next(timeout=5)
        clock.now -= 0.5
    assert flight.stuck_after() == pytest.approx(max(inflight.STUCK_FLOOR,
                                                     inflight.STUCK_FACTOR * 0.5))
    slow = Remote()
    execution = flight.add(slow, steps=3, fn=None)
    clock.now += flight.stuck_after() - 0.01
    assert flight.judge() == [] and flight.live_steps == 3
    clock.now += 0.02
    assert flight.judge() == [execution] and flight.judge() == []  # judged once
    assert flight.live_steps == 0 and flight.stuck_steps == 3
    slow.land()
    assert flight.next(timeout=5)[0] is execution
    assert flight.counts.late == 3 and flight.counts.finished == 8


def test_only_successes_count_as_finished_and_lost_steps_are_counted(flight):
    failing, gone = Remote().land(error=RuntimeError("worker failed")), Remote()
    flight.add(failing, steps=2, fn="f")
    execution, value, error = flight.next(timeout=5)
    assert isinstance(error, RuntimeError) and flight.counts.finished == 0
    flight.add(Remote(1.0).land(), steps=2, fn="f", count=False)  # rerun: not counted again
    flight.next(timeout=5)
    stuck = flight.add(gone, steps=1, fn="g")
    flight.lose(stuck)
    assert flight.counts.as_dict() == {"scheduled": 3, "finished": 2, "speculative": 0,
                                       "late": 0, "lost": 1}


@pytest.mark.multiprocess
def test_a_fetch_that_never_returns_does_not_keep_the_process_alive():
    import subprocess
    import sys
    code = ("from keras_dist.training.inflight import InFlight\n"
            "import threading\n"
            "class Never:\n"
            "    def fetch(self): threading.Event().wait()\n"
            "flight = InFlight(threads=1)\n"
            "flight.add(Never(), steps=1, fn=None)\n"
            "assert flight.next(timeout=0.1) is None\n"
            "flight.close()\n"
            "print('exiting')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr
