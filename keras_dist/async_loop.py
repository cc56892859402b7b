"""The asynchronous training loop: Keras' `fit` on a parameter-server cluster.

Keras 3 has no parameter-server support (keras-team/keras#18624). This loop
drives the model's own `train_step` through TF's public
`tf.distribute.coordinator.ClusterCoordinator`: each scheduled closure runs
`steps_per_execution` steps on whichever worker is free, and its update is
applied on the parameter servers without waiting for anyone. The chief keeps
Keras' callbacks, progress bar and `History`; batch-level hooks fire as the
closures' results come back (`on_train_batch_begin` when a closure is
scheduled, `on_train_batch_end` when its result arrives, in order).

Metrics live on the parameter servers, so the epoch logs (read there) cover
every worker's batches. Validation runs on the chief, reading the current
weights from the parameter servers.
"""

import collections
import logging
import math

import keras
import numpy as np
import tensorflow as tf

from keras_dist import data as data_lib
from keras_dist import testing
from keras_dist.callbacks import base as replica_cbs
from keras_dist.cluster import ClusterConfig
from keras_dist.optimizers.base import staleness_aware_in
from keras_dist.loop import pythonify, quiet_tf_logger, should_eval
from keras_dist.staleness import StalenessStats, StepRecord

logger = logging.getLogger("keras_dist")



