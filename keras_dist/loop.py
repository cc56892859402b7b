"""The synchronous training loop keras_dist owns, for where Keras' is broken.

Keras 3's `Model.fit` fails under a multi-worker `MultiWorkerMirroredStrategy`
in two places of its own loop (keras-team/keras#20585,
tensorflow/tensorflow#72388): `_maybe_symbolic_build` asks the strategy to
reduce the whole `(x, y)` batch tuple, and `reduce_per_replica` reduces scalar
metrics along an axis they do not have. Neither is in `train_step`.

So this loop keeps everything of Keras that works -- the model's own
`train_step` / `test_step`, its metrics, `keras.callbacks.CallbackList` with
the progress bar and `History` -- and replaces only the two broken pieces: it
runs `train_step` through `strategy.run` inside a `tf.function` and reduces
each returned value with `strategy.reduce("MEAN", value, axis=None)`, which
is valid for tensors of any rank. Epoch logs, like Keras', come from the
metrics read in cross-replica context (summed over every replica of every
worker).

It works under any synchronous strategy; `keras_dist.fit` uses it only where
Keras' own loop fails, and the tests check that both give the same weights
under `MirroredStrategy`.
"""

import contextlib
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_dist import data as data_lib
from keras_dist import testing
from keras_dist.callbacks import base as replica_cbs


def fit_loop(model, strategy, x=None, y=None, *, batch_size=None, epochs=1,
             verbose="auto", callbacks=None, validation_split=0.0,
             validation_data=None, shuffle=True, class_weight=None,
             sample_weight=None, initial_epoch=0, steps_per_epoch=None,
             validation_steps=None, validation_batch_size=None,
             validation_freq=1):
    """Trains `model` under `strategy`, with `keras.Model.fit`'s arguments.

    `model` must have been built and compiled inside `strategy.scope()`.
    Returns the `keras.callbacks.History`.
    """
    verbose = 1 if verbose == "auto" else verbose
    if validation_split and validation_data is None:
        if isinstance(x, tf.data.Dataset) or data_lib.is_dataset_fn(x):
            raise ValueError(
                "`validation_split` is only supported for array inputs. "
                "Pass `validation_data` instead."
            )
        (x, y, sample_weight), val = data_lib.split_validation(
            (x, y, sample_weight), validation_split)
        validation_data = val
    train = data_lib.distribute(
        strategy, x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
        class_weight=class_weight, steps=steps_per_epoch)
    val = None
    if validation_data is not None:
        val = _distribute_validation(strategy, validation_data,
                                     validation_batch_size or batch_size,
                                     validation_steps)

    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0,
            verbose=verbose, epochs=epochs, steps=train.steps, model=model)
    watchers = replica_cbs.replica_callbacks(callbacks)
    step_fns = _StepFunctions(model, strategy, model.train_step,
                              instrument=bool(watchers) or bool(testing.slow_workers_from_env()))
    eval_fns = _StepFunctions(model, strategy, model.test_step)

    model.stop_training = False
    callbacks.on_train_begin()
    # Set by a restoring callback (BackupAndRestore), as Keras' own loop reads it.
    initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
    logs, epoch_logs = {}, {}
    iterator = iter(train.dataset) if train.repeats else None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        if not train.repeats:
            iterator = iter(train.dataset)
        ran_out = False
        step_fns.new_epoch()
        for begin, end, step_logs in step_fns.steps(iterator, train.steps):
            if step_logs is None:
                callbacks.on_train_batch_begin(begin)
                continue
            logs = step_logs
            if step_fns.replica_steps is not None:
                replica_cbs.feed(watchers, end, step_fns.replica_steps)
            callbacks.on_train_batch_end(end, logs)
            if model.stop_training:
                break
        else:
            ran_out = step_fns.ran_out and train.repeats
        if ran_out:
            warnings.warn(
                "Your input ran out of data; interrupting training. Make sure "
                f"it can generate at least steps_per_epoch * epochs batches "
                f"({train.steps} * {epochs}); use `.repeat()` on a dataset.",
                stacklevel=2)
            model.stop_training = True
        epoch_logs = dict(_metrics_or_logs(model, logs))
        replica_cbs.add_replica_logs(watchers, epoch_logs)
        if val is not None and should_eval(epoch, validation_freq):
            val_logs = _evaluate(model, eval_fns, val, callbacks)
            epoch_logs.update({"val_" + k: v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs=epoch_logs or logs)
    return model.history


def evaluate_loop(model, strategy, x=None, y=None, *, batch_size=None,
                  verbose="auto", sample_weight=None, steps=None,
                  callbacks=None, return_dict=False):
    """Evaluates `model` under `strategy`, with `keras.Model.evaluate`'s arguments."""
    verbose = 1 if verbose == "auto" else verbose
    val = data_lib.distribute(strategy, x, y, sample_weight,
                              batch_size=batch_size, shuffle=False, steps=steps)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
            steps=val.steps, model=model)
    logs = _evaluate(model, _StepFunctions(model, strategy, model.test_step),
                     val, callbacks)
    if return_dict:
        return logs
    values = [logs[name] for name in _ordered_names(model, logs)]
    return values[0] if len(values) == 1 else values


