"""The asynchronous executor: the model's `train_step` on parameter servers.

Keras 3 has no parameter-server support (keras-team/keras#18624). This
executor drives the model's own `train_step` -- Keras' or a user's override --
through TF's public `tf.distribute.coordinator.ClusterCoordinator`: each
scheduled closure runs `steps_per_execution` steps on whichever worker is
free, and each step's update is applied on the parameter servers without
waiting for anyone. The driver (`keras_dist.training.driver`) keeps Keras' callbacks,
progress bar and `History`; batch-level hooks fire as the closures' results
come back (`on_train_batch_begin` when a closure is scheduled,
`on_train_batch_end` when its report is read, in the order the executions
finished). Progress is what has finished, never what was scheduled first
(`keras_dist.training.inflight`): a stopped worker holds back only its own step,
which is replaced once judged stuck and counts when it lands.

Around each `train_step` the executor adds, explicitly:

- the parameter version, read together with the weights (same round trip,
  no ordering edge between them) and claimed once the step's gradients
  are ready, so each update knows its staleness tau: the updates other
  workers claimed between this step's read and its claim;
- the update: the step's call of `optimizer.apply` is captured and applied
  once the step returns, with tau, the pulled weights and the worker handed
  to staleness-aware optimizers as data (`keras_dist.training.update.UpdateInfo`),
  under the non-finite policy (`keras_dist.training.update.NonFinitePolicy`); the
  optimizer's `iterations` counts with TF's atomic `assign_add`
  (`keras_dist.training.update.atomic_iterations`): Keras' read-then-write loses
  increments when workers race, and costs two transfers in a row;
- transfers cut to the bone when every weight lives on one parameter
  server: the gradients go there in one transfer and the whole update runs
  there (`keras_dist.training.update.ship_gradients`); the taus stay there until the
  execution's end; at `steps_per_execution=1` the execution's report rides
  with the gradients and is kept in a ring there that the chief reads every
  few executions (`keras_dist.training.step_report.ReportRing`) instead of being
  returned and copied one by one;
- exact metrics under concurrency, without a round trip: the step runs in
  a `keras.StatelessScope` in which every metric variable starts from zero
  (and, for later steps of the same execution, from the earlier steps'
  sums); the execution reports what its steps added and the chief sums
  these (`ChiefMetrics`), writing the totals to the metric variables at
  each epoch's end. This is exact for any metric whose state is additive
  (sums and counts: every Keras built-in metric). Other state the step
  writes (BatchNormalization statistics, seed generators) is assigned
  after the step: last write wins.

Validation runs on the chief, reading the current weights from the
parameter servers.
"""

import contextlib
import dataclasses
import logging
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import data as data_lib
from keras_dist.training import driver
from keras_dist.training import nonfinite as guard
from keras_dist.training import inflight
from keras_dist.training import local_steps as local_steps_lib
from keras_dist.training import sharded
from keras_dist.training import step_report
from keras_dist.training import update
from keras_dist.callbacks import base as replica_cbs
from keras_dist.optimizers.base import StalenessAwareOptimizer, staleness_aware_in
from keras_dist.training.staleness import StalenessStats, StepRecord, VersionCounter
from keras_dist._runtime import quiet_tf_logger
from keras_dist.training.sync_executor import SyncExecutor

logger = logging.getLogger("keras_dist")

WINDOW_PER_WORKER = 16
"""Closures scheduled ahead per worker while the chief waits on the oldest."""

SHIP_GRADIENTS = True
"""Send a step's gradients to their parameter server in one transfer and
run the update there (`keras_dist.training.update.ship_gradients`) when all the
weights live on one; `False` sends each gradient on its own (as measured
against in `benchmarks/ps_throughput.py`)."""

REPORT_RING = True
"""At `steps_per_execution=1`, with every weight on one parameter server,
workers write their execution reports to a ring there that the chief reads
every few executions (`step_report.ReportRing`); `False` returns each
report as the execution's result, copied to the chief one by one (as
measured against in `benchmarks/ps_throughput.py`). Longer executions
always return theirs: there the ring's writes cost more than the copies."""

RING_LOGS = 32
"""Scalar logs a `train_step` may return for its report to go through the
ring; a step with more returns its report as a result (slower)."""

MAX_SURVIVED = 100
"""Worker link failures (`AsyncExecutor._survive`) one `fit` goes on after."""

