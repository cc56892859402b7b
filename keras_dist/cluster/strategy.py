"""`resolve_strategy()`: pick the `tf.distribute` strategy for this process.

One ordered chain, most explicit first (the same shape as accelerate's
`_prepare_backend`):

1. a `tf.distribute.Strategy` instance passed in: used as is;
2. an explicit name passed in (anything but `"auto"`);
3. the `KERAS_DIST_STRATEGY` environment variable, so a launcher or a job
   file can decide without touching the script;
4. the cluster description (`TF_CONFIG`, SLURM, or `cluster=`): `ps` tasks
   mean parameter-server training, several training tasks mean
   MultiWorkerMirrored -- a cluster outranks local devices because every
   task of a cluster must agree on the strategy;
5. the local accelerators: several GPUs mean Mirrored, one means OneDevice;
6. otherwise TensorFlow's default strategy (no distribution).

An explicit choice (2 or 3) that contradicts the cluster is an error naming
both, since training would silently diverge across tasks otherwise.
"""

import dataclasses
import enum
import logging
import os
import signal
import threading
from typing import Optional, Tuple

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist._runtime import quiet_tf_logger
from keras_dist.training import sharded
from keras_dist.cluster.config import ClusterConfig
from keras_dist.cluster.ports import check_own_port
from keras_dist.cluster.serving import meet_peers, start_server, wait_for_tasks

logger = logging.getLogger("keras_dist")

ENV_VAR = "KERAS_DIST_STRATEGY"


class StrategyKind(str, enum.Enum):
    """The strategies `resolve_strategy` can choose, by name.

    A `str` enum: each member equals its name as a string, which is what the
    `strategy=` argument and `KERAS_DIST_STRATEGY` accept.

    Example:

    >>> import keras_dist as kd
    >>> [kind.value for kind in kd.StrategyKind]
    ['default', 'one_device', 'mirrored', 'multi_worker', 'parameter_server']
    >>> kd.StrategyKind("mirrored") is kd.StrategyKind.MIRRORED
    True
    >>> kd.StrategyKind.MULTI_WORKER == "multi_worker"
    True
    """

    DEFAULT = "default"
    ONE_DEVICE = "one_device"
    MIRRORED = "mirrored"
    MULTI_WORKER = "multi_worker"
    PARAMETER_SERVER = "parameter_server"


_NAMES = ("auto",) + tuple(kind.value for kind in StrategyKind)
_CLUSTER_KINDS = (StrategyKind.MULTI_WORKER, StrategyKind.PARAMETER_SERVER)


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """What `choose_strategy` decided, before anything is built.

    Attributes:
        kind: `StrategyKind`. The strategy to build.
        reason: String. Why, in words (logged by `resolve_strategy`).
        devices: Tuple of device names the strategy will use (empty for the
            cluster strategies and the default strategy).
        cluster: `ClusterConfig` or `None`. The cluster it will run on.

    Example:

    >>> import keras_dist as kd
    >>> choice = kd.choose_strategy(environ={}, cluster={
    ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
    ...     "task": {"type": "worker", "index": 0}})
    >>> choice.kind.value, choice.devices
    ('multi_worker', ())
    >>> choice.reason
    'cluster of 2 workers from dict; this task worker:0'
    >>> choice.cluster.num_workers
    2
    """

    kind: StrategyKind
    reason: str
    devices: Tuple[str, ...] = ()
    cluster: Optional[ClusterConfig] = None