def _evaluate(model, eval_fns, val, callbacks):
    model.reset_metrics()
    callbacks.on_test_begin()
    logs = {}
    iterator = iter(val.dataset)
    for begin, end, step_logs in eval_fns.steps(iterator, val.steps):
        if step_logs is None:
            callbacks.on_test_batch_begin(begin)
            continue
        logs = step_logs
        callbacks.on_test_batch_end(end, logs)
    logs = _metrics_or_logs(model, logs)
    callbacks.on_test_end(logs)
    return logs


class _StepFunctions:
    """Compiled `steps_per_execution`-step functions over a distributed iterator.

    With `instrument=True` each step also measures, on every replica, the
    time from its batch to its gradients -- before the optimizer's update,
    and so before the gradient all-reduce -- plus its examples and loss;
    after each execution `replica_steps` holds them as `ReplicaStep`s
    (gathered from every worker). Slowdowns from
    `keras_dist.testing` (`KERAS_DIST_SLOW_WORKER`) are injected there too.
    """

    def __init__(self, model, strategy, step, instrument=False):
        self._model, self._strategy, self._step = model, strategy, step
        self._functions, self._eager = {}, {}
        self._warm = False
        self._instrument = instrument
        self._slowed = testing.slow_workers_from_env() if instrument else {}
        self._loss_so_far = {}
        self.replica_steps = None
        self.ran_out = False

    def new_epoch(self):
        """Metrics were reset: per-replica loss sums restart from zero."""
        self._loss_so_far = {}

    def _function(self, k):
        if k not in self._functions:
            strategy = self._strategy
            step = self._instrumented_step if self._instrument else self._step

            def run(iterator):
                records = []
                for _ in range(k):  # unrolled: k is small and fixed per function
                    outputs = strategy.run(step, args=(next(iterator),))
                    if self._instrument:
                        outputs, record = outputs
                        records.append(record)
                logs = tf.nest.map_structure(
                    lambda v: strategy.reduce("MEAN", v, axis=None), outputs)
                if not records:
                    return logs
                # One row per replica of every worker: [k steps x fields].
                per_replica = strategy.run(lambda *r: tf.expand_dims(tf.stack(r), 0),
                                           args=tuple(records))
                return logs, strategy.gather(per_replica, axis=0)

            self._functions[k] = (
                run if self._model.run_eagerly
                else tf.function(run, jit_compile=bool(self._model.jit_compile)))
            self._eager[k] = run
        return self._functions[k]

    def _instrumented_step(self, data):
        """`step(data)` plus a float64 vector [replica, seconds, examples,
        loss total, loss count] measured on this replica."""
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                          tf.float64)
        with tf.control_dependencies([t for t in tf.nest.flatten(data) if t is not None]):
            start = tf.timestamp()
        with tf.control_dependencies([start]):  # the forward pass starts after it
            data = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), data)
        marks = []
        slowed = self._slowed

        def timed_apply(original, grads, trainable_variables=None):
            grads = list(grads)
            flat = [t for t in tf.nest.flatten(grads, expand_composites=True)
                    if t is not None]
            with tf.control_dependencies(flat):
                ready = tf.timestamp()
            waits = testing.slow_down(replica, ready - start, ready, slowed) or [ready]
            marks.append(waits[0])
            with tf.control_dependencies(waits):
                grads = [None if g is None else tf.nest.map_structure(
                    tf.identity, g, expand_composites=True) for g in grads]
            return original(grads, trainable_variables)

        _replica_hooks.apply = timed_apply  # this replica's thread only
        try:
            logs = self._step(data)
        finally:
            _replica_hooks.apply = None
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        first = next((t for t in tf.nest.flatten(x) if t is not None), None)
        examples = (tf.cast(tf.shape(first)[0], tf.float64) if first is not None
                    else tf.constant(np.nan, tf.float64))
        with tf.control_dependencies(tf.nest.flatten(logs)):
            end = marks[-1] if marks else tf.timestamp()
            total, count = _loss_state(self._model)
        return logs, tf.stack([replica, end - start, examples, total, count])

    def _replica_steps(self, rows):
        """`ReplicaStep`s from the gathered [replicas, k, 5] array."""
        steps = []
        for row in np.asarray(rows):
            replica = int(row[0, 0])
            total, count = float(row[-1, 3]), float(row[-1, 4])
            before_total, before_count = self._loss_so_far.get(replica, (0.0, 0.0))
            self._loss_so_far[replica] = (total, count)
            added = count - before_count
            loss = (total - before_total) / added if added > 0 else float("nan")
            examples = row[:, 2].sum()
            steps.append(replica_cbs.ReplicaStep(
                replica=f"replica{replica}", steps=len(row), seconds=float(row[:, 1].sum()),
                examples=None if np.isnan(examples) else int(examples), loss=loss))
        return steps

    def _call(self, k, iterator, eager):
        with _hooked_apply(self._model.optimizer if self._instrument else None):
            if eager:
                self._function(k)
                with quiet_tf_logger():  # one eager step: the overhead warning misleads
                    result = self._eager[k](iterator)
            else:
                result = self._function(k)(iterator)
        if self._instrument:
            result, rows = result
            self.replica_steps = self._replica_steps(rows)
        return result

    def steps(self, iterator, total):
        """Yields `(begin, None, None)` before and `(begin, end, logs)` after
        each execution; stops at `total` steps or at the end of the data."""
        per_call = max(1, int(getattr(self._model, "steps_per_execution", 1) or 1))
        self.ran_out = False
        begin = 0
        while total is None or begin < total:
            k = per_call if total is None else min(per_call, total - begin)
            if total is None:
                k = 1  # unknown length: stop exactly at the end of the data
            yield begin, None, None
            try:
                # First call eagerly: the optimizer and metrics create their
                # variables there, which a tf.function may not do.
                logs = self._call(k, iterator, eager=not self._warm)
                self._warm = True
            except (tf.errors.OutOfRangeError, StopIteration):
                self.ran_out = True
                return
            yield begin, begin + k - 1, logs
            begin += k


