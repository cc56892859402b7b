"""Fault injection for tests, demos and benchmarks: slow workers on demand.

Example:

>>> import keras_dist as kd
>>> with kd.testing.slow_worker(1, 3):   # worker 1 three times slower in this block
...     kd.testing.slow_workers_from_env()
{1: 3.0}

A straggler is hard to produce on purpose: real slowness comes from a busy
node, a thermal limit or a noisy neighbour. This module makes one (or
several) workers' training steps slower by a factor, in every strategy
keras_dist drives, without touching the training script:

    KERAS_DIST_SLOW_WORKER=1:3 keras-dist-run --workers 2 --ps 1 -- python train.py

The value is `index:factor[,index:factor...]`. The index is a worker's
task index in asynchronous (parameter-server) training and a replica's
index in synchronous training (`replica_id_in_sync_group`; under
`MultiWorkerMirroredStrategy` with one device per worker that is the
worker's index). Factor 3 makes each of that worker's steps take 3 times
as long: after computing its gradients (and before the update, or the
gradient all-reduce in synchronous training) the step sleeps for
`factor - 1` times the time it took so far. The sleep is a TensorFlow op
running on the worker itself, so it works on remote parameter-server
workers, where Python code cannot run; it blocks one thread and burns no
CPU, so it does not slow the other workers down on a shared machine.

The setting is read once, when `fit` starts (`faults_from_env`), and handed
to the executors as a `FaultInjection`: the one place where fault injection
enters production code. Set the variable before `fit` (the launcher passes
its environment to every task), or use `slow_worker` around the `fit` call
in a single process.

Slowdowns from outside a process, the way real clusters produce them, are
here too: `throttle` stops and continues a process on a duty cycle (what a
container CPU quota does), `cpu_hog` runs busy processes that compete for
the CPUs, and `pin_process` puts a process (every thread of it) on given
CPUs, so a hog can share a core with one worker only.
"""

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Dict

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

__all__ = ["FaultInjection", "faults_from_env", "sleep", "slow_down", "slow_worker",
           "slow_workers_from_env"]

SLOW_WORKER_ENV = "KERAS_DIST_SLOW_WORKER"
"""Environment variable naming the slowed workers: `index:factor[,...]`."""


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    """The faults a training run injects: today, slowed workers.

    Executors receive one from `fit` and call `slow_down` in their traced
    steps; with nothing slowed it adds no op at all.

    Attributes:
        slowed: Dict `{index: factor}` of slowed workers (or replicas).

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.testing import FaultInjection
    >>> faults = FaultInjection({1: 3.0})
    >>> faults.key
    ((1, 3.0),)
    >>> start = tf.timestamp()
    >>> float(faults.slow_down(1, tf.constant(0.01, tf.float64), start)[0] - start) >= 0.02
    True
    """

    slowed: Dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def key(self):
        """A hashable summary, for caching traced functions."""
        return tuple(sorted(self.slowed.items()))

    def slow_down(self, identity, elapsed, after):
        """See `slow_down`: control dependencies that sleep when `identity`
        is slowed (an empty list when nothing is)."""
        return slow_down(identity, elapsed, after, self.slowed)


def faults_from_env(environ=None):
    """The `FaultInjection` named by the environment (`KERAS_DIST_SLOW_WORKER`).

    Example:

    >>> from keras_dist.testing import faults_from_env
    >>> faults_from_env({"KERAS_DIST_SLOW_WORKER": "0:2"}).slowed
    {0: 2.0}
    """
    slowed = slow_workers_from_env(environ)
    if slowed and environ is None:
        logging.getLogger("keras_dist").info(
            "keras_dist: %s=%s: slowing %s (fault injection for tests and demos)",
            SLOW_WORKER_ENV, _setting(None).strip(),
            ", ".join(f"worker {i} x{f:g}" for i, f in sorted(slowed.items())))
    return FaultInjection(slowed)


def slow_workers_from_env(environ=None):
    """The slowed workers as a dict `{index: factor}` (empty when unset).

    Args:
        environ: Mapping to read instead of `os.environ`.

    Raises:
        ValueError: if `KERAS_DIST_SLOW_WORKER` is malformed.

    Example:

    >>> from keras_dist.testing import slow_workers_from_env
    >>> slow_workers_from_env({"KERAS_DIST_SLOW_WORKER": "1:3,2:1.5"})
    {1: 3.0, 2: 1.5}
    >>> slow_workers_from_env({})
    {}
    """
    text = _setting(environ).strip()
    if not text:
        return {}
    slowed = {}
    for item in text.split(","):
        index, sep, factor = item.strip().partition(":")
        try:
            index, factor = int(index), float(factor)
        except ValueError:
            index = factor = None
        if not sep or index is None or index < 0 or not factor >= 1.0:
            raise ValueError(
                f"{SLOW_WORKER_ENV}={text!r}: each item must be "
                "`index:factor` with a worker index >= 0 and a factor >= 1 "
                f"(e.g. '1:3' makes worker 1 three times slower). Bad item: {item!r}.")
        if index in slowed:
            raise ValueError(f"{SLOW_WORKER_ENV}={text!r} names index {index} twice.")
        slowed[index] = factor
    return slowed