def choose_strategy(strategy="auto", cluster=None, devices=None, environ=None):
    """Decides which strategy `resolve_strategy` would build, without building it.

    This is the whole decision of `resolve_strategy` as a pure function of its
    inputs, so it can be inspected (and tested) on any machine.

    Args:
        strategy: String. `"auto"`, `"default"`, `"one_device"`,
            `"mirrored"`, `"multi_worker"` or `"parameter_server"`.
            Defaults to `"auto"`.
        cluster: `ClusterConfig`, a `TF_CONFIG`-shaped dict, or `None` to read
            the environment (`ClusterConfig.from_env`).
        devices: List of device names or `None`. The local devices to train
            on; `None` means this machine's GPUs
            (`tf.config.list_logical_devices("GPU")`).
        environ: Mapping or `None`. Environment to read `KERAS_DIST_STRATEGY`,
            `TF_CONFIG` and SLURM variables from; defaults to `os.environ`.

    Returns:
        A `StrategyChoice`.

    Example:

    >>> import keras_dist as kd
    >>> kd.choose_strategy(devices=["/gpu:0", "/gpu:1"], environ={}).kind
    <StrategyKind.MIRRORED: 'mirrored'>
    >>> kd.choose_strategy(devices=[], environ={}).kind
    <StrategyKind.DEFAULT: 'default'>

    Raises:
        ValueError: for an unknown name, or a name that contradicts the
            cluster description.
    """
    env = os.environ if environ is None else environ
    requested = _check_name(strategy, "strategy")
    source = "strategy argument"
    if requested == "auto" and env.get(ENV_VAR, "").strip():
        requested = _check_name(env[ENV_VAR].strip(), ENV_VAR)
        source = f"{ENV_VAR}={requested}"
    if isinstance(cluster, dict):
        cluster = ClusterConfig.from_dict(cluster)
    if cluster is None:
        cluster = ClusterConfig.from_env(env)
    implied = cluster.strategy_kind if cluster is not None else None

    if devices is None:
        # Only look when it matters: listing logical devices starts TF's
        # runtime, after which MultiWorkerMirrored can no longer be created.
        needs_devices = requested in ("auto", "one_device", "mirrored") and not (
            requested == "auto" and implied is not None)
        if requested == "mirrored":
            _split_cpu(env)  # before anything lists (and so starts) devices
        devices = _local_gpus() if needs_devices else []
        device_word = "GPU"
        if requested == "mirrored" and not devices:
            # No GPU: mirror over this machine's logical CPUs when it has
            # several (KERAS_DIST_CPU_REPLICAS=N makes them).
            cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
            devices = cpus if len(cpus) > 1 else []
            device_word = "CPU"
    else:
        device_word = "device"
    devices = tuple(devices)

    if requested != "auto":
        kind = StrategyKind(requested)
        _check_against_cluster(kind, source, cluster, implied)
        reason = f"requested by {source}"
    elif implied is not None:
        kind = StrategyKind(implied)
        reason = f"cluster of {cluster.describe()}"
    elif len(devices) > 1:
        kind = StrategyKind.MIRRORED
        reason = f"{len(devices)} local {device_word}s: {', '.join(devices)}"
    elif len(devices) == 1:
        kind = StrategyKind.ONE_DEVICE
        reason = f"one local {device_word}: {devices[0]}"
    else:
        kind = StrategyKind.DEFAULT
        reason = "no cluster and no GPU: training on this machine's default device"
    if kind in _CLUSTER_KINDS:
        return StrategyChoice(kind, reason, (), cluster)
    if kind is StrategyKind.DEFAULT:
        devices = ()
    return StrategyChoice(kind, reason, devices, None)


def resolve_strategy(strategy="auto", cluster=None, devices=None, *,
                     variable_partitioner=None, connect_timeout=120.0):
    """Returns the `tf.distribute.Strategy` this process should train with.

    Decides with `choose_strategy` (see it for the order of precedence), logs
    one line saying what it chose and why, and builds the strategy. Mirrored
    and cluster strategies are built once per process (per device set /
    cluster) and then reused: TensorFlow allows one collective runtime per
    process, and two strategies' all-reduces would collide.

    Args:
        strategy: String or `tf.distribute.Strategy`. A strategy instance is
            returned unchanged; a name is resolved as in `choose_strategy`.
            Defaults to `"auto"`.
        cluster: `ClusterConfig`, dict or `None`. See `choose_strategy`.
        devices: List of device names or `None`. See `choose_strategy`.
        variable_partitioner: Parameter-server training only: a
            `tf.distribute.experimental.partitioners.Partitioner` (e.g.
            `MinSizePartitioner(min_shard_bytes=..., max_shards=num_ps)`) that
            splits large variables, such as a big `Embedding`, across the
            parameter servers; Keras models then train with their variables
            sharded (`keras_dist.training.sharded`, docs/sharded-variables.md).
            Defaults to `None` (no sharding). Any other strategy raises
            `ValueError` for it.
        connect_timeout: Float. Seconds to wait for the cluster's other
            tasks (parameter servers: every worker and ps task;
            MultiWorkerMirrored: every other chief / worker) to accept
            connections before failing with `TimeoutError` naming the
            missing ones. Defaults to `120`.

    On a `worker` or `ps` task of a parameter-server cluster this starts the
    task's server (so the chief can reach it early) and returns the default
    strategy; `keras_dist.fit` then serves there until stopped.

    Returns:
        A `tf.distribute.Strategy`.

    Example:

    >>> import keras_dist as kd
    >>> strategy = kd.resolve_strategy("default")
    >>> strategy.num_replicas_in_sync
    1

    Raises:
        ValueError: for an unknown name or one that contradicts the cluster.
        RuntimeError: when MultiWorkerMirroredStrategy is asked for after
            TensorFlow's runtime has started (it must be created first).
        TimeoutError: when the cluster's other tasks do not come up within
            `connect_timeout`.
        PortInUseError: (an `OSError`) when another program holds this
            task's port, so its TensorFlow server could not start.
    """
    if isinstance(strategy, tf.distribute.Strategy):
        if variable_partitioner is not None:
            raise ValueError(
                f"variable_partitioner={variable_partitioner!r} was given with a "
                f"strategy instance ({type(strategy).__name__}); a partitioner takes "
                "effect only when the strategy is built. Pass it to "
                "tf.distribute.ParameterServerStrategy(..., variable_partitioner=...) "
                "yourself, or pass strategy='auto' / 'parameter_server'.")
        return strategy
    return resolve_choice(choose_strategy(strategy, cluster, devices),
                          variable_partitioner=variable_partitioner,
                          connect_timeout=connect_timeout)


