"""`ClusterConfig`: who is in the cluster and which task this process is.

The same convention as TensorFlow and Kubeflow's TFJob: a cluster is a mapping
from role (`chief`, `worker`, `ps`, `evaluator`) to a list of `host:port`
addresses, and a task is one `(role, index)` pair in it. A `ClusterConfig` is
read from `TF_CONFIG`, from a Kubernetes Job's pod, from SLURM, from an
explicit dict, or made up on loopback for a local cluster; it is validated
once, on construction, so every later step can trust it.
"""

import dataclasses
import json
import os
import socket
from typing import Mapping, Optional, Tuple

# TensorFlow is imported inside the few methods that need it: the launcher and
# keras_dist.cluster.recipes use this module without loading TensorFlow.

ROLES = ("chief", "worker", "ps", "evaluator")
"""Role names a cluster may contain, in TensorFlow's spelling."""

PREEMPTED_EXIT_CODE = 75
"""The exit code of a task that saved a backup because it was told it will be
preempted (SIGTERM, SIGUSR1): "preempted, resume me". 75 is `EX_TEMPFAIL`
of sysexits.h (a temporary failure; retrying is invited). `keras-dist-run
--max-restarts` restarts the job on it; so can a Kubernetes Job's
`podFailurePolicy` (`onExitCodes`) or a SLURM requeue.

Defined here only: the tasks (`kd.callbacks.BackupAndRestore`, `kd.serve`)
and the runners (the launcher, `keras_dist.ray`, the Kubernetes recipe)
import it from this module, which loads neither Keras nor TensorFlow;
`kd.callbacks.PREEMPTED_EXIT_CODE` is the same object."""

DEFAULT_GRACE_PERIOD = 30.0
"""Seconds a preempted task has between SIGTERM and SIGKILL by default:
Kubernetes' default `terminationGracePeriodSeconds`. The default of
`kd.callbacks.BackupAndRestore(grace_period=)` and `kd.serve(grace_period=)`,
the time `keras-dist-run` lets a preempted job's tasks exit by themselves,
and the grace period of the Kubernetes Job it emits. Defined here only, as
`PREEMPTED_EXIT_CODE` is."""

SLURM_JOBS_ENV = "KERAS_DIST_SLURM_JOBS"
"""Environment variable naming the roles of a SLURM job step.

Comma-separated `role:count` pairs, e.g. `"chief:1,ps:1,worker:2"`; read by
`ClusterConfig.from_env()` (not by `from_slurm()`, which takes `jobs=`). The
`--emit slurm` recipes of `keras-dist-run` export it.
"""

K8S_JOBS_ENV = "KERAS_DIST_K8S_JOBS"
"""Environment variable naming the roles of a Kubernetes Indexed Job's pods.

The same form as `SLURM_JOBS_ENV` (e.g. `"chief:1,ps:1,worker:2"`); the
Job manifests of `keras-dist-run --emit k8s` set it. When it is set (and
`TF_CONFIG` is not), `ClusterConfig.from_env()` reads the pod's cluster with
`ClusterConfig.from_kubernetes()`.
"""