@contextlib.contextmanager
def slow_worker(index, factor):
    """Makes worker (or replica) `index` `factor` times slower inside the block.

    Adds to what `KERAS_DIST_SLOW_WORKER` says, for this process only:
    `slow_workers_from_env()` sees it inside the block, and training
    functions traced inside the block carry the slowdown. It does not write
    the process environment (`setenv` while TensorFlow threads read it can
    crash the process), so child processes do not inherit it: set
    `KERAS_DIST_SLOW_WORKER` in their environment instead.

    Example:

    >>> import os
    >>> from keras_dist.testing import slow_worker, slow_workers_from_env
    >>> with slow_worker(1, 3):
    ...     slow_workers_from_env(), "KERAS_DIST_SLOW_WORKER" in os.environ
    ({1: 3.0}, False)
    >>> slow_workers_from_env()
    {}
    """
    slowed = slow_workers_from_env()
    slowed[int(index)] = float(factor)
    text = ",".join(f"{i}:{f:g}" for i, f in sorted(slowed.items()))
    slow_workers_from_env({SLOW_WORKER_ENV: text})  # validates index and factor
    _in_process_slowdowns.append(text)
    try:
        yield
    finally:
        _in_process_slowdowns.remove(text)


# What `slow_worker` blocks add, innermost last (read by slow_workers_from_env).
_in_process_slowdowns = []


def _setting(environ):
    """The slow-worker setting: `environ`'s, else the innermost `slow_worker`
    block's (which names them all), else the process environment's."""
    if environ is None and _in_process_slowdowns:
        return _in_process_slowdowns[-1]
    return (os.environ if environ is None else environ).get(SLOW_WORKER_ENV, "")


def sleep(seconds, after=None):
    """A TensorFlow op that sleeps `seconds`; returns the time it woke up.

    Works in graphs on any device, remote parameter-server workers included
    (it is a tf.data sleep, run to its single element). It blocks one
    thread and does not use the CPU.

    Args:
        seconds: Float scalar (tensor or number); `<= 0` sleeps not at all.
        after: Optional tensor(s) the sleep waits for.

    Returns:
        A float64 scalar: `tf.timestamp()` once the sleep is over.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.testing import sleep
    >>> start = tf.timestamp()
    >>> float(sleep(0.05, after=start) - start) >= 0.05
    True
    """
    deps = tf.nest.flatten(after) if after is not None else []
    with tf.control_dependencies(deps):
        # DatasetToSingleElement asks the iterator twice (the element, then
        # its end), and the sleep dataset sleeps on every request: halve it.
        micros = tf.cast(tf.maximum(tf.cast(seconds, tf.float64), 0.0) * 5e5, tf.int64)
        seed = tf.zeros([], tf.int64)
        variant = tf.raw_ops.TensorDataset(components=[seed], output_shapes=[[]])
        variant = tf.raw_ops.SleepDataset(
            input_dataset=variant, sleep_microseconds=micros,
            output_types=[tf.int64], output_shapes=[[]])
        woke = tf.raw_ops.DatasetToSingleElement(
            dataset=variant, output_types=[tf.int64], output_shapes=[[]])
    with tf.control_dependencies(woke):
        return tf.timestamp()


def slow_down(identity, elapsed, after, slowed=None):
    """In a traced step: sleeps when `identity` is a slowed worker.

    Args:
        identity: Integer scalar tensor: the worker index (asynchronous) or
            replica index (synchronous) running this step.
        elapsed: Float64 scalar tensor: seconds the step took so far.
        after: Tensor(s) the sleep must follow (e.g. the gradients).
        slowed: `{index: factor}`; defaults to `slow_workers_from_env()`.

    Returns:
        A list of control dependencies for what must wait for the sleep
        (empty when nothing is slowed, so no op is added at all).

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.testing import slow_down
    >>> start = tf.timestamp()
    >>> waits = slow_down(1, tf.constant(0.01, tf.float64), start, slowed={1: 3.0})
    >>> float(waits[0] - start) >= 0.02   # worker 1: (3 - 1) x 10 ms more
    True
    >>> slow_down(0, 0.01, start, slowed={})
    []
    """
    slowed = slow_workers_from_env() if slowed is None else slowed
    if not slowed:
        return []
    identity = tf.cast(identity, tf.int64)
    extra = tf.constant(0.0, tf.float64)
    for index, factor in slowed.items():
        extra = tf.where(tf.equal(identity, index),
                         tf.cast(factor - 1.0, tf.float64) * elapsed, extra)
    return [sleep(extra, after=after)]


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
