"""The traced step asynchronous training runs on the workers.

`WorkerStep` builds, per model, the `tf.function`s that
`keras_dist.training.async_executor.AsyncExecutor` schedules through TF's
`ClusterCoordinator`: one execution of `steps_per_execution` steps of the
model's own `train_step` (or one round of local steps), each step's update
captured and applied with its staleness (`keras_dist.training.update`), its
metrics counted from zero in a `keras.StatelessScope` and returned for the
chief to sum (`keras_dist.training.chief_metrics.ChiefMetrics`), and its
report (`keras_dist.training.step_report`) returned or written to the ring
on the parameter server. It also keeps the parameter version counter and
the non-finite policy's counters, which outlive one `fit`.
"""

import contextlib
import functools

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer
from keras_dist.training import compiled
from keras_dist.training import driver
from keras_dist.training import gradients
from keras_dist.training import local_steps as local_steps_lib
from keras_dist.training import nonfinite
from keras_dist.training import sharded
from keras_dist.training import step_report
from keras_dist.training import update
from keras_dist.training.chief_metrics import ChiefMetrics, metric_variables
from keras_dist.training.staleness import VersionCounter


class WorkerStep:
    """What asynchronous training keeps on a model between `fit` calls: the
    version counter, the skip counter and the compiled step functions that
    run on the workers.

    Args:
        model: A compiled `keras.Model` created in `strategy`'s scope.
        strategy: A `tf.distribute.ParameterServerStrategy`.
        mode: The non-finite policy's mode, `"skip"` or `"raise"`.
        options: `keras_dist.training.plan.AsyncOptions`.
    """

    @classmethod
    def of(cls, model, strategy, mode, options):
        """The model's `WorkerStep` for this strategy, policy and options,
        kept per compilation (`keras_dist.training.compiled`)."""
        return compiled.cached(model, ("async", strategy, mode, options),
                               lambda: cls(model, strategy, mode, options))

    @classmethod
    def current(cls, model):
        """The `WorkerStep` the model's last asynchronous `fit` used under
        its current compilation, or `None` (for tools and tests)."""
        steps = [v for k, v in compiled.entries(model).items() if k[0] == "async"]
        return steps[-1] if steps else None

    def __init__(self, model, strategy, mode, options):
        self.model, self.strategy, self.options = model, strategy, options
        sharded.install(strategy)
        with strategy.scope():
            counter = getattr(model, "version_counter", None)
            self.version = counter if counter is not None else VersionCounter()
            self.policy = nonfinite.NonFinitePolicy(mode).build()
        model.__dict__["version_counter"] = self.version
        self._functions = {}
        self.held = {}  # worker -> the RemoteValue of its last finished execution
        self.log_names = {}
        self.metrics = None
        self.ring = None

    def build(self, sample_batch):
        """Creates optimizer and metric state before training (variables
        cannot be created inside the scheduled functions)."""
        driver.build_for_training(self.model, self.strategy, sample_batch)
        if self.metrics is None or self.metrics.variables != metric_variables(self.model):
            self.metrics = ChiefMetrics(self.model)
        sharded.prepare(self.model)

    def compiled_functions(self):
        """Every `tf.function` this `WorkerStep` holds: the step functions
        and the chief's metric functions (`experimental_get_tracing_count`
        on each tells what was traced; for tools and tests)."""
        functions = list(self._functions.values())
        if self.metrics is not None:
            functions += self.metrics.compiled_functions()
        return functions

    def ring_for(self, per_call, window):
        """The `step_report.ReportRing` for executions of up to `per_call`
        steps with `window` of them in flight (made anew when too small)."""
        width = (step_report.ReportRing.HEADER + self.metrics.size + self.options.ring_logs
                 + len(step_report.FIELDS) + per_call)
        ring = self.ring
        if ring is None or ring.width < width or ring.capacity < 4 * window:
            # Colocated with the version counter: a variable_partitioner
            # never splits a colocated variable.
            with self.strategy.scope(), \
                    self.strategy.extended.colocate_vars_with(self.version.variable):
                self.ring = step_report.ReportRing(width, 4 * window)
        return self.ring

    def step_function(self, k, faults, local=0, outer=None, elastic=None, ring=None):
        """The `tf.function` running `k` steps on a worker (with `local`, the
        local steps of a round: rounds of local steps,
        `keras_dist.training.local_steps`); cached (like Keras'
        `train_function`) so later epochs and `fit` calls do not retrace;
        a new compile() makes a new `WorkerStep` (`of`). Keyed by the
        objects the function captures (compared by identity)."""
        key = (k, faults.key if faults else (), local, outer, elastic, ring)
        if key not in self._functions:
            strategy = self.strategy

            # Not converted by AutoGraph, like Keras' own step functions
            # (`do_not_convert` in its TF trainer): the same `train_step`
            # semantics, and no conversion of it on the first call.
            @tf.autograph.experimental.do_not_convert
            def replica_fn(*batches):
                if local:
                    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
                    return local_steps_lib.local_round(self, batches, worker, faults, outer,
                                                       elastic, per_round=local)
                return self._replica_steps(batches, k, faults, ring)

            # Converted by AutoGraph only here (tf.data refuses more than 32
            # `next` calls in one unconverted function).
            @tf.function
            def run_steps(iterator):
                # Batches are taken outside strategy.run: a distributed
                # dataset_fn's iterator refuses next() inside the replica fn.
                batches = [next(iterator) for _ in range(k)]
                # With a ring the report is written there: nothing to keep
                # on the worker or to copy (`None`).
                return strategy.run(replica_fn, args=tuple(batches))

            self._functions[key] = run_steps
        return self._functions[key]

    # ------------------------------------------------------ on the worker
    def _replica_steps(self, batches, k, faults, ring=None):
        """`k` steps on a worker and their report: written to `ring` (then
        `None` is returned; only where every update runs on one parameter
        server) or returned as a packed vector."""
        model = self.model
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        start, batches = step_report.start_clock(batches)
        taus, writes, skips, step_logs, homes, ready = [], [], [], {}, [], []
        examples = tf.constant(0.0, tf.float64)
        # The metrics' state, from zero, summed over the k steps on the worker;
        # the chief adds it up (`ChiefMetrics`): no metric round trips here.
        metrics = [tf.zeros(v.shape, v.dtype) for v in self.metrics.variables]
        # With every weight on one parameter server, each update runs there
        # (`gradients.ship_gradients`) and its tau stays there until the end.
        planned = gradients.home_device(model.trainable_variables) if self.options.ship_gradients else None
        carry = shipped = None
        if ring is not None and planned is not None:
            total = tf.add_n([tf.cast(step_report.batch_examples(b), tf.float64)
                              for b in batches])

            def carry(step_logs, new_metrics, computed):
                # The whole report, but its taus and skips, goes with the
                # last step's gradients: no transfer of its own (a transfer
                # of its own after the last step ran at 2/3 the rate at
                # steps_per_execution 10).
                loss_sum, loss_count = self.metrics.loss_state(new_metrics)
                logs, names = local_steps_lib.scalar_logs(step_logs)
                with tf.control_dependencies(computed):
                    seconds = tf.timestamp() - start
                report = step_report.pack(
                    worker, seconds, total, loss_sum,
                    loss_count, (), logs, names, state=new_metrics, claimed=seconds)
                return report if ring.fits(report, extra=1 + k) else None
        for i, data in enumerate(batches):
            last_carry = carry if i == len(batches) - 1 else None
            if planned is not None:
                # No control edges from the worker into the step (each
                # would cost a transfer to the parameter server): TF's
                # automatic control dependencies already order each read of
                # a variable after the previous step's write of it, the
                # version's read after the previous claim included.
                if taus:
                    with tf.control_dependencies(ready):
                        step_start = tf.timestamp()
                else:
                    step_start = start
                step = self._one_step(data, worker, step_start, faults, metrics, last_carry)
                if last_carry is not None:
                    shipped, step = step[-1], step[:-1]
            else:
                with tf.control_dependencies([start] + taus):
                    step_start = tf.timestamp() if taus else start
                    step = self._one_step(data, worker, step_start, faults, metrics)
            tau, step_writes, step_logs, metrics, step_skipped, home, ready = step
            if step_skipped is not None:
                skips.append(step_skipped)
            taus.append(tau)
            homes.append(home)
            writes += step_writes
            examples += step_report.batch_examples(data)
        loss_sum, loss_count = self.metrics.loss_state(metrics)
        logs, names = local_steps_lib.scalar_logs(step_logs)
        self.log_names[k] = names
        if planned is not None and set(homes) == {planned}:
            if shipped is not None:
                ring.write(shipped, k, taus=taus, skipped=skips)
                return None
            if ring is not None:
                # The worker's part of the report ends when its last
                # gradients leave it; the parameter server adds the taus
                # and skips and keeps the row.
                with tf.control_dependencies(ready + writes):
                    seconds = tf.timestamp() - start
                report = step_report.pack(worker, seconds, examples, loss_sum, loss_count,
                                          (), logs, names, state=metrics, claimed=seconds)
                if ring.fits(report, extra=1 + k):
                    ring.write(report, k, taus=taus, skipped=skips)
                    return None
            # The taus and skips come back in one transfer.
            with tf.device(planned):
                back = tf.stack([tf.cast(t, tf.float64) for t in taus]
                                + [tf.add_n(skips) if skips else tf.constant(0.0, tf.float64)])
            taus, skipped = tf.unstack(back)[:k], back[k]
            with tf.control_dependencies([back]):
                claimed = tf.timestamp() - start
            # After the claim's own timestamp: `claimed <= seconds` always.
            with tf.control_dependencies(writes + [claimed]):
                seconds = tf.timestamp() - start
        else:
            with tf.control_dependencies(taus):
                claimed = tf.timestamp() - start
            with tf.control_dependencies(writes + [claimed]):
                seconds = tf.timestamp() - start
            skipped = tf.add_n(skips) if skips else 0
        return step_report.pack(worker, seconds, examples, loss_sum, loss_count, taus,
                                logs, names, state=metrics, skipped=skipped, claimed=claimed)

    def _one_step(self, data, worker, step_start, faults, metrics, carry=None):
        """`model.train_step(data)` with the version read with its weights and
        the update claimed and applied after it (a slowed worker sleeps before
        the claim: `factor - 1` times the time since `step_start`); the
        metrics' state starts at `metrics` (tensors). Returns `(tau, state
        writes, the step's logs, the metrics' new state, skipped, home,
        ready)`; skipped is a float64 0/1 tensor when the policy gated the
        update, else `None`; home is the device the update ran on when the
        gradients were shipped there (`gradients.ship_gradients`), else `None`;
        ready are the gradients as the worker computed them. With `carry`, a
        function of `(step logs, metrics' state, ready)` giving a float64
        vector (or `None`), that vector travels with shipped gradients and is
        returned as it arrived on `home` (else `None`) as an eighth item."""
        model, optimizer = self.model, self.model.optimizer
        read = self.version.read()
        slowed = bool(faults and faults.slowed)
        # The version is read in the same round trip as the weights: no
        # control edge orders them (each would cost a transfer), so tau counts
        # the claims between this read and this step's claim.
        pulled, after_read = None, []
        if _needs_pulled(optimizer):
            # The weights this gradient is computed on, for DC-ASGD / Gap-Aware:
            # read right after the version and before the forward pass's reads.
            with tf.control_dependencies([read]):
                pulled = [tf.identity(w.value.read_value()) for w in model.trainable_weights]
            after_read = pulled
        metric_vars = self.metrics.variables
        metric_ids = {id(v) for v in metric_vars}
        captured = []

        def capture(original, grads, variables):
            captured.append((original, grads, variables))

        with tf.control_dependencies(after_read):
            # Integer state the step may count up (a counter of the user's
            # train_step, a seed generator's) is read here and written back
            # as the increment, so that two workers' increments add up; other
            # state a step assigns (BatchNormalization's moving statistics)
            # is written back as its new value: the last write wins.
            counters = [v for v in model.non_trainable_variables
                        if id(v) not in metric_ids and tf.as_dtype(v.dtype).is_integer]
            counted = [tf.identity(v.value.read_value()) for v in counters]
            with keras.StatelessScope(list(zip(metric_vars, metrics))
                                      + list(zip(counters, counted)),
                                      collect_losses=True) as scope:
                before = {id(v): scope.get_current_value(v) for v in counters}
                with update.apply_hook(capture):
                    step_logs = model.train_step(data)
        if len(captured) != 1:
            raise ValueError(
                f"Under parameter servers, {type(model).__name__}.train_step must apply "
                "its update with `self.optimizer.apply(...)` (or `apply_gradients`) "
                f"exactly once per step; it called it {len(captured)} times. keras_dist "
                "claims the parameter version and applies the update there.")
        original, grads, variables = captured[0]
        grads = list(grads)
        ready = [t for t in tf.nest.flatten(grads, expand_composites=True) if t is not None]
        if slowed:  # this step takes `factor` times as long
            ready = local_steps_lib.after_slowdown(faults, worker, step_start, ready)
            with tf.control_dependencies(ready):
                grads = gradients.identity_all(grads)
        # When every weight lives on one parameter server, the gradients go
        # there in one transfer and the whole update (claim, non-finite
        # check, optimizer math) runs there on local tensors: one transfer
        # per gradient and the learning rate's fewer.
        computed = ready
        home = gradients.home_device(variables) if self.options.ship_gradients else None
        state = [(v, scope.get_current_value(v)) for v in model.variables
                 if id(v) not in metric_ids and scope.get_current_value(v) is not None
                 and scope.get_current_value(v) is not before.get(id(v))]
        metrics = [scope.get_current_value(v) for v in metric_vars]
        shipped = None
        if home is not None:
            extra = carry(step_logs, metrics, computed) if carry and not state else None
            grads, shipped = gradients.ship_gradients(grads, home, extra=extra)
            ready = [t for t in tf.nest.flatten(grads, expand_composites=True)
                     if t is not None]
        with tf.device(home) if home is not None else contextlib.nullcontext():
            # The claim waits for the gradients through one small data
            # dependency (control edges across hosts cost a transfer each).
            with tf.control_dependencies(ready):
                one = tf.ones([], tf.int64)
            tau = self.version.claim(read, one)
            info = update.UpdateInfo(staleness=tau, pulled=pulled, worker=worker)
            skipped = self.policy.apply(functools.partial(update.apply_with, info, original),
                                        grads, variables, optimizer=optimizer, gate=True)

        writes = [v.value.assign_add(new - before[id(v)]) if id(v) in before
                  else v.value.assign(new) for v, new in state]
        if carry is not None:
            return tau, writes, step_logs, metrics, skipped, home, computed, shipped
        return tau, writes, step_logs, metrics, skipped, home, computed


def _needs_pulled(optimizer):
    for candidate in update.optimizer_chain(optimizer):
        if isinstance(candidate, StalenessAwareOptimizer) and candidate.needs_pulled_weights:
            return True
    return False