_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated description of a TensorFlow cluster and of this task in it.

    Build one with `ClusterConfig.from_env()` (reads `TF_CONFIG`, then a
    Kubernetes Job's pod, then SLURM), `ClusterConfig.from_tf_config(...)`,
    `ClusterConfig.from_kubernetes(...)`, `ClusterConfig.from_slurm(...)`,
    `ClusterConfig.from_dict(...)` or `ClusterConfig.local(...)`. The
    constructor validates its arguments and raises `ValueError` naming the bad
    field, the received value and the fix.

    Args:
        cluster: Mapping. Role name (`"chief"`, `"worker"`, `"ps"`,
            `"evaluator"`) to a sequence of `"host:port"` addresses.
        task_type: String or `None`. This process's role; `None` for a
            template that describes a cluster but no task in it (e.g. what
            `ClusterConfig.local()` returns).
        task_index: Integer or `None`. This process's index within its role.
        rpc_layer: String. Transport TensorFlow uses between tasks.
            Defaults to `"grpc"`.
        source: String. Where the description came from (`"TF_CONFIG"`,
            `"Kubernetes"`, `"SLURM"`, `"dict"`, `"local"`), used in log
            lines and errors.

    Example:

    >>> import keras_dist as kd
    >>> config = kd.ClusterConfig.from_dict({
    ...     "cluster": {"chief": ["10.0.0.1:2222"],
    ...                 "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
    ...                 "ps": ["10.0.0.4:2222"]},
    ...     "task": {"type": "worker", "index": 1}})
    >>> config.strategy_kind
    'parameter_server'
    >>> config.task_type, config.task_index, config.is_chief
    ('worker', 1, False)

    Raises:
        ValueError: for unknown roles, malformed addresses (missing or bad
            port), duplicate addresses, a task not in the cluster, a `ps`
            job without a `chief`, or more than one `chief` / `evaluator`.
    """

    cluster: Mapping[str, Tuple[str, ...]]
    task_type: Optional[str] = None
    task_index: Optional[int] = None
    rpc_layer: str = "grpc"
    source: str = dataclasses.field(default="dict", compare=False)

    def __post_init__(self):
        where = _where(self.source)
        if not isinstance(self.cluster, Mapping) or not self.cluster:
            raise ValueError(
                f"{where}['cluster'] must be a non-empty mapping from role to a "
                f"list of 'host:port' addresses. Received: {self.cluster!r}. "
                f"Example: {_TF_CONFIG_EXAMPLE}"
            )
        normalized = {}
        seen = {}
        for role, addresses in self.cluster.items():
            if role not in ROLES:
                hint = " (TensorFlow's old name for it is 'master'; use 'chief')"
                raise ValueError(
                    f"Unknown role {role!r} in {where}['cluster']. Known roles: "
                    f"{', '.join(ROLES)}."
                    + (hint if role == "master" else "")
                )
            if isinstance(addresses, str) or not isinstance(
                addresses, (list, tuple)
            ):
                raise ValueError(
                    f"{where}['cluster'][{role!r}] must be a list of "
                    f"'host:port' strings. Received: {addresses!r}. "
                    f"Write it as [{addresses!r}] if it is one address."
                )
            for index, address in enumerate(addresses):
                _check_address(address, f"{where}['cluster'][{role!r}][{index}]")
                if address in seen:
                    raise ValueError(
                        f"Duplicate address {address!r} in {where}: used by "
                        f"{seen[address]} and {role}[{index}]. Every task needs "
                        "its own host:port."
                    )
                seen[address] = f"{role}[{index}]"
            if addresses:  # An empty role (e.g. "chief": []) is no role.
                normalized[role] = tuple(addresses)
        object.__setattr__(self, "cluster", normalized)

        for role in ("chief", "evaluator"):
            if len(normalized.get(role, ())) > 1:
                raise ValueError(
                    f"{where}['cluster'][{role!r}] has "
                    f"{len(normalized[role])} addresses; a cluster has at most "
                    f"one {role}. Make the others 'worker' tasks."
                )
        if normalized.get("ps") and not normalized.get("chief"):
            raise ValueError(
                f"{where} has 'ps' tasks but no 'chief'. Parameter-server "
                "training needs a chief task to coordinate it: add "
                "\"chief\": [\"host:port\"] to the cluster."
            )
        if not (normalized.get("worker") or normalized.get("chief")):
            raise ValueError(
                f"{where} has no 'worker' or 'chief' task: nobody would train. "
                f"Received cluster: {normalized!r}."
            )
        self._check_task(where, normalized)

    def _check_task(self, where, normalized):
        if self.task_type is None and self.task_index is None:
            return
        if self.task_type not in normalized:
            raise ValueError(
                f"{where}['task']['type']={self.task_type!r} is not a role of "
                f"this cluster. Roles present: {', '.join(normalized)}."
            )
        index = self.task_index
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"{where}['task']['index'] must be an integer. Received: "
                f"{index!r}."
            )
        count = len(normalized[self.task_type])
        if not 0 <= index < count:
            raise ValueError(
                f"{where}['task']['index']={index} is out of range: the cluster "
                f"has {count} {self.task_type!r} task(s), indices 0..{count - 1}."
            )

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, config, source="dict"):
        """Builds a `ClusterConfig` from a `TF_CONFIG`-shaped dict.

        Args:
            config: Dict. `{"cluster": {...}, "task": {"type": ..., "index":
                ...}, "rpc_layer": ...}`; `task` and `rpc_layer` are optional.
            source: String. Name of the origin, used in errors. Defaults to
                `"dict"`.

        Returns:
            A validated `ClusterConfig`.

        Example:

        >>> import keras_dist as kd
        >>> kd.ClusterConfig.from_dict(
        ...     {"cluster": {"worker": ["a:1", "b:1"]}}).num_workers
        2
        """
        where = _where(source)
        _require(isinstance(config, Mapping),
                 f"{where} must be a JSON object. Received: {config!r}. "
                 f"Example: {_TF_CONFIG_EXAMPLE}")
        unknown = set(config) - {"cluster", "task", "rpc_layer", "environment"}
        _require(not unknown,
                 f"Unknown key(s) {sorted(unknown)} in {where}. Allowed keys: "
                 "'cluster', 'task', 'rpc_layer', 'environment'.")
        _require("cluster" in config,
                 f"{where} has no 'cluster' key. Received: {dict(config)!r}. "
                 f"Example: {_TF_CONFIG_EXAMPLE}")
        task = config.get("task") or {}
        _require(isinstance(task, Mapping),
                 f"{where}['task'] must be an object like "
                 f'{{"type": "worker", "index": 0}}. Received: {task!r}.')
        task_type = task.get("type")
        task_index = task.get("index", 0 if task_type is not None else None)
        return cls(
            cluster=config["cluster"],
            task_type=task_type,
            task_index=task_index,
            rpc_layer=config.get("rpc_layer") or "grpc",
            source=source,
        )

    @classmethod
    def from_tf_config(cls, text):
        """Parses a `TF_CONFIG` JSON string.

        Args:
            text: String. The JSON text of `TF_CONFIG`.

        Returns:
            The `ClusterConfig` the JSON describes, validated.

        Example:

        >>> from keras_dist import ClusterConfig
        >>> ClusterConfig.from_tf_config(
        ...     '{"cluster": {"worker": ["localhost:2222"]},'
        ...     ' "task": {"type": "worker", "index": 0}}').task_type
        'worker'
        """
        try:
            config = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"TF_CONFIG is not valid JSON ({error}). Received: "
                f"TF_CONFIG={text!r}. Set it to a JSON object such as "
                f"{_TF_CONFIG_EXAMPLE}"
            ) from None
        return cls.from_dict(config, source="TF_CONFIG")

    @classmethod
    def from_slurm(cls, jobs=None, port_base=8888, environ=None):
        """Reads the cluster of the current SLURM job step.

        Reads `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`
        and `SLURM_STEP_TASKS_PER_NODE` from `environ` (nothing else, and it
        never writes the process environment), then validates the result like
        any other cluster. It never sets `CUDA_VISIBLE_DEVICES`.

        Ranks go to roles the way TensorFlow's `SlurmClusterResolver` hands
        them out: the roles in alphabetical order of their names (`chief`,
        `evaluator`, `ps`, `worker`), each taking the next `count` ranks,
        whatever the order of `jobs`. So `{"chief": 1, "worker": 2, "ps": 1}`
        makes rank 0 the chief, rank 1 ps 0, and ranks 2 and 3 workers 0 and
        1. Rank `r`'s address is where `srun` runs it with its default block
        distribution: ranks fill the step's nodes in `SLURM_STEP_NODELIST`
        order, each node taking its count from `SLURM_STEP_TASKS_PER_NODE`,
        with ports from `port_base` up on each node. (TensorFlow's resolver
        sorts the node names as text instead, which gives rank 1 of
        `node[1-10]` node10's address.)

        This method reads only its arguments and the four SLURM variables, not
        `KERAS_DIST_SLURM_JOBS` (`SLURM_JOBS_ENV`): `from_env()` reads that
        variable and passes it here as `jobs`.

        Args:
            jobs: Dict or `None`. Role to number of tasks, e.g.
                `{"chief": 1, "worker": 3, "ps": 1}`; the counts must add up to
                `SLURM_STEP_NUM_TASKS`. Defaults to every task a `worker`.
            port_base: Integer. First port on each node. Defaults to `8888`.
            environ: Mapping or `None`. Environment to read; defaults to
                `os.environ`.

        Returns:
            This SLURM task's `ClusterConfig`, validated.

        Example:

        >>> import keras_dist as kd
        >>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
        ...        "SLURM_STEP_NODELIST": "node[1-2]",
        ...        "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
        >>> config = kd.ClusterConfig.from_slurm(environ=env)
        >>> config.cluster["worker"], config.task_index
        (('node1:8888', 'node2:8888'), 1)

        With roles (rank 1 is the parameter server: `ps` sorts before
        `worker`):

        >>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
        ...        "SLURM_STEP_NODELIST": "node[1-4]",
        ...        "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}
        >>> config = kd.ClusterConfig.from_slurm(
        ...     jobs={"chief": 1, "worker": 2, "ps": 1}, environ=env)
        >>> config.task_type, config.task_index, config.address
        ('ps', 0, 'node2:8888')
        >>> config.cluster["chief"], config.cluster["worker"]
        (('node1:8888',), ('node3:8888', 'node4:8888'))

        Raises:
            ValueError: outside a SLURM step (a variable missing), when the
                `jobs` counts do not add up to `SLURM_STEP_NUM_TASKS`, or for
                a cluster `ClusterConfig` refuses (e.g. `ps` without `chief`).
        """
        env = os.environ if environ is None else environ
        needed = (
            "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_STEP_NODELIST",
            "SLURM_STEP_TASKS_PER_NODE",
        )
        missing = [name for name in needed if name not in env]
        if missing:
            raise ValueError(
                f"Not inside a SLURM job step: {', '.join(missing)} not set. "
                "Start the script with `srun` (one task per process)."
            )
        num_tasks = int(env["SLURM_STEP_NUM_TASKS"])
        jobs = dict(jobs) if jobs else {"worker": num_tasks}
        _require(sum(jobs.values()) == num_tasks,
                 f"jobs={jobs} asks for {sum(jobs.values())} tasks but the SLURM "
                 f"step has SLURM_STEP_NUM_TASKS={num_tasks}. Make them match.")
        rank = int(env["SLURM_PROCID"])
        if rank not in range(num_tasks):
            raise ValueError(
                f"SLURM_PROCID={rank} is out of range for a step of "
                f"SLURM_STEP_NUM_TASKS={num_tasks} tasks (0..{num_tasks - 1})."
            )
        from keras_dist.cluster import slurm as _slurm

        addresses = _slurm.rank_addresses(
            env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"], port_base)
        if len(addresses) != num_tasks:
            raise ValueError(
                f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} "
                f"adds up to {len(addresses)} tasks but SLURM_STEP_NUM_TASKS="
                f"{num_tasks}. They must describe the same step.")
        cluster, task = {}, None
        for role, ranks in _slurm.role_ranks(jobs).items():
            if len(ranks):
                cluster[role] = [addresses[r] for r in ranks]
            if rank in ranks:
                task = (role, rank - ranks.start)
        return cls(cluster=cluster, task_type=task[0], task_index=task[1],
                   source="SLURM")

    @classmethod
    def from_kubernetes(cls, environ=None):
        """Reads the cluster of a pod of a `keras-dist-run --emit k8s` Job.

        Kubernetes gives each pod of an Indexed Job its index,
        `JOB_COMPLETION_INDEX`; the manifest adds the roles
        (`KERAS_DIST_K8S_JOBS`, the module constant `K8S_JOBS_ENV`), the Job's
        name, its headless Service and the port. Indexes go to roles as SLURM
        ranks do (`from_slurm`): roles in alphabetical order of their names,
        `chief`, `evaluator`, `ps`, `worker`, each taking the next indexes.
        Task `i` is at `<job>-<i>.<service>:<port>`, the DNS name Kubernetes
        gives pod `i` of the Job through the Service. Reads only `environ`
        and never writes the process environment. See
        `keras_dist.cluster.k8s` for the variables.

        Args:
            environ: Mapping or `None`. Environment to read; defaults to
                `os.environ`.

        Returns:
            This pod's `ClusterConfig`, validated.

        Example:

        >>> import keras_dist as kd
        >>> env = {"JOB_COMPLETION_INDEX": "1",
        ...        "KERAS_DIST_K8S_JOBS": "chief:1,worker:2,ps:1",
        ...        "KERAS_DIST_K8S_JOB_NAME": "digits",
        ...        "KERAS_DIST_K8S_SERVICE": "digits",
        ...        "KERAS_DIST_K8S_PORT": "2222"}
        >>> config = kd.ClusterConfig.from_kubernetes(env)
        >>> config.task_type, config.task_index, config.address
        ('ps', 0, 'digits-1.digits:2222')
        >>> config.cluster["worker"]
        ('digits-2.digits:2222', 'digits-3.digits:2222')

        Raises:
            ValueError: outside a pod of an Indexed Job (no
                `JOB_COMPLETION_INDEX`), for an index outside the roles'
                tasks, or a malformed or missing variable, naming it, its
                value and the fix.
        """
        from keras_dist.cluster import k8s

        env = os.environ if environ is None else environ
        cluster, task_type, task_index = k8s.read_pod(env)
        try:
            return cls(cluster=cluster, task_type=task_type, task_index=task_index,
                       source="Kubernetes")
        except ValueError as error:
            raise ValueError(
                f"{error} (Roles from {K8S_JOBS_ENV}={env[K8S_JOBS_ENV]!r}.)") from None

    @classmethod
    def from_env(cls, environ=None):
        """Reads the cluster this process belongs to, if any.

        Order: `TF_CONFIG` if set and non-empty (Kubeflow TFJob, our launcher,
        hand-written); else a pod of a `keras-dist-run --emit k8s` Job
        (`KERAS_DIST_K8S_JOBS` set and naming more than one task, read with
        `from_kubernetes`); else a SLURM job step with more than one task
        (`SLURM_STEP_NUM_TASKS > 1`, read with `from_slurm`); else `None` (a
        single machine, no cluster).

        In a SLURM step every task is a `worker` unless `KERAS_DIST_SLURM_JOBS`
        (the module constant `SLURM_JOBS_ENV`) names the roles: comma-separated
        `role:count` pairs, e.g. `chief:1,ps:1,worker:2`, in any order; roles
        with count 0 are left out, and the counts must add up to
        `SLURM_STEP_NUM_TASKS`. TensorFlow hands out the ranks by role in
        alphabetical order of the role names: `chief`, `evaluator`, `ps`,
        `worker` (see `from_slurm`), so there rank 0 is the chief, rank 1 ps 0,
        ranks 2 and 3 workers 0 and 1. The variable is ignored when
        `TF_CONFIG` is set or the step has one task; an empty one counts as
        unset. `keras-dist-run --emit slurm` scripts set it.

        Args:
            environ: Mapping or `None`. Environment to read; defaults to
                `os.environ`.

        Returns:
            A `ClusterConfig`, or `None` when no cluster is described.

        Example:

        >>> import keras_dist as kd
        >>> kd.ClusterConfig.from_env({}) is None
        True

        A SLURM step of four tasks with roles; this is rank 0:

        >>> env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4",
        ...        "SLURM_STEP_NODELIST": "node[1-4]",
        ...        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
        ...        "KERAS_DIST_SLURM_JOBS": "chief:1,ps:1,worker:2"}
        >>> config = kd.ClusterConfig.from_env(env)
        >>> config.task_type, config.is_chief, config.strategy_kind
        ('chief', True, 'parameter_server')
        >>> {role: len(addresses) for role, addresses in config.cluster.items()}
        {'chief': 1, 'ps': 1, 'worker': 2}

        Raises:
            ValueError: for a malformed `TF_CONFIG`, `KERAS_DIST_K8S_JOBS` or
                `KERAS_DIST_SLURM_JOBS` (naming the variable, the value, the
                bad part and the right form), a pod that is not one of the
                Job's (see `from_kubernetes`), or a SLURM step that does not
                match its roles.
        """
        env = os.environ if environ is None else environ
        text = env.get("TF_CONFIG", "").strip()
        if text:
            return cls.from_tf_config(text)
        # Kubernetes before SLURM: KERAS_DIST_K8S_JOBS is keras-dist's own
        # variable, which only a Job manifest sets, a surer sign than SLURM's.
        k8s_jobs = parse_role_counts(env.get(K8S_JOBS_ENV), K8S_JOBS_ENV)
        if k8s_jobs is not None:
            # One task: a single machine, as for a one-task SLURM step.
            return cls.from_kubernetes(env) if sum(k8s_jobs.values()) > 1 else None
        if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
            jobs_text = env.get(SLURM_JOBS_ENV, "")
            jobs = parse_role_counts(jobs_text)
            if jobs is None:
                return cls.from_slurm(environ=env)
            num_tasks = int(env["SLURM_STEP_NUM_TASKS"])
            if sum(jobs.values()) != num_tasks:
                raise ValueError(
                    f"{SLURM_JOBS_ENV}={jobs_text!r} names {sum(jobs.values())} "
                    f"tasks but the SLURM step has SLURM_STEP_NUM_TASKS="
                    f"{num_tasks}. Make them match: start the step with "
                    f"`srun --ntasks={sum(jobs.values())}`, or change the counts."
                )
            try:
                return cls.from_slurm(jobs=jobs, environ=env)
            except ValueError as error:
                raise ValueError(
                    f"{error} (Roles from {SLURM_JOBS_ENV}={jobs_text!r}.)"
                ) from None
        return None

    @classmethod
    def local(cls, workers=2, ps=0, chief=None, evaluator=False, host="127.0.0.1"):
        """A cluster on this machine, with free loopback ports.

        Args:
            workers: Integer. Number of `worker` tasks. Defaults to `2`.
            ps: Integer. Number of `ps` tasks. Defaults to `0`.
            chief: Boolean or `None`. Whether to add a `chief` task; `None`
                adds one exactly when `ps > 0` (parameter-server training needs
                it). Defaults to `None`.
            evaluator: Boolean. Whether to add an `evaluator` task.
            host: String. Loopback address to bind. Defaults to `127.0.0.1`.

        Returns:
            A `ClusterConfig` template (no task set); use `for_task()` to get
            each process's own config.

        Example:

        >>> import keras_dist as kd
        >>> config = kd.ClusterConfig.local(workers=2, ps=1)
        >>> sorted(config.cluster)
        ['chief', 'ps', 'worker']
        >>> config.for_task("worker", 1).task_index
        1
        """
        for name, value in (("workers", workers), ("ps", ps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"`{name}` must be a non-negative integer. Received: "
                    f"{name}={value!r}."
                )
        if chief is None:
            chief = ps > 0
        counts = {"chief": int(chief), "worker": workers, "ps": ps}
        counts["evaluator"] = int(bool(evaluator))
        ports = free_ports(sum(counts.values()), host=host)
        cluster = {}
        for role in ROLES:
            if counts[role]:
                cluster[role] = [f"{host}:{ports.pop()}" for _ in range(counts[role])]
        return cls(cluster=cluster, source="local")

    # --------------------------------------------------------------- accessors
    def for_task(self, task_type, task_index=0):
        """Returns a copy of this config with the task set (validated)."""
        return dataclasses.replace(self, task_type=task_type, task_index=task_index)

    @property
    def num_workers(self):
        """Integer. Number of tasks that compute gradients (chief + workers)."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def num_ps(self):
        """Integer. Number of parameter-server tasks."""
        return len(self.cluster.get("ps", ()))

    @property
    def is_chief(self):
        """Boolean. Whether this task leads: the chief, or worker 0 without one."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def address(self):
        """String or `None`. This task's own `host:port`."""
        if self.task_type is None:
            return None
        return self.cluster[self.task_type][self.task_index]

    @property
    def strategy_kind(self):
        """String or `None`. The strategy this cluster implies.

        `"parameter_server"` when there are `ps` tasks; `"multi_worker"` when
        more than one task trains (chief + workers > 1); `None` otherwise (a
        one-task cluster trains like a single machine).
        """
        if self.num_ps:
            return "parameter_server"
        if self.num_workers > 1:
            return "multi_worker"
        return None

    def to_dict(self):
        """The `TF_CONFIG`-shaped dict for this config."""
        config = {
            "cluster": {role: list(addrs) for role, addrs in self.cluster.items()}
        }
        if self.task_type is not None:
            config["task"] = {"type": self.task_type, "index": self.task_index}
        if self.rpc_layer != "grpc":
            config["rpc_layer"] = self.rpc_layer
        return config

    def to_tf_config(self):
        """The `TF_CONFIG` JSON string for this config (to hand to a process)."""
        return json.dumps(self.to_dict())

    def cluster_spec(self):
        """This cluster as a `tf.train.ClusterSpec`."""
        import tensorflow as tf

        return tf.train.ClusterSpec({r: list(a) for r, a in self.cluster.items()})

    def cluster_resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for it."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.cluster_spec(),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer=self.rpc_layer,
        )

    def describe(self):
        """A one-line human summary, e.g. `2 workers, 1 ps (TF_CONFIG)`."""
        parts = [
            f"{len(self.cluster[r])} {r if len(self.cluster[r]) == 1 or r == 'ps' else r + 's'}"
            for r in ROLES
            if r in self.cluster
        ]
        me = (
            f"; this task {self.task_type}:{self.task_index}"
            if self.task_type is not None
            else ""
        )
        return f"{', '.join(parts)} from {self.source}{me}"


