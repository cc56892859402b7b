"""The synchronous executor: the model's `train_step` on every replica, in step.

Keras 3's `Model.fit` fails under a multi-worker `MultiWorkerMirroredStrategy`
in two places of its own loop (keras-team/keras#20585,
tensorflow/tensorflow#72388): `_maybe_symbolic_build` asks the strategy to
reduce the whole `(x, y)` batch tuple, and `reduce_per_replica` reduces scalar
metrics along an axis they do not have. Neither is in `train_step`.

So this executor runs the model's own `train_step` / `test_step` through
`strategy.run` inside a `tf.function` (`steps_per_execution` steps per call)
and reduces each returned value with `strategy.reduce("MEAN", value,
axis=None)`, valid for tensors of any rank; epoch logs come from the metrics
read in cross-replica context (summed over every replica of every worker).
The driver (`keras_dist.training.driver`) owns epochs and callbacks.

Around the optimizer's `apply` (see `keras_dist.training.update`) each replica's
update gets Keras' one-device semantics -- clipping on the global gradient,
an unevenly split batch averaged over the global batch
(`keras_dist.training.gradients`) -- and the non-finite policy
(`keras_dist.training.nonfinite`). With `ReplicaCallback`s (or injected
slowdowns) each replica also measures its compute time before the
all-reduce, its examples and its loss, reported through
`keras_dist.training.step_report`.
"""

import contextlib
import dataclasses
import math

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import compiled
from keras_dist.training import data as data_lib
from keras_dist.training import driver
from keras_dist.training import gradients
from keras_dist.training import nonfinite as guard
from keras_dist.training import stall
from keras_dist.training import step_report
from keras_dist.training import update
from keras_dist.training.steps import StepPlanner
from keras_dist.callbacks import base as replica_cbs


class SyncExecutor(driver.Executor):
    """Runs steps of `model.train_step` under a synchronous strategy.

    Args:
        model: A `keras.Model` built and compiled in `strategy`'s scope.
        plan: The run's `keras_dist.training.plan.RunPlan`, or the strategy
            alone; see `keras_dist.training.driver.Executor`.

    Example:

    >>> import numpy as np, keras, tensorflow as tf
    >>> from keras_dist.training import driver
    >>> from keras_dist.training.sync_executor import SyncExecutor
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> executor = SyncExecutor(model, tf.distribute.get_strategy())
    >>> history = driver.fit(executor, np.ones((32, 4)), np.ones((32, 1)),
    ...                      epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2
    """

    def __init__(self, model, plan):
        super().__init__(model, plan)
        self._train_fns = self._eval_fns = None
        self._iterator = None
        self._start = 0  # the step the next epoch starts at (a resumed one: > 0)
        self._positioned = False  # the iterator is already at the next epoch's start

    # -------------------------------------------------------------- training
    def begin_training(self, train_input, callbacks):
        model = self.model
        _check_supported(model.optimizer, self.strategy, model)
        if not model.run_eagerly:
            driver.build_for_training(model, self.strategy, train_input.sample())
        faults = self.faults
        # The skip counter and the compiled steps outlive this `fit`, like
        # Keras' train_function: kept per compilation (`compiled.cached`).
        state = compiled.cached(
            model, ("sync", self.strategy, self.nonfinite_updates, faults.key if faults else ()),
            lambda: _SyncState(model, self.strategy, self.nonfinite_updates, faults))
        self.policy = state.policy
        self.policy.begin_training()
        slowed = bool(faults and faults.slowed)
        instrument = bool(replica_cbs.replica_callbacks(callbacks)) or slowed
        self._train_fns = state.train_functions(instrument)
        self._train_fns.open()
        self._iterator = iter(train_input.dataset) if train_input.repeats else None

    def release(self, failed=False):
        if self._train_fns is not None:
            self._train_fns.close()
        data_lib.release_iterator(self._iterator)
        self._iterator = None

    def seek(self, train_input, epoch, step):
        """Positions the input at `step` of 0-based `epoch` (a resumed run):
        the next epoch trains from there, on the batches an uninterrupted
        run would read (`DistributedInput.at`)."""
        data_lib.release_iterator(self._iterator)
        self._iterator = None
        self._iterator = iter(train_input.at(epoch, step))
        self._start, self._positioned = step, True

    def train_epoch(self, train_input):
        steps, fresh = train_input.steps, None
        if train_input.passes is not None:  # Keras' rule: which pass this epoch reads
            fresh, steps = train_input.passes.begin_epoch(positioned=self._positioned)
        elif not train_input.repeats and not self._positioned:
            fresh = train_input.dataset
        if fresh is not None:
            data_lib.release_iterator(self._iterator)  # last epoch's, off this thread
            self._iterator = None
            self._iterator = iter(fresh)
        start, self._start, self._positioned = self._start, 0, False
        self.ran_out = False
        self._train_fns.restart_stall_count()
        for event in self._train_fns.steps(self._iterator, steps, start=start):
            yield event
        if train_input.passes is not None:  # a dry input ends the epoch, not training
            train_input.passes.end_epoch(ran_out=self._train_fns.ran_out)
        self.ran_out = self._train_fns.ran_out and train_input.repeats

    def test_epoch(self, eval_input):
        model = self.model
        if self._eval_fns is None:
            if not model.run_eagerly:
                driver.build_for_training(model, self.strategy, eval_input.sample(),
                                          build_optimizer=False)
            # Per compilation, shared by validation in every fit and evaluate.
            self._eval_fns = compiled.cached(
                model, ("test", self.strategy),
                lambda: _StepFunctions(model, self.strategy, model.test_step))
        model.reset_metrics()
        iterator = iter(eval_input.dataset)
        try:
            yield from self._eval_fns.steps(iterator, eval_input.steps)
        finally:
            data_lib.release_iterator(iterator)
            iterator = None


