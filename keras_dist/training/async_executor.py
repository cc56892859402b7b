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
  under the non-finite policy (`keras_dist.training.nonfinite.NonFinitePolicy`); the
  optimizer's `iterations` counts with TF's atomic `assign_add`
  (`keras_dist.training.update.atomic_iterations`): Keras' read-then-write loses
  increments when workers race, and costs two transfers in a row;
- transfers cut to the bone when every weight lives on one parameter
  server: the gradients go there in one transfer and the whole update runs
  there (`keras_dist.training.gradients.ship_gradients`); the taus stay there until the
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

import dataclasses
import logging
import threading
import time

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
from keras_dist.training import steps as steps_lib
from keras_dist.training import update
from keras_dist.callbacks import base as replica_cbs
from keras_dist.optimizers.base import staleness_aware_in
from keras_dist.training.staleness import StalenessStats, StepRecord
from keras_dist._runtime import quiet_tf_logger
from keras_dist.training.sync_executor import SyncExecutor
from keras_dist.training.worker_step import WorkerStep

logger = logging.getLogger("keras_dist")

_LOST = (tf.errors.UnavailableError,)  # seen when a worker is cut off (test_multihost)
_FROM_PS = "remote target /job:ps"  # in an execution's error: its call to a ps failed


class AsyncExecutor(driver.Executor):
    """Runs the model's `train_step` asynchronously on a parameter-server cluster.

    Args:
        model: A compiled `keras.Model` created in the plan's strategy's scope.
        plan: The run's `keras_dist.training.plan.RunPlan` (its strategy a
            `tf.distribute.ParameterServerStrategy`); see
            `keras_dist.training.driver.Executor`.

    `steps_per_epoch` counts updates from all workers together; for arrays
    it defaults to one pass over the data (`ceil(samples / batch_size)`).
    After `fit`, `model.staleness_stats` holds the last epoch's records and
    `model.version_counter` the parameter version.
    """

    parameter_server = True

    def __init__(self, model, plan):
        super().__init__(model, plan)
        plan = self.plan
        self.options = plan.async_options
        self.local_steps = plan.local.steps
        self.outer_optimizer = plan.local.outer_optimizer
        self.elastic = plan.local.elastic
        self._copies = None
        self._local = plan.local.active
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        # Validation and evaluation run on the chief, under the default strategy.
        self._evaluator = SyncExecutor(
            model, dataclasses.replace(plan, strategy=tf.distribute.get_strategy()))
        self.stats = StalenessStats()
        self._survived = 0
        self._flight = None
        self._last_worker = None  # see _hold

    make_train_input = staticmethod(data_lib.per_worker_input)

    # Validation runs on the chief, under the evaluator's (default) strategy.
    eval_strategy = property(lambda self: self._evaluator.strategy)

    def test_epoch(self, eval_input):
        yield from self._evaluator.test_epoch(eval_input)  # on the chief

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
        self.state = WorkerStep.of(self.model, self.strategy, self.nonfinite_updates,
                                    self.options)
        self.state.build(train_input.sample)
        self.policy = self.state.policy
        self.policy.begin_training()
        self._aware = staleness_aware_in(self.model.optimizer)
        self._iterator = iter(self.coordinator.create_per_worker_dataset(train_input.dataset))
        self._per_call = steps_lib.steps_per_execution(self.model)
        if self._local:
            self.outer_optimizer = local_steps_lib.build_outer(
                self.outer_optimizer, self.model, self.strategy)
            self.model.__dict__["outer_optimizer"] = self.outer_optimizer
            # steps_per_execution, a multiple of local_steps, chains rounds.
            self._per_call = max(self._per_call, self.local_steps)
        if self.elastic is not None:
            workers = self.plan.workers
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
        workers = self.plan.workers
        self._window = self.options.window_per_worker * max(1, workers)
        self._read_every = max(1, self._window // 4)
        # The ring pays for executions of one step; longer ones return their
        # report (measured in `benchmarks/ps_throughput.py`, docs
        # "Where the time goes").
        self._ring = (self.state.ring_for(self._per_call, self._window)
                      if self.options.report_ring and self._per_call == 1 and not self._local else None)
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
        self._counts = None  # (version, skipped) read at the last epoch's end

    def reset_metrics(self):
        # The epoch's sums start from zero on the chief (`begin_epoch`); the
        # metric variables get the epoch's totals at its end (`epoch_logs`),
        # with no round trip to the parameter servers at its start.
        pass

    def begin_epoch(self):
        # The version and skip count as the last epoch's end read them
        # (nothing ran since), else read now.
        counts, self._counts = self._counts, None
        version, skipped = counts if counts is not None else self._read_counts()
        self.policy.begin_epoch(skipped)
        self.metrics.reset()
        self.stats.reset()
        # The version the epoch starts from (`position`); a resumed epoch's
        # first `_start` updates are in the restored version already.
        self._epoch_version = version - self._start
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
        steps = train_input.steps
        planner = steps_lib.StepPlanner(self._per_call, steps)
        self._steps = steps
        ring, flight = self._ring, self._flight
        start, self._start = self._start, 0
        self._epoch = {"finished": start, "reported": start, "begun": start}
        epoch = self._epoch
        polls = 0
        while True:
            if not self.model.stop_training:
                while self._may_schedule(steps):
                    k = planner.size(epoch["finished"] + flight.live_steps)
                    yield driver.BatchBegin(epoch["begun"])
                    epoch["begun"] += k
                    fn = self.state.step_function(k, self.faults,
                                                  local=self.local_steps if self._local else 0,
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
        stuck ones up to `self.options.end_wait` seconds; the rest is lost."""
        flight, ring = self._flight, self._ring
        deadline = None
        self._epoch = {"finished": 0, "reported": 0, "begun": 0}
        while flight.pending:
            at_most = None
            if not flight.live:
                if deadline is None:
                    deadline = time.monotonic() + self.options.end_wait
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
                sum(e.steps for e in stuck), self.options.end_wait)
        else:
            self._join()
        if ring is not None:
            lost = ring.lost
            for row_k, skipped, vector in ring.take(final=not stuck):
                self._take(vector, row_k, skipped)
            self.stats.lost_results += ring.lost - lost
        self._rows_due = 0
        self.model.__dict__["step_counts"] = flight.counts.as_dict()

    def _read_counts(self, write=False):
        """`(parameter version, updates skipped)` read on the parameter
        servers (with `write`: after writing the metrics' sums, in the same
        compiled call)."""
        reads = [self.state.version.variable]
        counter = self.policy.counter
        if counter is not None:
            reads.append(counter)
        if write:
            values = self.metrics.write(reads)
        else:
            values = [v.numpy() for v in reads]
        return int(values[0]), int(values[1]) if counter is not None else 0

    def release(self, failed=False):
        if self._flight is not None:
            self.model.__dict__["step_counts"] = self._flight.counts.as_dict()
            self._flight.close()
        if failed:
            self._clear_failures()

    def _clear_failures(self, timeout=10.0):
        """After a `fit` that a failed step ended (its error reached the user
        through the step's result), TF's coordinator still holds the error
        and would raise it at the next `fit`'s first `schedule`: the stale
        failure of a finished run. `done()` raises it once and clears it
        (cancelling what was queued); the steps still in flight end within a
        step, and any of their errors are cleared the same way."""
        coordinator = getattr(self, "coordinator", None)
        if coordinator is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with quiet_tf_logger("CRITICAL"):  # "Start cancelling closures due to error"
                    if coordinator.done():
                        return
            except Exception:  # noqa: BLE001 (the failure this fit already raised)
                continue
            time.sleep(0.02)
        logger.warning("keras_dist: steps of the failed fit were still running after %.0f s; "
                       "the next fit may see their errors", timeout)

    def _schedule(self, fn):
        optimizer = self.model.optimizer
        while True:
            # With local steps the model's optimizer steps on tensors (its count
            # is pushed as a change); the outer optimizer's counts atomically.
            counting = update.atomic_iterations(self.outer_optimizer if self._local
                                                else optimizer)
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
        if self._survived > self.options.max_survived or not self._servers_answer():
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
                                  seconds=report.seconds, claimed=report.claimed,
                                  pull=report.pull, compute=report.compute,
                                  push=report.push))
        self.metrics.add(report.state)
        self.policy.add_skipped(report.skipped)
        step = replica_cbs.ReplicaStep.from_report(report, "worker", steps=k)
        logs = self.metrics.logs(report.logs) if self._batch_logs else report.logs
        return logs, [step]

    def epoch_logs(self, last_logs):
        self.model.__dict__["step_counts"] = self._flight.counts.as_dict()
        # The epoch's totals, where Keras reads them; the counters in the
        # same call (one round trip at the epoch's end, none at the next start).
        self._counts = self._read_counts(write=True)
        logs = driver.metrics_or_logs(self.model, last_logs, self.metrics.results())
        logs.update(self.policy.epoch_logs(self._counts[1]))
        logs.update(self.stats.logs())
        if self._aware is not None:
            logs.update(self._aware.staleness_logs())
        return logs
