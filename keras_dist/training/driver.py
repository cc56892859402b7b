"""The epoch driver: `keras.Model.fit`'s contract, for every executor.

Where Keras' own `model.fit` works (one device) keras_dist calls it. Where it
does not -- several synchronous replicas, parameter servers -- this driver
owns what `fit` promises: callbacks with the progress bar and `History`,
validation (`validation_split`, `validation_data`, `validation_freq`),
`initial_epoch` (and a restoring `BackupAndRestore`), `stop_training`, and
the optimizer's `finalize_variable_values` at the end (EMA weights). It
asks an executor for the steps:

- `keras_dist.training.sync_executor.SyncExecutor`: `strategy.run(model.train_step)`
  plus the gradient all-reduce (Mirrored, MultiWorkerMirrored);
- `keras_dist.training.async_executor.AsyncExecutor`: closures of the model's
  `train_step` scheduled through `ClusterCoordinator` (parameter servers).

An executor has `train_input(...)` / `eval_input(...)` (returning an object
with `.steps`), `begin_training(train_input, callbacks)`,
`begin_epoch()`, `train_epoch(train_input)` yielding
`BatchBegin(batch)` / `BatchEnd(batch, logs, replica_steps)`; the model is
`executor.model`, `ran_out`,
`epoch_logs(last_logs)`, `evaluate(eval_input, callbacks)` and
`end_training()`; the layering follows Keras' own (`trainer.py` for the
contract, `epoch_iterator.py` for the data, the backend trainer for one
step).
"""

import abc
import dataclasses
import types
import warnings
from typing import Any, List, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import compiled
from keras_dist.training import data as data_lib
from keras_dist.training import nonfinite as guard
from keras_dist.training import plan as plan_lib
from keras_dist.callbacks import base as replica_cbs


@dataclasses.dataclass(frozen=True)
class BatchBegin:
    """An execution is about to run (or was scheduled) at `batch`."""

    batch: int


@dataclasses.dataclass(frozen=True)
class BatchEnd:
    """An execution ending at `batch` is done; `logs` are Keras' batch logs."""

    batch: int
    logs: dict
    replica_steps: Optional[List[Any]] = None


