"""`RunPlan`: everything `fit` decides, decided once, before anything trains.

`keras_dist.fit` (and `AsyncModel.fit`) builds one `RunPlan` from its
arguments and the environment, then hands it to the epoch driver and the
executors. The plan is frozen: nothing below it decides again, and nothing
below it reads or writes the environment. What it holds:

- the strategy, and the `StrategyChoice` that named it (`None` when the
  caller passed a strategy object);
- the cluster description (`ClusterConfig`, from `TF_CONFIG` or SLURM) and
  the one worker count derived from it;
- the training route (`Route`): Keras' own loop, keras_dist's synchronous
  loop, or asynchronous training on parameter servers;
- the non-finite policy's mode, fault injection (`keras_dist.faults`), the
  local-steps / outer-optimizer / EASGD settings (`LocalSteps`), the
  variable partitioner;
- the launcher's run-state directory (`KERAS_DIST_RUN_STATE`), where
  `BackupAndRestore` notes the backup in force;
- `AsyncOptions`: the asynchronous executor's tuning knobs.

Example:

>>> import keras, keras_dist as kd
>>> from keras_dist.training.plan import RunPlan
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> model.compile("sgd", "mse")
>>> plan = RunPlan.build(strategy="default", environ={})
>>> plan = plan.for_model(model)
>>> plan.route(model).value, plan.workers, plan.nonfinite_updates
('keras', 0, 'skip')
>>> plan.local.active
False
"""

import dataclasses
import enum
import logging
import os
from typing import Any, Optional

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist import faults as faults_lib
from keras_dist.cluster import strategy as strategy_lib
from keras_dist.cluster.config import ClusterConfig

logger = logging.getLogger("keras_dist")

RUN_STATE_ENV = "KERAS_DIST_RUN_STATE"
"""Set by `keras-dist-run` for its tasks: the directory where the launcher
looks for the backup in force when it restarts a job."""


class Route(enum.Enum):
    """How a run trains once its strategy and model are known."""

    KERAS = "keras"
    """Keras' own `fit` loop, with the non-finite policy inside it (one
    replica, or several where Keras' loop works)."""

    SYNC = "sync"
    """keras_dist's epoch driver with the synchronous executor (several
    replicas, MultiWorkerMirrored, or a backup that resumes mid-epoch)."""

    ASYNC = "async"
    """keras_dist's epoch driver with the asynchronous executor
    (parameter servers)."""


@dataclasses.dataclass(frozen=True)
class AsyncOptions:
    """Tuning knobs of asynchronous training (`AsyncExecutor`).

    The defaults are what the benchmarks measured best on this project's
    machines (docs/asynchronous-training.md, "Where the time goes"); the
    others exist to measure against.

    Attributes:
        window_per_worker: Integer. Executions scheduled ahead per worker
            while the chief waits on the oldest.
        ship_gradients: Boolean. When every weight lives on one parameter
            server, send a step's gradients there in one transfer and run
            the update there (`keras_dist.training.gradients.ship_gradients`);
            `False` sends each gradient on its own.
        report_ring: Boolean. At `steps_per_execution=1` with every weight
            on one parameter server, workers write their execution reports
            to a ring there that the chief reads every few executions;
            `False` returns each report as the execution's result.
        ring_logs: Integer. Scalar logs a `train_step` may return for its
            report to go through the ring (a step with more returns it).
        max_survived: Integer. Worker link failures one `fit` goes on after.
        end_wait: Float. Seconds the end of `fit` waits for executions still
            stuck before counting them lost.

    Example:

    >>> from keras_dist.training.plan import AsyncOptions
    >>> AsyncOptions(report_ring=False).window_per_worker
    16
    """

    window_per_worker: int = 16
    ship_gradients: bool = True
    report_ring: bool = True
    ring_logs: int = 32
    max_survived: int = 100
    end_wait: float = 30.0


