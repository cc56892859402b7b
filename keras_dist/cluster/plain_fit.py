"""Keras' own `model.fit` refused on the tasks of a parameter-server cluster.

A script that calls Keras' `model.fit` itself, on every task of a cluster
whose `TF_CONFIG` names `ps` tasks, trains a separate model on each task
(the chief's, each worker's, each parameter server's) and exits 0: nothing
says the job never trained together. Keras' fit cannot train under
`ParameterServerStrategy` at all (TensorFlow's raw "pass this dataset to
ClusterCoordinator.create_per_worker_dataset" when it is tried).

`install()` replaces `keras.Model.fit` (for classes that do not override it)
with one that raises keras_dist's error on such a task, before anything
trains, naming the task and the fix. It runs

- when Keras is imported in a process that imported keras_dist
  (`keras_dist._registration`);
- in every task `keras-dist-run` starts for a cluster with `ps` tasks, also
  when the script never imports keras_dist: the launcher puts
  `keras_dist/_boot` on `PYTHONPATH`, whose `sitecustomize` imports
  keras_dist (which imports neither Keras nor TensorFlow).

`keras_dist.fit` with an explicit non-parameter-server strategy on such a
cluster is the user's choice and stays allowed, as does Keras' fit inside
`keras_dist.local_fit()` (`local_fit()`): a model of the chief's own.
"""

import contextlib
import json
import os
import threading

_state = threading.local()
_installed = []


def ps_task(environ=None):
    """`(task_type, task_index, ps_count)` when `TF_CONFIG` describes a
    cluster with `ps` tasks, else `None` (no, or unreadable, TF_CONFIG)."""
    raw = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        config = json.loads(raw)
        cluster = config.get("cluster") or {}
        task = config.get("task") or {}
        ps = cluster.get("ps") or []
    except (ValueError, AttributeError):
        return None  # keras_dist.cluster.config reports a bad TF_CONFIG where it is read
    if not ps:
        return None
    return task.get("type"), task.get("index", 0), len(ps)


@contextlib.contextmanager
def local_fit():
    """Keras' own `model.fit` trains on this process alone in the block,
    also on a task of a parameter-server cluster (exported as
    `keras_dist.local_fit`).

    On such a task Keras' own fit is refused, because a script that calls it
    on every task trains one separate model per task. In this block it
    trains as it would anywhere: for a small model of the chief's own (a
    reference, a baseline) that has nothing to do with the cluster.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> model = keras.Sequential([keras.layers.Dense(1)])
    >>> model.compile(loss="mse")   # Keras' default optimizer
    >>> with kd.local_fit():
    ...     history = model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
    >>> len(history.history["loss"])
    1
    """
    before = getattr(_state, "allowed", False)
    _state.allowed = True
    try:
        yield
    finally:
        _state.allowed = before


def message(task):
    task_type, task_index, ps_count = task
    role = f"{task_type}:{task_index}" if task_type is not None else "a task"
    serving = (" On worker and ps tasks it serves the chief and never returns."
               if task_type in ("worker", "ps") else "")
    return (
        f"keras_dist: Keras' own model.fit was called on {role} of a parameter-server "
        f"cluster (TF_CONFIG names {ps_count} ps task(s)). It would train a separate model "
        "on every task of the job, and none of them with the others. Hand the training to "
        "keras_dist instead: `history = keras_dist.fit(build_model, x, y, ...)`, or create "
        "a keras_dist.AsyncModel inside `keras_dist.resolve_strategy().scope()` and call "
        f"its fit.{serving} (To train a model of this process's own with Keras' fit, "
        "call it inside `with keras_dist.local_fit():`.) See docs/asynchronous-training.md.")


def install(environ=None):
    """Guards `keras.Model.fit` when this process is a task of a
    parameter-server cluster (once; a no-op elsewhere)."""
    if _installed or ps_task(environ) is None:
        return
    import keras

    original = keras.Model.fit

    def fit(self, *args, **kwargs):
        task = ps_task()
        if task is not None and not getattr(_state, "allowed", False):
            raise RuntimeError(message(task))
        return original(self, *args, **kwargs)

    fit.__doc__ = original.__doc__
    fit.__wrapped__ = original
    keras.Model.fit = fit
    _installed.append(original)