class Executor(abc.ABC):
    """The protocol the epoch driver runs (see the module docs).

    The driver calls, in order: `train_input` and `begin_training` once;
    per epoch `begin_epoch`, `train_epoch` (a generator of `BatchBegin` /
    `BatchEnd` events; the driver turns them into Keras' batch hooks), then
    `epoch_logs`, and `evaluate` for validation; `end_training` and
    `release` at the end (however training ended). `drain`, `seek`,
    `position`, `metric_state` and `restore_metrics` serve preemption and
    `BackupAndRestore`. Executors call no callback hooks themselves: they
    hand what replica callbacks need (`BatchEnd.replica_steps`) to the
    driver, which feeds them.

    Args:
        model: A compiled `keras.Model` created in the plan's strategy's scope.
        plan: The run's `keras_dist.training.plan.RunPlan` (its strategy,
            cluster, non-finite policy, faults, local steps, options), or a
            `tf.distribute.Strategy` for a plan with nothing else in it.
    """

    parameter_server = False

    def __init__(self, model, plan):
        if isinstance(plan, tf.distribute.Strategy):
            plan = plan_lib.RunPlan(strategy=plan)
        self.model, self.plan, self.strategy = model, plan, plan.strategy
        self.nonfinite_updates = guard.NonFinitePolicy(plan.nonfinite_updates or "skip").mode
        self.faults = plan.faults
        self.cluster = plan.cluster
        # The task that leads (the chief, or worker 0 without one); without a
        # cluster description, the strategy knows (only the leader checkpoints).
        self.is_chief = plan.is_chief
        self.ran_out = False
        self.policy = None  # a guard.NonFinitePolicy, from begin_training on

    @abc.abstractmethod
    def begin_training(self, train_input, callbacks):
        """Builds what training needs (compiled steps, counters) once per `fit`."""

    @abc.abstractmethod
    def train_epoch(self, train_input):
        """Runs one epoch; yields `BatchBegin` and `BatchEnd` events."""

    @abc.abstractmethod
    def test_epoch(self, eval_input):
        """Runs evaluation over `eval_input` (metrics reset first); yields
        `BatchBegin` and `BatchEnd` events like `train_epoch`."""


    make_train_input = staticmethod(data_lib.distribute)
    """`f(strategy, x, y, sample_weight, **kwargs)` building the training input."""

    @property
    def eval_strategy(self):
        """The strategy validation and evaluation run under."""
        return self.strategy

    def train_input(self, x, y, sample_weight, resumable=False, **kwargs):
        """`resumable`: a backup may resume this run mid-epoch, so arrays are
        read as an epoch stream (`data_lib.epoch_stream`), positioned exactly
        by `DistributedInput.at`."""
        if resumable and not self.parameter_server:
            kwargs["stream"] = True
        return self.make_train_input(self.strategy, x, y, sample_weight, **kwargs)

    def eval_input(self, x, y, sample_weight, *, batch_size, steps, what="x"):
        return data_lib.distribute(self.eval_strategy, x, y, sample_weight,
                                   batch_size=batch_size, shuffle=False, steps=steps, what=what)

    def reset_metrics(self):
        """Resets the metrics before an epoch (Keras' `reset_metrics`)."""
        self.model.reset_metrics()

    def begin_epoch(self):
        self.policy.begin_epoch()

    def epoch_logs(self, last_logs):
        """Keras' epoch logs, plus `skipped_nonfinite` once anything was skipped."""
        logs = metrics_or_logs(self.model, last_logs)
        logs.update(self.policy.epoch_logs())
        return logs

    def end_training(self):
        pass

    def drain(self):
        """Stops starting steps; returns whether steps are still in flight
        (their batch ends are still to come from `train_epoch`)."""
        return False

    def seek(self, train_input, epoch, step):
        """Positions training at `step` of 0-based `epoch` (a restored backup)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume mid-epoch.")

    def metric_state(self):
        """The metrics' state of the epoch so far (`metric_state`)."""
        return metric_state(self.model)

    def position(self, step, version):
        """The step a backup taken after `step` steps of the epoch resumes
        at (`version`: the parameter version read for it, or `None`)."""
        return step

    def restore_metrics(self, values):
        """Puts the metrics' state of a backup taken mid-epoch back (after the
        epoch's reset), so the epoch's logs count every step of it."""
        assign_metric_state(self.model, values)

    def release(self, failed=False):
        """Frees what training held (threads, probes), however it ended
        (`failed`: an exception ends the `fit`)."""


def _batch_ends(events, on_batch_begin):
    """An executor's `BatchEnd` events; each `BatchBegin` goes to `on_batch_begin`."""
    for event in events:
        if isinstance(event, BatchBegin):
            on_batch_begin(event.batch)
        else:
            yield event


def run_evaluation(executor, eval_input, callbacks):
    """One evaluation pass: Keras' test hooks around the executor's
    `test_epoch` events (executors call no callback themselves). Returns
    Keras' logs: the metrics' results, else the last batch's."""
    # A callback may end the pass early by setting `model.stop_evaluating`,
    # as in Keras' `evaluate` (which also sets it to False first).
    executor.model.stop_evaluating = False
    callbacks.on_test_begin()
    logs = {}
    events = executor.test_epoch(eval_input)
    try:
        for event in _batch_ends(events, callbacks.on_test_batch_begin):
            logs = event.logs
            callbacks.on_test_batch_end(event.batch, logs)
            if executor.model.stop_evaluating:
                break
    finally:
        events.close()  # its iterator released now, not when collected
    logs = metrics_or_logs(executor.model, logs)
    callbacks.on_test_end(logs)
    return logs


