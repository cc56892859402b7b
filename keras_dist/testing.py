"""The test toolkit: fault injection for tests, demos and benchmarks.

Example:

>>> import keras_dist as kd
>>> from keras_dist import faults
>>> kd.testing.slow_worker is faults.slow_worker   # the production half, re-exported
True

Slowdowns inside training (`slow_worker`, `KERAS_DIST_SLOW_WORKER`,
`FaultInjection`, `sleep`, `slow_down`) live in `keras_dist.faults`, the
production half that `fit` reads once, and are re-exported here.

Slowdowns from outside a process, the way real clusters produce them, are
here too: `throttle` stops and continues a process on a duty cycle (what a
container CPU quota does), `cpu_hog` runs busy processes that compete for
the CPUs, and `pin_process` puts a process (every thread of it) on given
CPUs, so a hog can share a core with one worker only. Production code never
imports this module.
"""


import contextlib
import os
import signal
import subprocess
import sys
import threading

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.faults import (  # noqa: F401  (the public names of kd.testing)
    SLOW_WORKER_ENV, FaultInjection, faults_from_env, sleep, slow_down, slow_worker,
    slow_workers_from_env)

__all__ = ["FaultInjection", "cpu_hog", "faults_from_env", "pin_process", "sleep",
           "slow_down", "slow_worker", "slow_workers_from_env", "throttle"]


# ----------------------------------------------- slowdowns from outside a process
@contextlib.contextmanager
def throttle(pid, period=0.1, stopped=0.5):
    """Stops and continues process `pid` on a duty cycle inside the block.

    Every `period` seconds the process is stopped (`SIGSTOP`) for
    `stopped * period` seconds, then continued (`SIGCONT`): what a container
    CPU quota does to a busy process, seen from outside. On exit the
    process is always continued. A process that ends meanwhile ends the
    cycle quietly.

    Args:
        pid: Integer. The process to throttle (its threads stop with it).
        period: Float > 0, seconds per cycle.
        stopped: Float in (0, 1): the share of each cycle it is stopped.

    Yields:
        A dict whose `"cycles"` counts the stops so far.

    Example:

    >>> import subprocess, sys, time
    >>> from keras_dist.testing import throttle
    >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    >>> with throttle(child.pid, period=0.05, stopped=0.5) as state:
    ...     time.sleep(0.3)
    >>> state["cycles"] >= 3
    True
    >>> child.kill(); _ = child.wait()
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"throttle: `pid` must be a positive integer. Received: pid={pid!r}.")
    if not (isinstance(period, (int, float)) and period > 0):
        raise ValueError(f"throttle: `period` must be seconds > 0. Received: period={period!r}.")
    if not (isinstance(stopped, (int, float)) and 0 < stopped < 1):
        raise ValueError("throttle: `stopped` must be a share of the period in (0, 1). "
                         f"Received: stopped={stopped!r}.")
    state, done = {"cycles": 0}, threading.Event()

    def cycle():
        try:
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                state["cycles"] += 1
                done.wait(period * stopped)
                os.kill(pid, signal.SIGCONT)
                done.wait(period * (1 - stopped))
        except ProcessLookupError:
            pass

    thread = threading.Thread(target=cycle, name=f"throttle-{pid}", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        thread.join()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def pin_process(pid, cpus):
    """Runs every thread of process `pid` on `cpus` only (Linux).

    Threads it starts later inherit the setting from the thread that starts
    them.

    Args:
        pid: Integer. The process.
        cpus: Iterable of CPU indices, e.g. `{1}`.

    Returns:
        The number of threads pinned.

    Example:

    >>> import os
    >>> from keras_dist.testing import pin_process
    >>> allowed = os.sched_getaffinity(0)
    >>> pin_process(os.getpid(), allowed) >= 1
    True
    """
    cpus = set(cpus)
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return pinned


@contextlib.contextmanager
def cpu_hog(processes=1, cpus=None):
    """Runs `processes` CPU-bound processes inside the block.

    Each spins in a loop (no memory, no I/O) and competes with everything
    else on its CPUs for time, as a noisy neighbour does; they are killed
    on exit.

    Args:
        processes: Integer >= 1.
        cpus: Optional iterable of CPU indices to keep them on (e.g. the
            core one worker is pinned to); default: anywhere.

    Yields:
        The list of their process ids.

    Example:

    >>> import os, time
    >>> from keras_dist.testing import cpu_hog
    >>> with cpu_hog(1) as pids:
    ...     time.sleep(0.2)
    ...     busy = os.sched_getaffinity(pids[0]) and len(pids)
    >>> busy
    1
    """
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"cpu_hog: `processes` must be an integer >= 1. "
                         f"Received: processes={processes!r}.")
    children = []
    try:
        for _ in range(processes):
            children.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            if cpus is not None:
                os.sched_setaffinity(children[-1].pid, set(cpus))
        yield [child.pid for child in children]
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()