@dataclasses.dataclass(frozen=True)
class LocalSteps:
    """Local steps on parameter servers (docs/local-steps.md).

    Attributes:
        steps: Integer >= 1. Steps each worker takes on its own copy
            between a pull and a push.
        outer_optimizer: A Keras optimizer or `None`: applies each push's
            pseudo-gradient on the parameter servers (DiLoCo).
        elastic: Float in (0, 1] or `None`: EASGD's moving rate.

    Example:

    >>> from keras_dist.training.plan import LocalSteps
    >>> LocalSteps().active, LocalSteps(steps=4).active
    (False, True)
    """

    steps: int = 1
    outer_optimizer: Any = None
    elastic: Optional[float] = None

    @property
    def active(self):
        """Whether training runs rounds of local steps (anything but the default)."""
        return self.steps > 1 or self.outer_optimizer is not None or self.elastic is not None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything a run decided before it trains. Build it with `RunPlan.build`.

    Attributes:
        strategy: The `tf.distribute.Strategy` to train under.
        choice: The `StrategyChoice` that named it, or `None` when the
            caller passed a strategy object.
        cluster: `ClusterConfig` or `None` (a single process).
        workers: Integer. The cluster's `worker` tasks (0 without a cluster).
        nonfinite_updates: `"skip"` or `"raise"`, or `None`: the model's
            `nonfinite_updates` attribute decides (`for_model`).
        faults: `keras_dist.faults.FaultInjection`.
        local: `LocalSteps`.
        variable_partitioner: The partitioner the strategy was built with.
        run_state: The launcher's run-state directory, or `None`.
        async_options: `AsyncOptions`.
    """

    strategy: Any
    choice: Any = None
    cluster: Optional[ClusterConfig] = None
    workers: int = 0
    nonfinite_updates: Optional[str] = None
    faults: Any = dataclasses.field(default_factory=faults_lib.FaultInjection)
    local: LocalSteps = LocalSteps()
    variable_partitioner: Any = None
    run_state: Optional[str] = None
    async_options: AsyncOptions = AsyncOptions()

    # ------------------------------------------------------------ building
    @classmethod
    def build(cls, strategy="auto", cluster=None, *, nonfinite_updates=None, local_steps=1,
              outer_optimizer=None, elastic=None, variable_partitioner=None, environ=None,
              async_options=None, fit_kwargs=None):
        """Decides everything once: reads the environment (`environ`, default
        `os.environ`), validates every argument, resolves the strategy.

        Args:
            strategy: String or `tf.distribute.Strategy`; see
                `keras_dist.resolve_strategy`.
            cluster: `ClusterConfig`, dict or `None` (from the environment).
            nonfinite_updates: `"skip"`, `"raise"` or `None` (the model's).
            local_steps, outer_optimizer, elastic: See `keras_dist.fit`.
            variable_partitioner: See `keras_dist.resolve_strategy`.
            environ: Mapping read instead of `os.environ`.
            async_options: `AsyncOptions` or `None` (the defaults).
            fit_kwargs: Dict of `keras.Model.fit` arguments, whose counts
                (`batch_size`, `epochs`, `steps_per_epoch`, ...) are
                checked here, before anything starts.

        Returns:
            A `RunPlan`. On a worker or ps task of a parameter-server
            cluster the strategy is the default one (that task serves).

        Raises:
            ValueError: for any bad argument, naming it and the fix.
        """
        from keras_dist.training import data as data_lib

        data_lib.check_fit_counts(**(fit_kwargs or {}))  # batch_size=0, epochs=-3, ...
        env = os.environ if environ is None else environ
        if nonfinite_updates is not None:
            check_nonfinite_mode(nonfinite_updates)
        from keras_dist.training import local_steps as local_steps_lib

        local = local_steps_lib.check_args(local_steps, outer_optimizer, elastic)
        if isinstance(cluster, dict):
            cluster = ClusterConfig.from_dict(cluster)
        elif cluster is None:
            cluster = ClusterConfig.from_env(environ=env)
        choice = None
        if isinstance(strategy, tf.distribute.Strategy):
            dist = strategy_lib.resolve_strategy(
                strategy, variable_partitioner=variable_partitioner)
        else:
            choice = strategy_lib.choose_strategy(strategy, cluster, environ=env)
            dist = strategy_lib.resolve_choice(choice, variable_partitioner=variable_partitioner)
        return cls(
            strategy=dist, choice=choice, cluster=cluster, workers=workers_of(cluster),
            nonfinite_updates=nonfinite_updates,
            faults=faults_lib.faults_from_env(None if environ is None else env),
            local=local, variable_partitioner=variable_partitioner,
            run_state=env.get(RUN_STATE_ENV) or None,
            async_options=async_options or AsyncOptions())

    # ------------------------------------------------------------- queries
    @property
    def parameter_server(self):
        """Whether training is asynchronous on parameter servers."""
        return isinstance(self.strategy, tf.distribute.ParameterServerStrategy)

    @property
    def is_chief(self):
        """Whether this task leads: the chief (or worker 0 without one), or,
        without a cluster description, what the strategy says."""
        if self.cluster is not None:
            return self.cluster.is_chief
        return self.strategy.extended.should_checkpoint

    @property
    def serving_task(self):
        """Whether this task is a parameter-server cluster's worker or ps
        (it serves, it does not train)."""
        cluster = self.cluster
        return (cluster is not None and cluster.strategy_kind == "parameter_server"
                and cluster.task_type in ("worker", "ps"))

    @property
    def replica_workers(self):
        """Tasks that compute gradients together in synchronous training."""
        return 1 if self.cluster is None else max(1, self.cluster.num_workers)

    def for_model(self, model):
        """The plan with the model's own `nonfinite_updates` when the call
        named none (then `"skip"`), validated against the model: local
        steps need what `keras_dist.training.local_steps.check` says."""
        mode = (self.nonfinite_updates or getattr(model, "nonfinite_updates", None)
                or "skip")
        check_nonfinite_mode(mode)
        if self.local.active:
            from keras_dist.training import local_steps as local_steps_lib

            local_steps_lib.check_model(model, self.strategy, self.local)
        return dataclasses.replace(self, nonfinite_updates=mode)

    def route(self, model, callbacks=None):
        """The `Route` this run trains by."""
        if self.parameter_server:
            return Route.ASYNC
        if needs_own_loop(self.strategy) or backs_up(callbacks):
            return Route.SYNC
        return Route.KERAS


def check_nonfinite_mode(mode):
    """Raises `ValueError` unless `mode` is `"skip"` or `"raise"`; returns it."""
    from keras_dist.training.nonfinite import NonFinitePolicy

    return NonFinitePolicy(mode).mode


def workers_of(cluster):
    """The number of `worker` tasks in the cluster description (0 without one):
    the one worker count of a run."""
    return 0 if cluster is None else len(cluster.cluster.get("worker", ()))


def needs_own_loop(strategy):
    """Whether Keras 3's own loop would fail under `strategy`.

    It fails under MultiWorkerMirrored with more than one worker
    (keras-team/keras#20585) and, under MirroredStrategy with two or more
    replicas, as soon as a batch does not split evenly over the replicas or
    `steps_per_execution > 1` (seen with Keras 3.15; see tests/test_loop.py).
    One device and no strategy are left to Keras.
    """
    if strategy.num_replicas_in_sync > 1:
        return True
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return len(spec.get("chief", ())) + len(spec.get("worker", ())) > 1


def backs_up(callbacks):
    """Whether a `keras_dist.callbacks.BackupAndRestore` is among
    `callbacks`: its backups resume at a step within an epoch (and at the
    batches an uninterrupted run reads there), which Keras' own loop cannot."""
    return _backup_among(callbacks) is not None


def grace_period(callbacks):
    """The `grace_period` of the `BackupAndRestore` among `callbacks` (how
    long a serving task waits for the chief's backup after SIGTERM), or
    `None` without one."""
    backup = _backup_among(callbacks)
    return None if backup is None else backup.grace_period


def _backup_among(callbacks):
    """The first `BackupAndRestore` in `callbacks` (a list or a
    `keras.callbacks.CallbackList`), or `None`."""
    from keras_dist.callbacks.backup import BackupAndRestore

    items = getattr(callbacks, "callbacks", callbacks) or []
    return next((c for c in items if isinstance(c, BackupAndRestore)), None)