def resolve_choice(choice, *, variable_partitioner=None, connect_timeout=120.0):
    """Logs the line saying which strategy `choice` names and why (once per
    process), and builds it (`build_strategy`)."""
    line = f"keras_dist: using {choice.kind.value} strategy ({choice.reason})"
    # Once per process (resolve_strategy() then kd.fit logged it twice).
    logger.log(logging.DEBUG if line in _LOGGED else logging.INFO, "%s", line)
    _LOGGED.add(line)
    return build_strategy(choice, variable_partitioner=variable_partitioner,
                          connect_timeout=connect_timeout)


_STRATEGIES = {}
_PARTITIONERS = {}  # parameter-server strategies' variable_partitioner, same keys


_LOGGED = set()  # the strategy lines logged so far


def build_strategy(choice, *, variable_partitioner=None, connect_timeout=120.0):
    """Builds the strategy a `StrategyChoice` describes.

    Args:
        choice: `StrategyChoice`, from `choose_strategy`.
        variable_partitioner: See `resolve_strategy`.
        connect_timeout: Float. See `resolve_strategy`.

    Returns:
        A `tf.distribute.Strategy` (cluster strategies are built once per
        process and reused).

    Raises:
        RuntimeError: MultiWorkerMirrored asked for after TF's runtime started.
        ValueError: a cluster strategy on a task that cannot run it.
        TimeoutError: parameter-server tasks that never come up.

    Example:

    >>> import keras_dist as kd
    >>> choice = kd.choose_strategy("one_device", devices=["/cpu:0"], environ={})
    >>> kd.build_strategy(choice).extended.worker_devices
    ('/job:localhost/replica:0/task:0/device:CPU:0',)
    """
    kind = choice.kind
    if variable_partitioner is not None and kind is not StrategyKind.PARAMETER_SERVER:
        raise ValueError(
            f"variable_partitioner={variable_partitioner!r} splits variables across "
            f"parameter servers, but this process trains with the {kind.value} "
            f"strategy ({choice.reason}), which keeps every variable whole on each "
            "replica. Run on a parameter-server cluster (keras-dist-run --ps N, or "
            "'ps' tasks in TF_CONFIG), or leave variable_partitioner out.")
    if kind is StrategyKind.DEFAULT:
        return tf.distribute.get_strategy()
    if kind is StrategyKind.ONE_DEVICE:
        return tf.distribute.OneDeviceStrategy(choice.devices[0] if choice.devices else "/cpu:0")
    if kind is StrategyKind.MIRRORED:
        # One instance per device set: two MirroredStrategy objects in one
        # process reuse collective instance keys, and the second one's
        # all-reduces then abort with "Shape mismatch in the collective".
        key = (kind, choice.devices)
        if key not in _STRATEGIES:
            _STRATEGIES[key] = tf.distribute.MirroredStrategy(
                list(choice.devices) or None)
        return _STRATEGIES[key]
    if kind is StrategyKind.PARAMETER_SERVER and choice.cluster.task_type in (
            "worker", "ps"):
        start_server(choice.cluster)
        return tf.distribute.get_strategy()
    key = (kind, choice.cluster.to_tf_config() if choice.cluster else None)
    if key not in _STRATEGIES:
        if kind is StrategyKind.PARAMETER_SERVER:
            _STRATEGIES[key] = _parameter_server(
                choice.cluster, variable_partitioner, connect_timeout)
            _PARTITIONERS[key] = variable_partitioner
        else:
            _STRATEGIES[key] = _multi_worker(choice.cluster, connect_timeout)
        _CLUSTERS[id(_STRATEGIES[key])] = choice.cluster
    elif (kind is StrategyKind.PARAMETER_SERVER and variable_partitioner is not None
          and _PARTITIONERS[key] is not variable_partitioner):
        # One coordinator per process: the strategy cannot be built again
        # with another partitioner, and silently keeping the first would
        # shard against the caller's wish. (No partitioner means "the
        # strategy as built": kd.fit after resolve_strategy(...).)
        raise ValueError(
            "This process already built its parameter-server strategy with "
            f"variable_partitioner={_PARTITIONERS[key]!r}; it cannot be rebuilt with "
            f"variable_partitioner={variable_partitioner!r} (TensorFlow allows one "
            "coordinator per process). Pass the same partitioner object each time, "
            "or keep the strategy resolve_strategy returned and reuse it.")
    return _STRATEGIES[key]