def free_ports(count, host="127.0.0.1"):
    """Returns `count` distinct TCP ports that are free on `host` right now.

    The sockets are held open until all ports are chosen, so the same port is
    never returned twice; another process may still take one before it is
    used, which is why launchers bind promptly.

    Example:

    >>> from keras_dist.cluster.config import free_ports
    >>> len(set(free_ports(3)))
    3
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def parse_role_counts(text, variable=SLURM_JOBS_ENV):
    """`{role: count}` from a role map such as `KERAS_DIST_SLURM_JOBS` or
    `KERAS_DIST_K8S_JOBS` (`variable`, named in errors), or `None` when
    unset.

    Roles with count 0 are dropped. Raises `ValueError` naming the variable,
    the value, the bad part and an example of the right form.
    """
    if text is None or not text.strip():
        return None
    jobs, seen = {}, set()

    def bad(problem):
        return ValueError(
            f"{variable}={text!r} is malformed: {problem}. Write "
            f"comma-separated role:count pairs with roles from "
            f"{', '.join(ROLES)}, e.g. {variable}=chief:1,ps:1,worker:2."
        )

    for part in text.split(","):
        role, sep, count = (piece.strip() for piece in part.partition(":"))
        if not sep or not role or ":" in count:
            shown = f"{part.strip()!r}" if part.strip() else "an empty entry"
            raise bad(f"{shown} is not role:count")
        if role not in ROLES:
            hint = " ('master' is TensorFlow's old name for 'chief')" if (
                role == "master") else ""
            raise bad(f"{role!r} in {part.strip()!r} is not a role{hint}")
        if role in seen:
            raise bad(f"role {role!r} is given twice; give each role once")
        seen.add(role)
        if not count.isascii() or not count.isdigit():
            raise bad(
                f"the count {count!r} in {part.strip()!r} is not an integer "
                "0 or more"
            )
        if int(count):
            jobs[role] = int(count)
    if not jobs:
        raise bad("every count is 0, so no task has a role")
    return jobs


def _require(ok, message):
    """Raises `ValueError(message)` unless `ok`."""
    if not ok:
        raise ValueError(message)


def _where(source):
    return "TF_CONFIG" if source == "TF_CONFIG" else f"cluster ({source})"


def _check_address(address, field):
    if not isinstance(address, str) or not address.strip():
        raise ValueError(
            f"{field} must be a 'host:port' string. Received: {address!r}."
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"{field}={address!r} has no port. Write it as 'host:port', e.g. "
            f"'{address.strip('[]')}:2222'."
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{field}={address!r} has an invalid port {port!r}: it must be an "
            "integer from 1 to 65535."
        )