class _SyncState:
    """What synchronous training keeps on a model per compilation: the
    non-finite policy's skip counter and the compiled train steps (with and
    without per-replica instrumentation)."""

    def __init__(self, model, strategy, mode, faults):
        self.model, self.strategy, self.faults = model, strategy, faults
        self.nonfinite_updates = mode
        self.policy = guard.NonFinitePolicy(mode)
        with strategy.scope():
            self.policy.build(replicated=True)
        self._functions = {}

    def train_functions(self, instrument):
        if instrument not in self._functions:
            self._functions[instrument] = _StepFunctions(
                self.model, self.strategy, self._train_replica_step,
                instrument=instrument, train=True)
        return self._functions[instrument]

    def _train_replica_step(self, data, instrument):
        """`model.train_step(data)` on one replica, with the update hook and
        the non-finite policy's loss rule (`guard.finite_loss_only`); with
        `instrument`, also this replica's packed `step_report`."""
        with guard.finite_loss_only(self.model, self.nonfinite_updates):
            return self._guarded_replica_step(data, instrument)

    def _guarded_replica_step(self, data, instrument):
        model = self.model
        examples = step_report.batch_examples(data)
        synced = [] if instrument else None
        hook = gradients.global_gradient_apply(model.optimizer, examples, self.policy, synced)
        if not instrument:
            with update.apply_hook(hook):
                return model.train_step(data)
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group, tf.float64)
        total_before, count_before = step_report.loss_state(model)
        with tf.control_dependencies([t for t in tf.nest.flatten(data) if t is not None]
                                     + [total_before, count_before]):
            start = tf.timestamp()
        with tf.control_dependencies([start]):  # the forward pass starts after it
            data = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), data)
        marks = []
        faults = self.faults

        def timed(original, grads, variables):
            # Compute time ends when this replica's gradients are ready:
            # before the all-reduce, where every replica waits for the slowest.
            flat = [t for t in tf.nest.flatten(grads, expand_composites=True) if t is not None]
            with tf.control_dependencies(flat):
                ready = tf.timestamp()
            waits = (faults.slow_down(replica, ready - start, ready) if faults else []) or [ready]
            marks.append(waits[0])
            with tf.control_dependencies(waits):
                grads = gradients.identity_all(grads)
            return hook(original, grads, variables)

        with update.apply_hook(timed):
            logs = model.train_step(data)
        with tf.control_dependencies(tf.nest.flatten(logs)):
            end = marks[-1] if marks else tf.timestamp()
            total, count = step_report.loss_state(model)
        # Waiting at the first all-reduce: from this replica's arrival (its
        # gradients ready, after any injected slowdown) to the others'.
        waited = synced[-1] - end if synced and marks else tf.constant(0.0, tf.float64)
        return logs, step_report.pack(replica, end - start, examples,
                                      total - total_before, count - count_before,
                                      waited=waited, stalled=0.0)