_replica_hooks = threading.local()


@contextlib.contextmanager
def _hooked_apply(optimizer):
    """Routes `optimizer.apply` through the calling replica's hook, if any.

    Keras' `train_step` calls `optimizer.apply_gradients`, which calls
    `self.apply`: an instance attribute is found first. MirroredStrategy
    traces each replica in its own thread, so each replica's hook is kept
    thread-locally; the dispatcher is there only while a step function is
    called (traced), and calls the optimizer's own `apply` when no hook is.
    """
    if optimizer is None:
        yield
        return
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        hook = getattr(_replica_hooks, "apply", None)
        if hook is None:
            return original(grads, trainable_variables)
        return hook(original, grads, trainable_variables)

    optimizer.__dict__["apply"] = apply
    try:
        yield
    finally:
        optimizer.__dict__.pop("apply", None)


def _loss_state(model):
    """This replica's running loss sum and count (Keras' loss tracker)."""
    for metric in model.metrics:
        if metric.name == "loss":
            values = {v.name: v for v in metric.variables}
            if "total" in values and "count" in values:
                return (tf.cast(values["total"].value, tf.float64),
                        tf.cast(values["count"].value, tf.float64))
    nan = tf.constant(np.nan, tf.float64)
    return nan, nan


@contextlib.contextmanager
def quiet_tf_logger(level="ERROR"):
    """Raises the `tensorflow` logger's level for a block, then restores it."""
    tf_logger = tf.get_logger()
    previous = tf_logger.level
    tf_logger.setLevel(level)
    try:
        yield
    finally:
        tf_logger.setLevel(previous)


def _distribute_validation(strategy, validation_data, batch_size, steps):
    if isinstance(validation_data, tf.data.Dataset) or data_lib.is_dataset_fn(
            validation_data):
        return data_lib.distribute(strategy, validation_data, steps=steps,
                                   what="validation_data")
    if not isinstance(validation_data, (tuple, list)) or not 2 <= len(
            validation_data) <= 3:
        raise ValueError(
            "`validation_data` must be a tf.data.Dataset, a dataset_fn, or a "
            "tuple (x_val, y_val) or (x_val, y_val, val_sample_weight). "
            f"Received: {type(validation_data).__name__} of length "
            f"{len(validation_data) if hasattr(validation_data, '__len__') else '?'}.")
    vx, vy, vsw = (tuple(validation_data) + (None,))[:3]
    return data_lib.distribute(strategy, vx, vy, vsw, batch_size=batch_size,
                               shuffle=False, steps=steps, what="validation_data")


def _metrics_or_logs(model, logs):
    """Keras' rule: the model's metrics when the step returned exactly them.

    Reading the metrics here, in cross-replica context, aggregates their
    sync-on-read state over every replica of every worker. Values come back
    as Python floats, as in Keras' epoch logs.
    """
    metric_logs = model.get_metrics_result()
    if isinstance(logs, dict) and set(logs) == set(metric_logs):
        logs = metric_logs
    return {name: pythonify(value) for name, value in logs.items()}


def pythonify(value):
    value = value.numpy() if hasattr(value, "numpy") else value
    return float(value) if np.ndim(value) == 0 else value


def _ordered_names(model, logs):
    first = [m.name for m in model.metrics if m.name in logs]
    return first + sorted(set(logs) - set(first))


def should_eval(epoch, validation_freq):
    if isinstance(validation_freq, int):
        if validation_freq < 1:
            raise ValueError(
                f"`validation_freq` must be >= 1. Received: {validation_freq}.")
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