_LOST = (tf.errors.UnavailableError,)  # seen when a worker is cut off (test_multihost)
_FROM_PS = "remote target /job:ps"  # in an execution's error: its call to a ps failed


class AsyncExecutor(driver.Executor):
    """Runs the model's `train_step` asynchronously on a parameter-server cluster.

    Args:
        model: A compiled `keras.Model` created in `strategy`'s scope.
        strategy: A `tf.distribute.ParameterServerStrategy`.
        **kwargs: `nonfinite_updates`, `faults`, `cluster`: see
            `keras_dist.training.driver.Executor`.

    `steps_per_epoch` counts updates from all workers together; for arrays
    it defaults to one pass over the data (`ceil(samples / batch_size)`).
    After `fit`, `model.staleness_stats` holds the last epoch's records and
    `model.version_counter` the parameter version.
    """

    parameter_server = True

    def __init__(self, model, strategy, local_steps=1, outer_optimizer=None, elastic=None,
                 **kwargs):
        super().__init__(model, strategy, **kwargs)
        self.local_steps = local_steps_lib.check(model, strategy, local_steps, outer_optimizer,
                                                 elastic)
        self.outer_optimizer = outer_optimizer
        self.elastic = elastic
        self._copies = None
        self._local = self.local_steps > 1 or outer_optimizer is not None or elastic is not None
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self._evaluator = SyncExecutor.for_evaluation(model, tf.distribute.get_strategy(),
                                                      cluster=self.cluster)
        self.stats = StalenessStats()
        self._survived = 0
        self._flight = None
        self._last_worker = None  # see _hold

    make_train_input = staticmethod(data_lib.per_worker_input)

    @property
    def eval_strategy(self):
        return self._evaluator.strategy

    def evaluate(self, eval_input, callbacks):
        return self._evaluator.evaluate(eval_input, callbacks)

    # -------------------------------------------------------------- training
    def begin_training(self, train_input, callbacks):
        try:
            tf.timestamp()  # refused under op determinism (no public query for it)
        except tf.errors.FailedPreconditionError:
            raise ValueError(
                "tf.config.experimental.enable_op_determinism() is on, and asynchronous "
                "training cannot be deterministic: which worker applies which update "
                "when is not (and its steps time themselves with tf.timestamp, which "
                "determinism refuses). Leave op determinism off in parameter-server "
                "jobs (it is for synchronous training).") from None
        self.state = _AsyncState.of(self.model, self.strategy, self.nonfinite_updates)
        self.state.build(train_input.sample)
        self.policy = self.state.policy
        self.policy.begin_training()
        self._aware = staleness_aware_in(self.model.optimizer)
        self._iterator = iter(self.coordinator.create_per_worker_dataset(train_input.dataset))
        self._per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        if self._local:
            self.outer_optimizer = local_steps_lib.build_outer(
                self.outer_optimizer, self.model, self.strategy)
            self.model.__dict__["outer_optimizer"] = self.outer_optimizer
            self._per_call = self.local_steps
        if self.elastic is not None:
            workers = len(self.cluster.cluster.get("worker", ())) if self.cluster else 0
            if not workers:
                raise ValueError(
                    "elastic (EASGD) keeps one copy of the weights per worker and takes "
                    "the number of workers from the cluster description (TF_CONFIG or "
                    "SLURM), which this process does not have.")
            with self.strategy.scope():  # x_i start at the weights as they are now
                self._copies = local_steps_lib.ElasticCopies(self.model, workers,
                                                             self.elastic)
            self.model.__dict__["elastic_copies"] = self._copies
        self.model.staleness_stats = self.stats
        self.metrics = self.state.metrics
        # Running metric results for the batch logs cost the chief a compiled
        # call per execution: only when a callback reads batch logs.
        self._batch_logs = driver.reads_batch_logs(callbacks)
        workers = len(self.cluster.cluster.get("worker", ())) if self.cluster else 4
        self._window = WINDOW_PER_WORKER * max(1, workers)
        self._read_every = max(1, self._window // 4)
        # The ring pays for executions of one step; longer ones return their
        # report (measured in `benchmarks/ps_throughput.py`, docs
        # "Where the time goes").
        self._ring = (self.state.ring_for(self._per_call, self._window)
                      if REPORT_RING and self._per_call == 1 and not self._local else None)
        # Executions counted as they finish; at most one stuck per worker
        # (each worker runs one at a time), so the fetches never run out.
        self._max_stuck = max(1, workers)
        self._flight = inflight.InFlight(threads=self._window + self._max_stuck + 1)
        self._rows_due = 0  # ring: executions finished whose reports are not read yet
        # Kept with the model, past this fit: a result let go when fit ends
        # could reach a worker that is stopped then (see _hold).
        self._held = self.state.held
        self._nominal = 0  # the steps of the epochs run so far
        self._start = 0  # the step the next epoch starts at (resumed: > 0)
        self._draining = False  # preempted: nothing more is scheduled
        self._epoch_version = 0  # the parameter version when the epoch began
        self._steps = train_input.steps
        self._warned_stuck = False

    def begin_epoch(self):
        super().begin_epoch()
        self.metrics.reset()
        self.stats.reset()
        # The version the epoch starts from (`position`); a resumed epoch's
        # first `_start` updates are in the restored version already.
        self._epoch_version = self.state.version.value - self._start
        if self._aware is not None:
            self._aware.reset_staleness_logs()

    def seek(self, train_input, epoch, step):
        """Resumes at `step` of the epoch (a restored backup): the epoch runs
        its remaining steps. The workers' input streams start afresh (each
        reads its own shuffled, repeating stream: no batch position to
        keep; docs/fault-tolerance.md)."""
        self._start = min(int(step), train_input.steps)
        self._nominal -= self._start

    def metric_state(self):
        return [np.array(v) for v in self.metrics.values]

    def position(self, step, version):
        """A backup's step: the updates applied in this epoch so far, as the
        parameter version read for it counts them (reports lag behind the
        updates by what is in flight; resuming from the reported count would
        apply those again)."""
        return int(min(self._steps, max(step, version - self._epoch_version)))

    def restore_metrics(self, values):
        if len(values) != len(self.metrics.values):
            driver.assign_metric_state(self.model, values)  # the count error
        self.metrics.values = [np.array(v, dtype=np.asarray(old).dtype).reshape(
            np.shape(old)) for v, old in zip(values, self.metrics.values)]

    def train_epoch(self, train_input):
        """Yields the epoch's events; the epoch ends once `steps` steps have
        finished, in whatever order and on whichever workers they ran
        (`keras_dist.training.inflight`). Executions still running then (stuck on a
        stopped worker, or started before a late one landed) stay in flight
        and count in the epoch they land in."""
        steps, per_call = train_input.steps, self._per_call
        self._steps = steps
        ring, flight = self._ring, self._flight
        start, self._start = self._start, 0
        self._epoch = {"finished": start, "reported": start, "begun": start}
        epoch = self._epoch
        polls = 0
        while True:
            if not self.model.stop_training:
                while self._may_schedule(steps):
                    k = min(per_call, steps - epoch["finished"] - flight.live_steps)
                    yield driver.BatchBegin(epoch["begun"])
                    epoch["begun"] += k
                    fn = self.state.step_function(k, self.faults, local=self._local,
                                                  outer=self.outer_optimizer,
                                                  elastic=self._copies, ring=ring)
                    flight.add(self._schedule(fn), k, fn)
            finished = epoch["finished"] >= steps or (
                (self.model.stop_training or self._draining) and not flight.live)
            short = None
            if ring is not None and self._rows_due and (
                    finished or self._rows_due >= self._read_every or not flight.live):
                # Nothing in flight: no row can come any more.
                final = finished and not flight.pending
                for row_k, skipped, vector in ring.take(final=final, in_flight=self._window,
                                                        limit=self._rows_due):
                    self._rows_due -= 1
                    yield self._batch_end(vector, row_k, skipped)
                if self._rows_due and final:
                    self._rows_missing()
                elif self._rows_due and finished:
                    # A row is written but an earlier slot is not (yet):
                    # being written, or a hole (`ReportRing.take`).
                    polls += 1
                    short = min(0.05, 0.001 * 2 ** polls)
            else:
                polls = 0
            if finished and not self._rows_due:
                # Steps scheduled beyond the epochs' own: replacements for
                # stuck executions (less those made up by landing late).
                self._nominal += epoch["begun"] if self.model.stop_training else steps
                flight.counts.speculative = max(0, flight.counts.scheduled - self._nominal)
                return
            got = self._wait(flight, short)
            if got is not None:
                event = self._landed(*got)
                if event is not None:
                    yield event

    def drain(self):
        # train_epoch yields the batch ends of what is in flight (and of
        # reports not read yet), then ends.
        self._draining = True
        return True

    def _may_schedule(self, steps):
        flight = self._flight
        return (not self._draining and self._epoch["finished"] + flight.live_steps < steps
                and flight.live < self._window and len(flight.stuck) <= self._max_stuck)

    def _wait(self, flight, at_most=None):
        """The next execution to land, or `None` once the next judgement of
        stuck executions is due (or after `at_most` seconds)."""
        wait = flight.next_judgement()
        wait = 1.0 if wait is None else min(1.0, wait + 0.001)
        if at_most is not None:
            wait = min(wait, at_most)
        got = flight.next(timeout=wait)
        if got is None:
            newly = flight.judge()
            if newly and not self._warned_stuck:
                self._warned_stuck = True
                logger.warning(
                    "keras_dist: %d execution(s) have run more than %.1f s (%.0fx the usual "
                    "time); training goes on without waiting for them: replacements are "
                    "scheduled, and each counts in the epoch it lands in. A worker that "
                    "does not answer for ~10 s is declared lost and its step rerun "
                    "elsewhere.", len(newly), flight.stuck_after(), inflight.STUCK_FACTOR)
        return got

    def _landed(self, execution, value, error):
        """Counts one execution that ended; returns its `BatchEnd` or `None`."""
        flight = self._flight
        if error is None:
            self._epoch["finished"] += execution.steps
            if value is None:
                self._rows_due += 1  # its report is in the ring: read it with others
                return None
            event = self._batch_end(value, execution.steps)
            self._hold(execution)
            return event
        if isinstance(error, tf.errors.CancelledError):
            # Never ran: the coordinator dropped its queue on an error
            # that `_survive` judged a worker's, not a parameter server's.
            self._rerun(execution)
            return None
        if isinstance(error, _LOST):
            if _FROM_PS in str(error):
                # It failed calling a parameter server: rerun it, as TF
                # reruns the first three such failures itself.
                self._survive(error)
                self._rerun(execution)
                return None
            # The step ran (its update is on the parameter servers) but the
            # worker holding its result became unreachable before the
            # chief copied it: only its numbers are lost.
            self.stats.lost_results += 1
            flight.lose(execution)
            self._epoch["finished"] += execution.steps
            logger.warning("keras_dist: the result of %d step(s) was lost with an "
                           "unreachable worker (%s); the update was applied, its logs "
                           "are not counted.", execution.steps, type(error).__name__)
            return None
        raise error

    def _rows_missing(self):
        """Executions that finished but whose ring rows never came (none
        should: a row is written before its execution returns): their
        numbers are lost, the epoch is not held up for them."""
        logger.warning("keras_dist: the reports of %d finished execution(s) are missing from "
                       "the report ring; their updates were applied, their logs are not "
                       "counted.", self._rows_due)
        self.stats.lost_results += self._rows_due
        self._rows_due = 0

    def _hold(self, execution):
        """Keeps the result of the last execution each worker finished.

        A result stays on its worker until its `RemoteValue` is garbage
        collected; then TensorFlow sends the worker a request to free it,
        through the chief's default eager executor, and every scheduled
        function waits for that executor's pending requests when it starts
        (`ClusterCoordinator`'s executor scope). A request to a stopped
        worker would therefore stop all training until the worker answers
        (seen: a 15 s SIGSTOP of one worker stalled the other for 15 s at
        steps_per_execution 10). So a worker's result is let go only once
        the same worker has finished a later execution: it answered a
        moment ago, and the request is served at once."""
        worker = self._last_worker
        if worker is not None:
            self._held[worker] = execution.remote

    def _rerun(self, execution):
        rerun = self._flight.add(self._schedule(execution.fn), execution.steps,
                                 execution.fn, count=False)
        rerun.stuck = execution.stuck

    def _batch_end(self, vector, k, skipped=0):
        logs, replica_steps = self._take(vector, k, skipped)
        self._epoch["reported"] += k
        return driver.BatchEnd(self._epoch["reported"] - 1, logs, replica_steps)

    def end_training(self):
        """Waits for what is still in flight (stopped early, or stuck):
        executions expected to finish until they do or are judged stuck,
        stuck ones up to `inflight.END_WAIT` seconds; the rest is lost."""
        flight, ring = self._flight, self._ring
        deadline = None
        self._epoch = {"finished": 0, "reported": 0, "begun": 0}
        while flight.pending:
            at_most = None
            if not flight.live:
                if deadline is None:
                    deadline = time.monotonic() + inflight.END_WAIT
                if time.monotonic() >= deadline:
                    break
                at_most = deadline - time.monotonic()
            got = self._wait(flight, at_most)
            if got is not None:
                self._landed(*got)  # counted, past the last epoch's logs
        stuck = list(flight.pending)
        for execution in stuck:
            flight.lose(execution)
        if stuck:
            logger.warning(
                "keras_dist: %d step(s) were still running on a worker that stopped "
                "answering when fit ended (waited %.0f s); they are counted lost "
                "(model.step_counts). Their updates are applied if that worker goes on.",
                sum(e.steps for e in stuck), inflight.END_WAIT)
        else:
            self._join()
        if ring is not None:
            lost = ring.lost
            for row_k, skipped, vector in ring.take(final=not stuck):
                self._take(vector, row_k, skipped)
            self.stats.lost_results += ring.lost - lost
        self._rows_due = 0
        self.model.__dict__["step_counts"] = flight.counts.as_dict()

    def release(self):
        if self._flight is not None:
            self.model.__dict__["step_counts"] = self._flight.counts.as_dict()
            self._flight.close()

    def _schedule(self, fn):
        optimizer = self.model.optimizer
        while True:
            counting = (contextlib.nullcontext() if self._local  # stateless: counted by delta
                        else update.atomic_iterations(optimizer))
            try:
                with update.intercept_apply(optimizer), counting, guard.finite_loss_only(
                        self.model, self.nonfinite_updates):
                    return self.coordinator.schedule(fn, args=(self._iterator,))
            except _LOST as error:  # an earlier closure's failure, raised here
                self._survive(error)

    def _join(self):
        while True:
            try:
                with quiet_tf_logger("WARNING"):  # join() logs at INFO on every call
                    self.coordinator.join()
                return
            except _LOST as error:
                self._survive(error)

    def _survive(self, error):
        """Goes on after `error` stopped TF's coordinator when every
        parameter server still answers; re-raises it otherwise.

        A worker cut off in the middle of an execution fails it with an
        `UnavailableError` about its own calls to a parameter server. TF's
        `ClusterCoordinator` cannot tell that from the parameter server
        failing: it ignores three such errors per parameter server over the
        whole run, then gives up, raising the error and dropping every
        closure still queued (`tests/test_multihost.py` saw it once in five
        runs). Here the chief asks each parameter server for a variable; if
        all answer, it was a worker's link: the queue's closures are
        scheduled again (`CancelledError` in `train_epoch`) and TF's own
        worker-failure handling takes the worker out until it is back.
        """
        self._survived += 1
        if self._survived > MAX_SURVIVED or not self._servers_answer():
            raise error
        logger.warning("keras_dist: a worker lost its parameter servers (%s: %s); the "
                       "parameter servers answer, so training goes on without it until "
                       "it is back.", type(error).__name__, str(error).splitlines()[0][:200])

    def _servers_answer(self, timeout=30.0):
        """Whether one variable on each parameter server can be read."""
        by_device = {}
        for variable in [self.state.version.variable] + list(self.model.variables):
            for shard in sharded.shards(variable):
                by_device.setdefault(shard.device, shard)
        answered = []

        def read():
            try:
                for variable in by_device.values():
                    variable.read_value().numpy()
                answered.append(True)
            except Exception:  # noqa: BLE001 (any failure means no answer)
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        return bool(answered)

    def _take(self, vector, k, skipped=0):
        """Counts one execution's report (and `skipped` updates counted apart
        from it); returns its batch logs and steps."""
        report = step_report.unpack(vector, self.state.log_names[k], self.metrics.size)
        self._last_worker = report.worker
        if skipped:
            report = dataclasses.replace(report, skipped=report.skipped + skipped)
        self.stats.add(StepRecord(worker=report.worker, staleness=list(report.staleness),
                                  seconds=report.seconds, claimed=report.claimed))
        self.metrics.add(report.state)
        self.policy.add_skipped(report.skipped)
        step = replica_cbs.ReplicaStep.from_report(report, "worker", steps=k)
        logs = self.metrics.logs(report.logs) if self._batch_logs else report.logs
        return logs, [step]

    def epoch_logs(self, last_logs):
        self.model.__dict__["step_counts"] = self._flight.counts.as_dict()
        self.metrics.write()  # the epoch's totals, where Keras reads them
        logs = super().epoch_logs(last_logs)
        logs.update(self.stats.logs())
        if self._aware is not None:
            logs.update(self._aware.staleness_logs())
        return logs


class _AsyncState:
    """What asynchronous training keeps on a model between `fit` calls: the
    version counter, the skip counter and the compiled step functions."""

    @classmethod
    def of(cls, model, strategy, mode):
        state = model.__dict__.get("_kd_async_state")
        if state is None or state.strategy is not strategy or state.policy.mode != mode:
            state = cls(model, strategy, mode)
            # In __dict__ so Keras' attribute tracking leaves it alone.
            model.__dict__["_kd_async_state"] = state
        return state

    def __init__(self, model, strategy, mode):
        self.model, self.strategy = model, strategy
        sharded.install(strategy)
        with strategy.scope():
            counter = getattr(model, "version_counter", None)
            self.version = counter if counter is not None else VersionCounter()
            self.policy = update.NonFinitePolicy(mode).build()
        model.__dict__["version_counter"] = self.version
        self._functions = {}
        self.held = {}  # worker -> the RemoteValue of its last finished execution
        self.log_names = {}
        self.metrics = None
        self.ring = None

    @property
    def metric_variables(self):
        return self.metrics.variables

    def build(self, sample_batch):
        """Creates optimizer and metric state before training (variables
        cannot be created inside the scheduled functions)."""
        driver.build_for_training(self.model, self.strategy, sample_batch)
        if self.metrics is None or self.metrics.variables != _metric_variables(self.model):
            self.metrics = ChiefMetrics(self.model)
        sharded.prepare(self.model)

    def ring_for(self, per_call, window):
        """The `step_report.ReportRing` for executions of up to `per_call`
        steps with `window` of them in flight (made anew when too small)."""
        width = (step_report.ReportRing.HEADER + self.metrics.size + RING_LOGS
                 + len(step_report.FIELDS) + per_call)
        ring = self.ring
        if ring is None or ring.width < width or ring.capacity < 4 * window:
            # Colocated with the version counter: a variable_partitioner
            # never splits a colocated variable.
            with self.strategy.scope(), \
                    self.strategy.extended.colocate_vars_with(self.version.variable):
                self.ring = step_report.ReportRing(width, 4 * window)
        return self.ring

    def step_function(self, k, faults, local=False, outer=None, elastic=None, ring=None):
        """The `tf.function` running `k` steps on a worker (with `local`: one
        round of local steps, `keras_dist.training.local_steps`); cached (like Keras'
        `train_function`) so later epochs and `fit` calls do not retrace.
        Keyed by the optimizers too: a new compile() must not reuse a
        function that captured the old optimizer."""
        key = (id(self.model.optimizer), k, faults.key if faults else (), local, id(outer),
               id(elastic), id(ring))
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
                                                       elastic)
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
        metrics = [tf.zeros(v.shape, v.dtype) for v in self.metric_variables]
        # With every weight on one parameter server, each update runs there
        # (`update.ship_gradients`) and its tau stays there until the end.
        planned = update.home_device(model.trainable_variables) if SHIP_GRADIENTS else None
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
                logs = {name: value for name, value in driver.flatten_logs(step_logs).items()
                        if _is_scalar(value)}
                names = sorted(logs)
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
        logs = {name: value for name, value in driver.flatten_logs(step_logs).items()
                if _is_scalar(value)}
        names = sorted(logs)
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
        gradients were shipped there (`update.ship_gradients`), else `None`;
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
        metric_vars = self.metric_variables
        captured = []

        def capture(original, grads, variables):
            captured.append((original, grads, variables))

        with tf.control_dependencies(after_read):
            with keras.StatelessScope(list(zip(metric_vars, metrics)),
                                      collect_losses=True) as scope:
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
            with tf.control_dependencies(ready):
                now = tf.timestamp()
            ready = faults.slow_down(worker, now - step_start, now) or ready
            with tf.control_dependencies(ready):
                grads = update.identity_all(grads)
        # When every weight lives on one parameter server, the gradients go
        # there in one transfer and the whole update (claim, non-finite
        # check, optimizer math) runs there on local tensors: one transfer
        # per gradient and the learning rate's fewer.
        computed = ready
        home = update.home_device(variables) if SHIP_GRADIENTS else None
        metric_ids = {id(v) for v in metric_vars}
        state = [(v, scope.get_current_value(v)) for v in model.variables
                 if id(v) not in metric_ids and scope.get_current_value(v) is not None]
        metrics = [scope.get_current_value(v) for v in metric_vars]
        shipped = None
        if home is not None:
            extra = carry(step_logs, metrics, computed) if carry and not state else None
            grads, shipped = update.ship_gradients(grads, home, extra=extra)
            ready = [t for t in tf.nest.flatten(grads, expand_composites=True)
                     if t is not None]
        with tf.device(home) if home is not None else contextlib.nullcontext():
            # The claim waits for the gradients through one small data
            # dependency (control edges across hosts cost a transfer each).
            with tf.control_dependencies(ready):
                one = tf.ones([], tf.int64)
            tau = self.version.claim(read, one)
            info = update.UpdateInfo(staleness=tau, pulled=pulled, worker=worker)

            def apply_fn(grads, variables):
                if isinstance(optimizer, StalenessAwareOptimizer):
                    original(grads, variables, update=info)
                    return
                with update.providing(info):  # through a LossScaleOptimizer
                    original(grads, variables)

            skipped = self.policy.apply(apply_fn, grads, variables, optimizer=optimizer,
                                        gate=True)

        writes = [v.value.assign(new) for v, new in state]  # last write wins
        if carry is not None:
            return tau, writes, step_logs, metrics, skipped, home, computed, shipped
        return tau, writes, step_logs, metrics, skipped, home, computed