class _StepFunctions:
    """Compiled `steps_per_execution`-step functions over a distributed iterator."""

    def __init__(self, model, strategy, step, instrument=False, train=False):
        self.model, self._strategy, self._step = model, strategy, step
        self._functions, self._instrument, self._train = {}, instrument, train
        self._probe, self._stalled = None, 0.0  # the stall probe, for one fit (`open`)
        self.ran_out = False

    def open(self):
        """Takes the stall probe for one `fit` (instrumented steps only; see
        `keras_dist.training.stall`)."""
        if self._instrument and self._probe is None:
            self._probe = stall.StallProbe.acquire()
            self._stalled = self._probe.stalled()

    def close(self):
        """Lets the stall probe go (see `keras_dist.training.stall`)."""
        if self._probe is not None:
            self._probe, _ = None, stall.StallProbe.release()

    def _replica_fn(self):
        if not self._train:
            return self._step
        return lambda data: self._step(data, self._instrument)

    def _function(self, k):
        if k not in self._functions:
            strategy = self._strategy
            # Not converted by AutoGraph, like Keras' own step functions
            # (`do_not_convert` in its TF trainer); `run` is (tf.data
            # refuses more than 32 `next` calls in an unconverted function).
            replica_fn = tf.autograph.experimental.do_not_convert(self._replica_fn())
            if not self._instrument and k > 1 and not self.model.run_eagerly:
                self._functions[k] = self._looped(replica_fn, k)
                return self._functions[k]

            def run(iterator, stalled=None):
                records = []
                for _ in range(k):  # unrolled: k is small and fixed per function
                    outputs = strategy.run(replica_fn, args=(next(iterator),))
                    if self._instrument:
                        outputs, record = outputs
                        records.append(record)
                logs = tf.nest.map_structure(
                    lambda v: strategy.reduce("MEAN", v, axis=None), outputs)
                if not records:
                    return logs
                # One row per replica of every worker: [k steps x fields], and
                # a row with the time this worker's process stalled since the
                # last execution (`keras_dist.training.stall`; per process, not replica).
                def rows(stalled, *records):
                    extra = stalled * tf.one_hot(step_report.FIELDS.index("stalled"),
                                                 records[0].shape[0], dtype=tf.float64)
                    return tf.expand_dims(tf.stack(list(records) + [extra]), 0)

                per_replica = strategy.run(rows, args=(stalled, *records))
                return logs, strategy.gather(per_replica, axis=0)

            self._functions[k] = (
                run if self.model.run_eagerly
                else tf.function(run, jit_compile=bool(self.model.jit_compile)))
        return self._functions[k]

    def _looped(self, replica_fn, k):
        """`k` steps in a `tf.while_loop` around one compiled step, as Keras'
        own multi-step function: the model's step is traced once per replica
        whatever `k` (unrolled, it was traced k times per replica: compile
        time grew with steps_per_execution). The step's logs are reduced in
        it, so the loop carries plain tensors."""
        strategy = self._strategy
        step = self.__dict__.get("_one_step")
        if step is None:  # one for every k: the last, shorter execution reuses it

            @tf.autograph.experimental.do_not_convert
            def step(data):
                outputs = strategy.run(replica_fn, args=(data,))
                return tf.nest.map_structure(
                    lambda v: strategy.reduce("MEAN", v, axis=None), outputs)

            step = self._one_step = tf.function(step, reduce_retracing=True)

        @tf.autograph.experimental.do_not_convert
        def run(iterator):
            logs = step(next(iterator))

            def body(i, logs):
                return i + 1, step(next(iterator))

            return tf.while_loop(lambda i, _: i < k, body, (tf.constant(1), logs))[1]

        return tf.function(run)

    def _call(self, k, iterator):
        optimizer = self.model.optimizer if self._train else None
        replicas = self._strategy.num_replicas_in_sync
        with update.intercept_apply(optimizer), (
                gradients.clipping_for_replicas(optimizer, replicas) if optimizer is not None
                else contextlib.nullcontext()):
            if self._instrument:
                tracing = k not in self._functions
                stalled, self._stalled = self._stalled, self._probe.stalled()
                result = self._function(k)(
                    iterator, tf.constant(self._stalled - stalled, tf.float64))
            else:
                result = self._function(k)(iterator)
        if not self._instrument:
            return result, None
        result, rows = result
        reports = [_combine(row) for row in np.asarray(rows)]
        if tracing:
            # Tracing holds the interpreter (the probe counts it as stalled)
            # and ends at different times on each worker: these timings say
            # nothing about the workers.
            self._stalled = self._probe.stalled()
            reports = [dataclasses.replace(r, waited=math.nan, stalled=math.nan)
                       for r in reports]
        return result, reports

    def restart_stall_count(self):
        """Stalls between epochs (evaluation, callbacks) are nobody's."""
        if self._probe is not None:
            self._stalled = self._probe.stalled()

    def steps(self, iterator, total, start=0):
        """Yields `BatchBegin` before and `BatchEnd` after each execution,
        from step `start` on; stops at `total` steps or at the end of the
        data (`keras_dist.training.steps.StepPlanner`)."""
        self.ran_out = False
        planner = StepPlanner.for_model(self.model, total, start)
        if total is None and planner.per_call > 1:
            yield from self._steps_of_unknown_count(iterator, planner)
            return
        for execution in planner.executions():
            yield driver.BatchBegin(execution.begin)
            try:
                logs, reports = self._call(execution.size, iterator)
            except (tf.errors.OutOfRangeError, StopIteration):
                self.ran_out = True
                return
            steps = None if reports is None else [
                replica_cbs.ReplicaStep.from_report(r, "replica", steps=execution.size)
                for r in reports]
            yield driver.BatchEnd(execution.batch, logs, steps)

    def _steps_of_unknown_count(self, iterator, planner):
        """An input of unknown length runs one step per call, to stop exactly
        where the data ends, but the callbacks see what Keras shows them:
        one batch per `steps_per_execution` steps (begin 0, end k - 1, begin
        k, ...), the last one cut short by the end of the data, then a begin
        with no end (Keras' call after the data's end, which finds nothing)."""
        begin = planner.start
        while True:
            yield driver.BatchBegin(begin)
            if self.ran_out:
                return
            logs, calls = None, []
            for _ in range(planner.per_call):
                try:
                    logs, reports = self._call(1, iterator)
                except (tf.errors.OutOfRangeError, StopIteration):
                    self.ran_out = True
                    break
                calls.append(reports)
            if not calls:  # the data ended at a boundary: this begin has no end
                return
            steps = None if calls[0] is None else [
                _merged([replica_cbs.ReplicaStep.from_report(r, "replica", steps=1)
                         for r in same]) for same in zip(*calls)]
            yield driver.BatchEnd(planner.batch(begin), logs, steps)
            begin += planner.per_call