def fit_async(model, strategy, x=None, y=None, *, batch_size=None, epochs=1,
              verbose="auto", callbacks=None, validation_split=0.0,
              validation_data=None, shuffle=True, class_weight=None,
              sample_weight=None, initial_epoch=0, steps_per_epoch=None,
              validation_steps=None, validation_batch_size=None,
              validation_freq=1):
    """Trains an `AsyncModel` asynchronously; `keras.Model.fit`'s arguments.

    `steps_per_epoch` counts updates from all workers together; for arrays it
    defaults to one pass over the data (`ceil(samples / batch_size)`).
    """
    verbose = 2 if verbose == "auto" else verbose
    if validation_split and validation_data is None:
        if isinstance(x, tf.data.Dataset) or data_lib.is_dataset_fn(x):
            raise ValueError("`validation_split` is only supported for array "
                             "inputs. Pass `validation_data` instead.")
        (x, y, sample_weight), validation_data = data_lib.split_validation(
            (x, y, sample_weight), validation_split)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    dataset_fn, steps, sample = _per_worker_input(
        strategy, x, y, sample_weight, batch_size, shuffle, class_weight,
        steps_per_epoch)
    model.build_async_state(sample)
    aware = staleness_aware_in(model.optimizer)
    model._kd_async = True  # train_step does the bookkeeping from now on
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    per_call = max(1, int(model.steps_per_execution or 1))
    step_fn = _step_function(model, strategy, per_call)

    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0,
            verbose=verbose, epochs=epochs, steps=steps, model=model)
    watchers = replica_cbs.replica_callbacks(callbacks)
    stats = StalenessStats()
    model.staleness_stats = stats
    # Closures in flight: enough to keep every worker busy while the chief
    # waits for the oldest result.
    window = WINDOW_PER_WORKER * _num_workers()

    model.stop_training = False
    callbacks.on_train_begin()
    # Set by a restoring callback (BackupAndRestore), as Keras' own loop reads it.
    initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
    logs, epoch_logs = {}, {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        stats.reset()
        if aware is not None:
            aware.reset_staleness_logs()
        skipped_before = model._kd_version.skipped_value
        callbacks.on_epoch_begin(epoch)
        pending = collections.deque()
        scheduled = 0
        while scheduled < steps or pending:
            while scheduled < steps and len(pending) < window:
                k = min(per_call, steps - scheduled)
                callbacks.on_train_batch_begin(scheduled)
                fn = step_fn if k == per_call else _step_function(model, strategy, k)
                pending.append((scheduled + k - 1, coordinator.schedule(fn, args=(iterator,))))
                scheduled += k
            end, remote = pending.popleft()
            try:
                value = remote.fetch()
            except _LOST as error:
                # The step ran (its update is on the parameter servers) but
                # the worker holding its result became unreachable before
                # the chief copied it: only its numbers are lost.
                stats.lost_results += 1
                logger.warning("keras_dist: the result of steps %d-%d was lost with an "
                               "unreachable worker (%s); its update was applied, its "
                               "logs are not counted.", end - per_call + 1, end,
                               type(error).__name__)
                continue
            logs, step = _record(value, stats, model.async_log_names)
            replica_cbs.feed(watchers, end, [step])
            callbacks.on_train_batch_end(end, logs)
            if model.stop_training:
                break
        with quiet_tf_logger("WARNING"):  # join() logs at INFO on every call
            coordinator.join()
        epoch_logs = {k: pythonify(v) for k, v in model.get_metrics_result().items()}
        epoch_logs.update(stats.logs())
        epoch_logs["skipped_nonfinite"] = model._kd_version.skipped_value - skipped_before
        if aware is not None:
            epoch_logs.update(aware.staleness_logs())
        replica_cbs.add_replica_logs(watchers, epoch_logs)
        if validation_data is not None and should_eval(epoch, validation_freq):
            vx, vy, vsw = _unpack_validation(validation_data)
            val_logs = model.evaluate(
                vx, vy, sample_weight=vsw, batch_size=validation_batch_size or batch_size,
                steps=validation_steps, callbacks=callbacks, return_dict=True,
                verbose=0)
            epoch_logs.update({"val_" + k: v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs=epoch_logs)
    model._kd_async = False
    return model.history


_LOST = (tf.errors.UnavailableError,)  # seen when a worker is cut off (test_multihost)

WINDOW_PER_WORKER = 16
"""Closures scheduled ahead per worker while the chief waits on the oldest."""


def _num_workers():
    cluster = ClusterConfig.from_env()
    return len(cluster.cluster.get("worker", ())) if cluster is not None else 4


def _step_function(model, strategy, k):
    """The `tf.function` running `k` steps on a worker; cached on the model
    (like Keras' `train_function`) so later `fit` calls do not retrace."""
    # Kept in __dict__ so Keras' attribute tracking leaves it alone. Keyed by
    # the optimizer too: a new compile() must not reuse a function that
    # captured the old optimizer (Keras' compile resets train_function).
    cache = model.__dict__.setdefault("_kd_step_functions", {})
    key = (id(strategy), id(model.optimizer), model.nonfinite_updates, k,
           tuple(sorted(testing.slow_workers_from_env().items())))
    if key not in cache:
        @tf.function
        def run_steps(iterator):
            def replica_fn(data_iterator):
                return model.async_train_steps(data_iterator, k)
            return strategy.run(replica_fn, args=(iterator,))
        cache[key] = run_steps
    return cache[key]


def _record(result, stats, names):
    """Unpacks one closure's vector (see `AsyncModel.async_train_steps`):
    returns its batch logs and its `ReplicaStep`."""
    values = result.numpy() if hasattr(result, "numpy") else np.asarray(result)
    n = len(names)
    worker, seconds, examples, loss_sum = values[n:n + 4]
    taus = [int(t) for t in values[n + 4:]]
    stats.add(StepRecord(worker=int(worker), staleness=taus, seconds=float(seconds)))
    step = replica_cbs.ReplicaStep(
        replica=f"worker{int(worker)}", steps=len(taus), seconds=float(seconds),
        examples=int(examples), loss=float(loss_sum / examples) if examples else math.nan,
        staleness=tuple(taus))
    return {name: float(v) for name, v in zip(names, values[:n])}, step


def _per_worker_input(strategy, x, y, sample_weight, batch_size, shuffle,
                      class_weight, steps):
    """A per-worker `dataset_fn`, the steps of one epoch, and a sample batch."""
    if isinstance(x, tf.data.Dataset) or data_lib.is_dataset_fn(x):
        data_lib.check_nothing_beside_dataset(y, sample_weight, class_weight)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                              or steps < 1):
        raise ValueError(f"`steps_per_epoch` must be a positive integer. Received: {steps!r}.")
    if data_lib.is_dataset_fn(x):
        if steps is None:
            raise ValueError(
                "`x` is a dataset_fn, whose length keras_dist cannot know; pass "
                "`steps_per_epoch` (updates per epoch, all workers together).")
        distributed = strategy.distribute_datasets_from_function(x)
        sample = next(iter(x(tf.distribute.InputContext())))
        return distributed, steps, sample
    if isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        if steps is None:
            if cardinality < 0:
                raise ValueError(
                    "`x` is a tf.data.Dataset of unknown or infinite length; pass "
                    "`steps_per_epoch` (updates per epoch, all workers together).")
            steps = cardinality
        # A dataset object is serialized to every worker by the coordinator.
        repeated = x.repeat() if cardinality != tf.data.INFINITE_CARDINALITY else x
        return repeated, steps, next(iter(x))
    if y is not None and data_lib.num_samples((x,)) != data_lib.num_samples((y,)):
        raise ValueError("`x` and `y` have different numbers of samples.")
    batch_size = batch_size or data_lib.DEFAULT_BATCH_SIZE
    n = data_lib.num_samples((x,))
    steps = steps or math.ceil(n / batch_size)
    # Each worker reads the whole data in its own random order: in
    # asynchronous training no step boundary needs agreeing on. The pipeline
    # is built on the worker (the arrays travel as constants of this function).
    def dataset_fn():
        return data_lib.from_arrays(x, y, sample_weight, batch_size=batch_size,
                                    shuffle=shuffle, class_weight=class_weight,
                                    seed=None, repeat=True)

    sample = (x[:2],) if y is None else (x[:2], y[:2])
    return dataset_fn, steps, sample


def _unpack_validation(validation_data):
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None, None
    if not isinstance(validation_data, (tuple, list)) or not 2 <= len(validation_data) <= 3:
        raise ValueError("`validation_data` must be a tf.data.Dataset or a tuple "
                         "(x_val, y_val[, val_sample_weight]).")
    return (tuple(validation_data) + (None,))[:3]