class ChiefMetrics:
    """The model's metrics during asynchronous training, kept on the chief.

    Each execution returns what its steps added to every metric variable
    (from zero, in a `keras.StatelessScope`); the chief sums these in the
    order results arrive and computes the metrics' results from the sums
    (one compiled call) for the batch logs. Summing is exact for additive
    metric state -- totals and counts, the state of every Keras built-in
    metric -- and costs no round trip to a parameter server; the sums are
    written to the metric variables at the end of each epoch, where Keras'
    epoch logs (and users) read them.

    Example:

    >>> import numpy as np, keras
    >>> from keras_dist.training.async_executor import ChiefMetrics
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)  # builds the metrics
    >>> metrics = ChiefMetrics(model)
    >>> [v.path for v in metrics.variables]
    ['loss/total', 'loss/count']
    >>> metrics.add(np.array([6.0, 3.0]))  # one execution: loss 6 summed over 3 examples
    >>> metrics.logs({"loss": 0.0})
    {'loss': 2.0}
    """

    def __init__(self, model):
        self.model = model
        self.variables = _metric_variables(model)
        ids = [id(v) for v in self.variables]
        tracker = step_report.loss_tracker(model)
        self._loss = None if tracker is None else [ids.index(id(v)) for v in tracker]
        self._sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.size = sum(self._sizes)
        self._results = None
        self.reset()

    def reset(self):
        self.values = [np.zeros(v.shape, v.dtype) for v in self.variables]

    def add(self, flat):
        """Adds one execution's flattened additions (float64)."""
        offset = 0
        for i, size in enumerate(self._sizes):
            value = self.values[i]
            delta = flat[offset:offset + size].reshape(value.shape)
            self.values[i] = value + delta.astype(value.dtype)
            offset += size

    def loss_state(self, state):
        """`(loss_sum, loss_count)` float64 tensors of a metric state list."""
        if self._loss is None:
            nan = tf.constant(np.nan, tf.float64)
            return nan, nan
        return tuple(tf.cast(state[i], tf.float64) for i in self._loss)

    def logs(self, step_logs):
        """`step_logs` with each name that is a metric's result read from the sums."""
        if not self.variables:
            return step_logs
        if self._results is None:
            model, variables = self.model, self.variables

            @tf.function
            def results(*values):
                with keras.StatelessScope(list(zip(variables, values))):
                    return model.get_metrics_result()

            self._results = results
        results = driver.flatten_logs(self._results(*self.values))
        return {name: float(results[name]) if name in results else value
                for name, value in step_logs.items()}

    def write(self):
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)


def _metric_variables(model):
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _is_scalar(value):
    return tf.is_tensor(value) and value.shape.rank == 0 or isinstance(value, (int, float))


def _needs_pulled(optimizer):
    for candidate in update.optimizer_chain(optimizer):
        if isinstance(candidate, StalenessAwareOptimizer) and candidate.needs_pulled_weights:
            return True
    return False

