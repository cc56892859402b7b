"""Fault injection in training itself: slow workers on demand.

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

The setting is read once, when `fit` builds its run plan
(`keras_dist.training.plan`), and handed to the executors as a
`FaultInjection`: the one place where fault injection enters production
code. Set the variable before `fit` (the launcher passes its environment to
every task), or use `slow_worker` around the `fit` call in a single process.

This is the production half of fault injection; `keras_dist.testing` (the
test toolkit: slowdowns and faults from outside a process) re-exports it,
and production code never imports `keras_dist.testing`.
"""

import contextlib
import dataclasses
import logging
import os
from typing import Dict

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

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

    >>> import tensorflow as tf, keras_dist as kd
    >>> start = tf.timestamp()
    >>> waits = kd.testing.slow_down(1, tf.constant(0.01, tf.float64), start,
    ...                              slowed={1: 3.0})
    >>> float(waits[0] - start) >= 0.02   # worker 1: (3 - 1) x 10 ms more
    True
    >>> kd.testing.slow_down(0, 0.01, start, slowed={})
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