def _merged(steps):
    """One replica's `ReplicaStep`s of consecutive calls as one."""
    first = steps[0]
    counted = [s for s in steps if s.examples]
    examples = sum(s.examples for s in counted) if counted else first.examples
    loss = (sum(s.loss * s.examples for s in counted) / examples if counted and examples
            else first.loss)
    return dataclasses.replace(
        first, steps=sum(s.steps for s in steps), seconds=sum(s.seconds for s in steps),
        examples=examples, loss=loss, waited=sum(s.waited for s in steps),
        stalled=sum(s.stalled for s in steps))


def _check_supported(optimizer, strategy, model=None):
    """Refuses what cannot match Keras' one-device semantics here."""
    if strategy.num_replicas_in_sync < 2:
        return
    if model is not None and getattr(model, "jit_compile", False) is True:
        raise ValueError(
            f"jit_compile=True is not supported with {strategy.num_replicas_in_sync} "
            "synchronous replicas: XLA compiles one device's computation, and a step here "
            "spans every replica's device and their all-reduce (XLA fails with 'Trying to "
            "access resource ... located in device CPU:1 from device CPU:0'; Keras' own "
            "model.fit fails under MirroredStrategy too). Compile with jit_compile=False, "
            "or 'auto' (which Keras turns off under a distribution strategy), or train on "
            "one device.")
    for o in update.optimizer_chain(optimizer):
        steps = getattr(o, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"gradient_accumulation_steps={steps} ({type(o).__name__}) is not supported "
                f"with {strategy.num_replicas_in_sync} synchronous replicas: Keras 3 puts the "
                "gradient all-reduce inside a conditional, which tf.distribute refuses "
                "(Keras' own model.fit fails the same way under MirroredStrategy). Use a "
                "global batch `gradient_accumulation_steps` times larger instead (the same "
                "update for SGD-type optimizers), or train on one device.")


def _combine(rows):
    """One `StepReport` from a replica's [k, fields] rows."""
    rows = np.asarray(rows, np.float64)
    summed = rows.sum(axis=0)
    summed[0] = rows[0, 0]  # the replica index, not a sum
    return step_report.unpack(summed)