_CLUSTERS = {}  # id(strategy) -> the ClusterConfig it was built for (kept alive in _STRATEGIES)


def cluster_of(strategy):
    """The `ClusterConfig` keras_dist built `strategy` for, or `None` (a
    strategy built elsewhere, or one without a cluster). TensorFlow's
    strategies do not expose their cluster publicly; this is how code that
    only has the strategy (an optimizer built in its scope) learns it
    without reading the environment again."""
    return _CLUSTERS.get(id(strategy))


def _parameter_server(cluster, variable_partitioner, connect_timeout):
    if cluster.task_type != "chief":
        raise ValueError(
            f"This process is task {cluster.task_type}:{cluster.task_index}; in "
            "parameter-server training only the 'chief' coordinates and 'worker' "
            "/ 'ps' tasks serve. Evaluator tasks are not supported yet: leave "
            "the evaluator out of the cluster.")
    check_own_port(cluster)  # the coordinator's server binds it (before waiting on others)
    wait_for_tasks(cluster, connect_timeout)
    with quiet_tf_logger("WARNING"):  # connecting logs its session config at INFO
        strategy = tf.distribute.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=variable_partitioner)
    return sharded.install(strategy)  # Keras 3 can then train sharded variables


def _multi_worker(cluster, connect_timeout=120.0):
    if cluster is not None and cluster.task_type not in ("chief", "worker"):
        raise ValueError(
            f"This process is task {cluster.task_type}:{cluster.task_index}; "
            "MultiWorkerMirrored training runs on 'chief' and 'worker' tasks "
            "only. Run evaluation on an evaluator task with your own loop over "
            "checkpoints, or leave it out of the cluster."
        )
    resolver = cluster.cluster_resolver() if cluster is not None else None
    if cluster is not None:
        check_own_port(cluster)
        meet_peers(cluster, connect_timeout)  # TF's own wait has no limit
    # TF's coordination service catches SIGTERM for its preemption notifier,
    # and a task then ignores it (for good: a worker stopped with SIGTERM
    # trained on). SIGTERM keeps the handling it had before (by default it
    # ends the process); BackupAndRestore installs its own.
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    except RuntimeError as error:
        if "program startup" not in str(error):
            raise
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before TensorFlow "
            "runs anything (it configures collective ops at start-up), but "
            "this process already created a tensor, a model or a device. Call "
            "`keras_dist.resolve_strategy()` first thing in your script, or "
            "pass `keras_dist.fit` a function that builds the model instead "
            "of a built model."
        ) from error
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _local_gpus():
    return [d.name for d in tf.config.list_logical_devices("GPU")]


CPU_REPLICAS_ENV = "KERAS_DIST_CPU_REPLICAS"
"""With `KERAS_DIST_STRATEGY=mirrored` (or `strategy="mirrored"`) on a machine
without GPUs: split the CPU into this many logical devices and mirror over
them, to try a multi-replica run on a laptop (the script unchanged)."""


def _split_cpu(env):
    """Splits the CPU into `KERAS_DIST_CPU_REPLICAS` logical devices, if set."""
    raw = env.get(CPU_REPLICAS_ENV, "").strip()
    if raw:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(
                f"{CPU_REPLICAS_ENV}={raw!r}: expected a whole number of CPU replicas >= 1 "
                f"(e.g. {CPU_REPLICAS_ENV}=2), or unset it.")
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:  # TF's runtime already started: keep what it has
            pass
        have = len(tf.config.list_logical_devices("CPU"))
        if have != count:
            raise RuntimeError(
                f"{CPU_REPLICAS_ENV}={count}, but TensorFlow's runtime already started "
                f"with {have} logical CPU(s). Call keras_dist.resolve_strategy() first "
                "thing in the script, before anything creates a tensor or a model.")


def _check_name(value, field):
    if not isinstance(value, str) or value not in _NAMES:
        raise ValueError(
            f"Unknown strategy {value!r} (from {field}). Use one of: "
            f"{', '.join(_NAMES)}, or pass a tf.distribute.Strategy instance."
        )
    return value


def _check_against_cluster(kind, source, cluster, implied):
    if implied is None:
        if kind is StrategyKind.PARAMETER_SERVER:
            raise ValueError(
                f"'parameter_server' was requested by {source}, but no cluster "
                "with 'ps' tasks is described. Set TF_CONFIG (or pass cluster=) with 'chief', "
                "'worker' and 'ps' tasks, e.g. via `keras-dist-run --ps 1`."
            )
        return
    if kind.value != implied:
        raise ValueError(
            f"Strategy {kind.value!r} was requested by {source}, but the "
            f"cluster ({cluster.describe()}) implies {implied!r}. Either drop the "
            f"explicit choice or change the cluster description."
        )