def resolve_verbose(verbose, parameter_server, is_chief=True):
    """Keras' rule: "auto" is 1, or 2 under parameter servers (one line per
    epoch: batch results arrive from many workers out of step). Only the task
    that leads shows a live progress bar: on the others "auto" and 1 are 2
    (one line per epoch), so a cluster's log is not every worker's bar
    interleaved."""
    if verbose == "auto":
        verbose = 2 if parameter_server else 1
    if verbose == 1 and not is_chief:
        return 2
    return verbose


def fit(executor, x=None, y=None, *, batch_size=None, epochs=1,
        verbose="auto", callbacks=None, validation_split=0.0,
        validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None,
        validation_steps=None, validation_batch_size=None,
        validation_freq=1):
    """Trains `executor.model`; `keras.Model.fit`'s arguments and result.

    The model must have been built and compiled inside the executor's
    strategy scope. Returns the `keras.callbacks.History`.
    """
    model = executor.model
    verbose = resolve_verbose(verbose, executor.parameter_server, executor.is_chief)
    epochs = _keras_limit(epochs, "max_epochs", "Limiting epochs to %d")
    steps_per_epoch = _keras_limit(steps_per_epoch, "max_steps_per_epoch",
                                   "Limiting steps_per_epoch to %d")
    validation_steps = _keras_limit(validation_steps, "max_steps_per_epoch",
                                    "Limiting steps_per_epoch to %d")
    data_lib.check_fit_counts(
        batch_size=batch_size, epochs=epochs, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
        validation_batch_size=validation_batch_size, validation_freq=validation_freq)
    if validation_split and validation_data is None:
        if isinstance(x, tf.data.Dataset) or data_lib.is_dataset_fn(x):
            raise ValueError(
                "`validation_split` is only supported for array inputs. Pass "
                "`validation_data` instead.")
        (x, y, sample_weight), validation_data = data_lib.split_validation(
            (x, y, sample_weight), validation_split)
    train = executor.train_input(
        x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
        class_weight=class_weight, steps=steps_per_epoch,
        resumable=plan_lib.backs_up(callbacks))
    val = None
    if validation_data is not None:
        vx, vy, vsw = data_lib.unpack_validation(validation_data)
        val = executor.eval_input(vx, vy, vsw, batch_size=validation_batch_size or batch_size,
                                  steps=validation_steps, what="validation_data")

    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0,
            verbose=verbose, epochs=epochs, steps=train.steps, model=model)
    watchers = replica_cbs.replica_callbacks(callbacks)
    replica_cbs.bind_plan(callbacks, executor.plan)
    logs, epoch_logs, training_logs = {}, {}, None
    epoch = initial_epoch
    # Whatever ends this `fit`, the executor lets go of what it holds
    # (threads, probes, iterators) and the model of the executor; an
    # exception also ends the callbacks that hold something past `fit`
    # (a BackupAndRestore's signal handlers and lock), since Keras calls no
    # `on_train_end` then.
    failed = False
    try:
        executor.begin_training(train, callbacks)
        # A TerminateOnNaN sees a skipped update's batch as Keras shows it.
        shown = (guard.NonFiniteShown(executor.policy) if guard.watches_nonfinite(callbacks)
                 else None)
        model.stop_training = False
        model.__dict__["_kd_loop"] = True  # keras_dist's loop: resumes mid-epoch
        model.__dict__["_kd_executor"] = executor  # a backup reads the metric state there
        try:
            callbacks.on_train_begin()
        finally:
            model.__dict__.pop("_kd_loop", None)
        # Set by a restoring callback (BackupAndRestore), as Keras' own loop reads it.
        initial_epoch = _compat.initial_epoch(model) or initial_epoch
        epoch = initial_epoch
        # Where a restored backup stands: step and metric state within the epoch.
        resume = model.__dict__.pop("_kd_resume", None)
        if resume is not None:
            executor.seek(train, initial_epoch, resume["step"])
        for epoch in range(initial_epoch, epochs):
            executor.reset_metrics()
            executor.begin_epoch()
            if resume is not None and resume["step"]:
                executor.restore_metrics(resume["metrics"])
                # Resumed after its last step (preempted in validation): the
                # epoch's logs are the restored metrics'.
                logs = None
            resume = None
            callbacks.on_epoch_begin(epoch)
            for event in _batch_ends(executor.train_epoch(train),
                                     callbacks.on_train_batch_begin):
                logs = event.logs
                if event.replica_steps:
                    replica_cbs.feed(watchers, event.batch, event.replica_steps)
                callbacks.on_train_batch_end(
                    event.batch, logs if shown is None else shown.logs(logs))
                if model.stop_training:
                    break
                if "_kd_preempt" in model.__dict__:
                    # Preempted: no new step; what is in flight finishes
                    # (its batch ends still reach the callbacks).
                    if not executor.drain():
                        break
            preempt = model.__dict__.pop("_kd_preempt", None)
            if preempt is not None:
                preempt()  # BackupAndRestore: saves here and exits
            if executor.ran_out:
                warnings.warn(
                    "Your input ran out of data; interrupting training. Make sure "
                    "it can generate at least `steps_per_epoch * epochs` batches "
                    f"({train.steps} * {epochs}); use `.repeat()` on a dataset.",
                    stacklevel=2)
                model.stop_training = True
            epoch_logs = executor.epoch_logs(logs)
            # Before validation, which reuses the loss tracker.
            guard.judge_epoch(model, epoch_logs, executor.nonfinite_updates, callbacks, epoch)
            replica_cbs.add_replica_logs(watchers, epoch_logs)
            if val is not None and data_lib.should_eval(epoch, validation_freq):
                val_logs = run_evaluation(executor, val, callbacks)
                epoch_logs.update({"val_" + k: v for k, v in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if model.stop_training:
                break
        executor.end_training()
    except BaseException as error:
        failed = True
        try:
            replica_cbs.end_after_error(callbacks)
        finally:
            if isinstance(error, tf.errors.OpError):
                guard.raise_if_nonfinite(error, epoch)  # keras_dist's own error, not TF's
        raise
    finally:
        executor.release(failed=failed)
        model.__dict__.pop("_kd_executor", None)
        model.__dict__.pop("_kd_resume", None)
    if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history


def evaluate(executor, x=None, y=None, *, batch_size=None,
             verbose="auto", sample_weight=None, steps=None, callbacks=None,
             return_dict=False):
    """Evaluates `executor.model`; `keras.Model.evaluate`'s arguments."""
    model = executor.model
    verbose = resolve_verbose(verbose, False, executor.is_chief)
    steps = _keras_limit(steps, "max_steps_per_epoch", "Limiting steps_per_epoch to %d")
    data_lib.check_fit_counts(batch_size=batch_size, steps=steps)
    val = executor.eval_input(x, y, sample_weight, batch_size=batch_size, steps=steps)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
            steps=val.steps, model=model)
    logs = run_evaluation(executor, val, callbacks)
    if return_dict:
        return logs
    values = [logs[name] for name in ordered_names(model, logs)]
    return values[0] if len(values) == 1 else values


def _keras_limit(value, setting, message):
    """`value` capped by Keras' debugging limit `keras.config.<setting>()`
    (`set_max_epochs`, `set_max_steps_per_epoch`, or the `KERAS_MAX_*`
    variables), with Keras' warning; a `None` value (no count given) takes
    the limit, as Keras' epoch iterator does."""
    limit = getattr(keras.config, setting, lambda: None)()
    if limit and (value is None or limit < value):
        if value is not None or setting == "max_steps_per_epoch":
            warnings.warn(message % limit, stacklevel=3)
        return limit
    return value


def predict_here(model, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`keras.Model.predict` computed in this process alone (`kd.predict`).

    The batches of `x` go through one compiled call of the model each,
    traced once (`reduce_retracing`: a smaller last batch reuses it), in
    the model's strategy's cross-replica context: each distributed
    variable reads this process's copy, so no replica or worker waits for
    another. Callbacks see Keras' `on_predict_*` calls.
    """
    from keras_dist.training import sharded

    dist = model.distribute_strategy
    if isinstance(dist, tf.distribute.ParameterServerStrategy):
        sharded.prepare(model)  # embedding lookups read only the rows they need
    data_lib.check_fit_counts(batch_size=batch_size, steps=steps)
    if isinstance(x, tf.data.Dataset):
        dataset = x
    elif isinstance(x, (keras.utils.PyDataset, types.GeneratorType)):
        # Read as Keras' predict reads them (its own data adapter).
        dataset = _compat.keras_data_adapter(x, class_weight=None,
                                             shuffle=False).get_tf_dataset()
    else:
        # A list of arrays is several inputs, as in Keras (not one tensor):
        # packed as Keras packs `x` alone, so three inputs are not read as
        # (x, y, sample_weight).
        dataset = tf.data.Dataset.from_tensor_slices(keras.utils.pack_x_y_sample_weight(
            keras.tree.lists_to_tuples(x))).batch(batch_size or 32)
    if steps is not None:
        dataset = dataset.take(steps)
    total = int(dataset.cardinality())
    total = total if total >= 0 else None
    verbose = resolve_verbose(verbose, False, True)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=total,
            model=model)
    # Compiled once per compilation, as Keras keeps its predict_function.
    function = compiled.cached(model, "predict", lambda: tf.function(
        lambda batch: model(batch, training=False), reduce_retracing=True))
    model.stop_predicting = False  # a callback may set it, as in Keras' predict
    callbacks.on_predict_begin()
    outputs = []
    with dist.scope():
        for step, batch in enumerate(dataset):
            callbacks.on_predict_batch_begin(step)
            out = function(keras.utils.unpack_x_y_sample_weight(batch)[0])
            outputs.append(tf.nest.map_structure(lambda t: t.numpy(), out))
            callbacks.on_predict_batch_end(step, {"outputs": outputs[-1]})
            if model.stop_predicting:
                break
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("keras_dist.predict: `x` gave no batches (empty input, or steps=0); "
                         "pass at least one row.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


def build_for_training(model, strategy, sample_batch, build_optimizer=True):
    """Creates the optimizer's and the metrics' state from one sample batch.

    Evaluation passes `build_optimizer=False`: it needs no optimizer state,
    and an optimizer must be built in its own strategy's scope (under
    parameter servers the chief evaluates under the default strategy).

    What Keras' own `fit` does before its first compiled step (its symbolic
    build): variables cannot be created inside a compiled step function, on
    parameter servers nor under `tf.distribute` in general. The metrics are
    reset afterwards.
    """
    import keras as keras_lib

    with strategy.scope():
        # As Keras' symbolic build: only what is not built yet, and the loss
        # with training=False (an overridden compute_loss sees what Keras
        # shows it, nothing more).
        # (Keras' own check reads its compiled loss and metrics containers,
        # which it does not export: the per-output loss trackers of a
        # multi-output model are not among `model.metrics`.)
        unbuilt = not model.built or any(
            not getattr(m, "built", True)
            for m in [*model.metrics, *_compat.compiled_loss_and_metrics(model)])
        if unbuilt:
            # On symbolic tensors, as Keras does (an overridden `compute_loss`
            # may assert `training` outside Keras' symbolic scope).
            symbolic = tf.nest.map_structure(
                lambda v: None if v is None else keras_lib.KerasTensor(
                    tuple(v.shape), keras_lib.backend.standardize_dtype(v.dtype)),
                sample_batch)
            x, y, sample_weight = keras_lib.utils.unpack_x_y_sample_weight(symbolic)
            y_pred = _compat.symbolic_call(model, x, training=False)
            # Only the containers compile() made and that are not built yet,
            # as Keras: without a compiled loss Keras calls no compute_loss
            # here (a model whose only loss is its own add_loss has none).
            metrics, loss = _compat.compiled_metrics(model), _compat.compiled_loss(model)
            if metrics is not None and not getattr(metrics, "built", True):
                _compat.symbolic_call(model.compute_metrics, x, y, y_pred,
                                      sample_weight=sample_weight)
            if loss is not None and not getattr(loss, "built", True):
                _compat.symbolic_call(model.compute_loss, x=x, y=y, y_pred=y_pred,
                                      sample_weight=sample_weight, training=False)
        if build_optimizer and model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.reset_metrics()


def metric_state(model):
    """The model's metric variables' values, in `model.metrics_variables` order
    (a mid-epoch backup keeps them)."""
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.metrics_variables]


def assign_metric_state(model, values):
    """Writes `metric_state` values back; a count mismatch is refused."""
    variables = model.metrics_variables
    held, have = len(values), len(variables)
    if held != have:
        raise ValueError(
            f"The backup holds the state of {held} metric variables; this model's "
            f"metrics have {have}. Compile the model with the metrics it was "
            "backed up with.")
    for variable, value in zip(variables, values):
        variable.assign(value)


def reads_batch_logs(callbacks):
    """Whether any callback may read `on_train_batch_end`'s logs.

    Keras' own default callbacks do not (`History`; the progress bar except
    at `verbose=1`), nor do keras_dist's `ReplicaCallback`s (fed
    `ReplicaStep`s); any other callback overriding a train-batch hook may.
    """
    plain = (keras.callbacks.Callback.on_train_batch_end,
             replica_cbs.ReplicaCallback.on_train_batch_end)
    for cb in getattr(callbacks, "callbacks", callbacks) or ():
        if getattr(cb, "_kd_ignores_batch_logs", False):  # counts steps, reads no logs
            continue
        if isinstance(cb, keras.callbacks.ProgbarLogger):
            if getattr(cb, "verbose", 1) == 1:
                return True
            continue
        if (type(cb).on_train_batch_end not in plain
                or type(cb).on_batch_end is not keras.callbacks.Callback.on_batch_end):
            return True
    return False


def metrics_or_logs(model, logs, metric_logs=None):
    """Keras' rule: the model's metrics when the step returned exactly them.

    Reading the metrics in cross-replica context aggregates their state over
    every replica of every worker (or reads it on the parameter servers).
    Where a step returned other names too, each returned name that is a
    metric's still reads the metric (what one device would have returned:
    a replica's own `result()` covers only its share), and the others keep
    the step's value. Values come back as Python floats, as in Keras'
    epoch logs. `metric_logs`: the metrics' results where the caller has
    them (else read from the model's metrics).
    """
    if metric_logs is None:
        metric_logs = model.get_metrics_result()
    if logs is None:  # no step ran in this process (see `fit`)
        logs = metric_logs
    logs = flatten_logs(logs) if isinstance(logs, dict) else {}
    if set(logs) == set(metric_logs):
        logs = metric_logs
    else:  # a step returning some metrics' results and other values
        logs = {name: metric_logs.get(name, value) for name, value in logs.items()}
    return {name: pythonify(value) for name, value in logs.items()}


def flatten_logs(logs):
    """Nested dicts of logs (e.g. `{"compile_metrics": {"accuracy": ...}}`, as
    a `train_step` returning every metric's `result()` gives) flattened into
    one level, as Keras' own loop does."""
    flat = {}
    for name, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[name] = value
    return flat


def pythonify(value):
    value = value.numpy() if hasattr(value, "numpy") else value
    return float(value) if np.ndim(value) == 0 else value


def ordered_names(model, logs):
    """Keras' order of `evaluate`'s list result (`_flatten_metrics_in_order`):
    the model's metrics, the compiled ones expanded in compile order (`loss,
    mse, mae` for `metrics=["mse", "mae"]`), then any other name sorted."""
    names = []
    for metric in model.metrics:
        inner = getattr(metric, "metrics", None)  # Keras' compiled metrics container
        if isinstance(inner, (list, tuple)) and all(
                isinstance(m, keras.metrics.Metric) for m in inner):
            names += [m.name for m in inner]
        else:
            names.append(metric.name)
    first = [name for name in dict.fromkeys(names) if name in logs]
    return first + sorted(set(logs) - set(first))
