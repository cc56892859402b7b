r"""Cluster recipes: the tasks of `keras-dist-run`, for Kubernetes or SLURM.

`keras-dist-run --workers 2 --ps 1 -- python train.py` starts a chief, two
workers and a parameter server on this machine. With `--emit tfjob`,
`--emit k8s` or `--emit slurm` it prints, instead, a Kubeflow TFJob manifest,
a plain Kubernetes Job (no operator; `k8s_job`, from
`keras_dist.cluster.k8s`) or a SLURM batch script that starts the same tasks
running the same command on a real cluster, and exits without starting
anything. There the training operator (TFJob), the Job's pod index or SLURM
tells each task its role; keras-dist reads it with
`ClusterConfig.from_env()`, as it reads `TF_CONFIG` from the launcher.

This module is plain Python: it imports neither TensorFlow nor Keras, so the
launcher can print a recipe on a machine without them.

Example:

>>> from keras_dist import recipes
>>> import re
>>> text = recipes.tfjob(["python", "train.py"], workers=2, ps=1,
...                      image="registry.example.com/train:1")
>>> re.findall(r"^    (\w+):$", text, re.MULTILINE)  # the replica types
['Chief', 'Worker', 'PS']
>>> script = recipes.slurm(["python", "train.py"], workers=4)
>>> [line for line in script.splitlines() if "--ntasks=" in line]
['#SBATCH --ntasks=4', 'srun --ntasks=4 --distribution=block --kill-on-bad-exit=1 --label \\']
"""

import json
import math
import re
import shlex
import textwrap

# Plain Python, without TensorFlow: the one name for the roles' variable, and
# the rank order `ClusterConfig.from_slurm` reads the roles with.
from keras_dist.cluster.config import SLURM_JOBS_ENV
from keras_dist.cluster.slurm import role_ranks

__all__ = ["add_arguments", "emit_from_args", "k8s_job", "slurm", "tfjob"]

FORMATS = ("tfjob", "k8s", "slurm")
"""What `--emit` accepts."""

DEFAULT_PORT = 2222
"""The TFJob's and the Kubernetes Job's port: the training operator's default
(`tfjob-port`)."""

SLURM_PORT = 8888
"""First port on each node under SLURM (`ClusterConfig.from_slurm` default)."""

SLURM_WAIT = 60
"""With `ps`: seconds `srun --wait` lets the other tasks run once one exits."""

# TFJob replica type (the operator's spelling) for each TensorFlow role, in
# the order the manifest lists them. The operator lowercases the replica type
# to name the role in TF_CONFIG, so these match `keras_dist.cluster.config.ROLES`.
_REPLICA_TYPES = (("chief", "Chief"), ("worker", "Worker"), ("ps", "PS"),
                  ("evaluator", "Evaluator"))
_CONTAINER = "tensorflow"  # the only container the operator configures
_PORT_NAME = "tfjob-port"  # the operator reads the port by this name
# Kubernetes names: a TFJob name must be a DNS-1035 label (the operator's
# webhook), and so must the Services it makes, `<name>-<role>-<index>`.
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
# What every task gets unless its environment sets it, here and in
# `keras-dist-run` (see docs/launching.md): unbuffered output, the worker-failure
# handling of TensorFlow's parameter-server tutorial, and no C++ INFO/WARNING lines.
TASK_ENV = (("PYTHONUNBUFFERED", "1"), ("GRPC_FAIL_FAST", "use_caller"),
            ("TF_CPP_MIN_LOG_LEVEL", "2"))

# How a value is named in errors: as a keyword argument, or as the launcher's
# flag when the value came from its command line (`emit_from_args`).
_API = {}
_CLI = {"workers": "--workers", "ps": "--ps", "name": "--job-name",
        "image": "--image", "port": "--port", "max_restarts": "--max-restarts"}


def tfjob(command, *, workers, ps=0, evaluator=False, image, name="keras-dist",
          namespace=None, port=DEFAULT_PORT, max_restarts=3):
    """A Kubeflow TFJob manifest that runs `command` as every task.

    The replicas are those `keras-dist-run` would start: `workers` workers,
    plus a chief and `ps` parameter servers when `ps > 0` (asynchronous
    training), plus an evaluator if asked. Every pod runs one container named
    `tensorflow` (the name the training operator requires) with `image` and
    `command`, serving on `port`. The operator sets `TF_CONFIG` in each pod;
    the addresses are its Services, `<name>-<role>-<index>.<namespace>.svc`.

    As with the launcher: without `ps` every replica must succeed
    (`successPolicy: AllWorkers`) and any failure fails the job; with `ps`,
    a worker that fails is restarted (`OnFailure`, at most `max_restarts`
    restarts in all) and the job ends with the chief. The pods still serving
    then are deleted (`cleanPodPolicy: Running`).

    Args:
        command: List of strings. The command every task runs, e.g.
            `["python", "train.py", "--epochs", "5"]`; its first element
            becomes the container's `command`, the rest its `args`.
        workers: Integer, at least 1. Number of `Worker` replicas.
        ps: Integer, 0 or more. Number of `PS` replicas; more than 0 also
            adds a `Chief`. Defaults to `0` (synchronous multi-worker).
        evaluator: Boolean. Whether to add an `Evaluator` replica. Defaults
            to `False`.
        image: String. The container image, with the command's script and
            keras-dist installed.
        name: String. The TFJob's name: lowercase letters, digits and `-`,
            starting with a letter, short enough for its Services' names (63
            characters). Defaults to `"keras-dist"`.
        namespace: String or `None`. The Kubernetes namespace; `None` leaves
            it to `kubectl` (its `-n` or the current context). Defaults to
            `None`.
        port: Integer. The port every task serves on. Defaults to `2222`.
        max_restarts: Integer. With `ps`: how many worker restarts, in all,
            before the job fails (`runPolicy.backoffLimit`). Defaults to `3`.

    Returns:
        The manifest, as YAML text (for `kubectl apply -f`).

    Example:

    >>> from keras_dist import recipes
    >>> print(recipes.tfjob(["python", "train.py", "--epochs", "5"], workers=2,
    ...                     image="registry.example.com/train:1", name="digits"))
    # Kubeflow TFJob from keras-dist: 2 workers (synchronous multi-worker).
    # Apply with `kubectl apply -f FILE`; the training operator sets TF_CONFIG in
    # every pod. TensorFlow's port 2222 has no authentication: keep the pods on
    # a private network (see docs/security.md).
    apiVersion: "kubeflow.org/v1"
    kind: "TFJob"
    metadata:
      name: "digits"
    spec:
      runPolicy:
        cleanPodPolicy: "Running"
      successPolicy: "AllWorkers"
      tfReplicaSpecs:
        Worker:
          replicas: 2
          restartPolicy: "Never"
          template:
            spec:
              containers:
                - name: "tensorflow"
                  image: "registry.example.com/train:1"
                  command: ["python"]
                  args: ["train.py", "--epochs", "5"]
                  ports:
                    - name: "tfjob-port"
                      containerPort: 2222
                  env:
                    - name: "PYTHONUNBUFFERED"
                      value: "1"
                    - name: "GRPC_FAIL_FAST"
                      value: "use_caller"
                    - name: "TF_CPP_MIN_LOG_LEVEL"
                      value: "2"
    <BLANKLINE>

    Raises:
        ValueError: for an empty command, `workers < 1`, `ps < 0`, a missing
            image, a port outside 1..65535, or a name or namespace that
            Kubernetes would refuse.
    """
    return _tfjob(command, workers, ps, evaluator, image, name, namespace, port,
                  max_restarts, _API)


SLURM_SIGNAL_SECONDS = 60
"""Seconds before the time limit SLURM sends the tasks SIGTERM (`--signal`)."""


def slurm(command, *, workers, ps=0, evaluator=False, name="keras-dist",
          time="01:00:00", partition=None, tasks_per_node=1, cpus_per_task=None,
          gpus_per_task=None):
    """A SLURM batch script that runs `command` as every task.

    The script asks for one SLURM task per TensorFlow task and starts them
    all with one `srun`. The tasks are those `keras-dist-run` would start:
    `workers` workers, plus a chief and `ps` parameter servers when `ps > 0`
    (asynchronous training; the chief leads), plus an evaluator if asked;
    without `ps`, worker 0 leads. The script exports
    `KERAS_DIST_SLURM_JOBS` with that layout (e.g. `chief:1,worker:2,ps:1`),
    and each task reads its role with `ClusterConfig.from_env`. Ranks go
    to roles as in TensorFlow's `SlurmClusterResolver`, by role in
    alphabetical order of the role names, `chief`, `evaluator`, `ps`,
    `worker`: with `ps=1, workers=2`, rank 0 is the chief, rank 1 ps
    0, ranks 2 and 3 workers 0 and 1. Ports start at 8888 on each node. The
    script unsets `TF_CONFIG` (keras-dist would read it before SLURM) and
    sets what the launcher sets for each task.

    How the step ends: `srun --kill-on-bad-exit=1` ends every task as soon
    as one exits with an error (a failed worker is not restarted). Without
    `ps`, `srun` waits for every task. With `ps`, the parameter servers and
    workers serve until stopped, so `srun --wait=60` ends the tasks still
    running 60 seconds after the first one exits: normally the chief, when
    training is done (an evaluator that exits first ends the step too).
    `srun` then exits with 128 + the signal that ended them, so the job shows
    as failed even after a good run: the chief's lines (rank 0) tell.

    Args:
        command: List of strings. The command every task runs.
        workers: Integer, at least 1. Number of worker tasks.
        ps: Integer, 0 or more. Number of parameter-server tasks; more than
            0 also adds a chief. Defaults to `0` (synchronous multi-worker).
        evaluator: Boolean. Whether to add an evaluator task. Defaults to
            `False`.
        name: String. The SLURM job name (letters, digits, `.`, `_`, `-`).
            Defaults to `"keras-dist"`.
        time: String. The time limit, `[days-]hours:minutes:seconds` or
            `minutes`. Defaults to `"01:00:00"`.
        partition: String or `None`. The partition; `None` uses the cluster's
            default. Defaults to `None`.
        tasks_per_node: Integer. Tasks on each node. Defaults to `1` (one
            task per node).
        cpus_per_task: Integer or `None`. CPUs for each task; `None` leaves
            SLURM's default. Defaults to `None`.
        gpus_per_task: Integer or `None`. GPUs for each task; `None` asks for
            none. Defaults to `None`.

    Returns:
        The batch script, as text (for `sbatch`).

    Example:

    >>> from keras_dist import recipes
    >>> print(recipes.slurm(["python", "train.py", "--epochs", "5"], workers=2,
    ...                     ps=1, name="digits"))
    #!/bin/bash
    # SLURM batch script from keras-dist: 1 chief, 2 workers, 1 ps (asynchronous training).
    # Submit with `sbatch FILE`. Each task reads its role from SLURM and
    # KERAS_DIST_SLURM_JOBS. TensorFlow gives ranks to roles in alphabetical order
    # (chief, evaluator, ps, worker): rank 0 is the chief, rank 1 is ps 0, ranks 2-3
    # are workers 0-1. The chief leads.
    # The ps and worker tasks serve until stopped: srun ends the step 60 s after the
    # first task exits (the chief, when training is done), and at once if any task
    # fails (--kill-on-bad-exit=1). srun then exits non-zero for the tasks it
    # stopped: the chief's lines (prefix "0: ") tell how training went.
    # Ports start at 8888 on each node and have no authentication: keep the nodes on
    # a private network (see docs/security.md).
    # Preemption: the tasks get SIGTERM 60 s before the time limit; with
    # kd.callbacks.BackupAndRestore they back up and exit 75. --requeue: SLURM
    # requeues the job when it preempts it or a node fails, and the rerun resumes
    # from the newest backup (docs/fault-tolerance.md).
    #SBATCH --job-name=digits
    #SBATCH --ntasks=4
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=1
    #SBATCH --time=01:00:00
    #SBATCH --output=%x-%j.out
    #SBATCH --signal=TERM@60
    #SBATCH --requeue
    <BLANKLINE>
    set -euo pipefail
    # keras-dist reads TF_CONFIG before SLURM: one left in the environment
    # sbatch was called from must not reach the tasks.
    unset TF_CONFIG
    export KERAS_DIST_SLURM_JOBS=chief:1,worker:2,ps:1
    export PYTHONUNBUFFERED=1
    export GRPC_FAIL_FAST="${GRPC_FAIL_FAST:-use_caller}"
    export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
    <BLANKLINE>
    srun --ntasks=4 --distribution=block --kill-on-bad-exit=1 --wait=60 --label \\
      python train.py --epochs 5
    <BLANKLINE>

    Raises:
        ValueError: for an empty command, `workers < 1`, `ps < 0`, a
            non-boolean `evaluator`, or a malformed name, partition, time or
            count.
    """
    return _slurm(command, workers, ps, evaluator, name, time, partition,
                  tasks_per_node, cpus_per_task, gpus_per_task, _API)


def add_arguments(parser):
    """Adds the recipe options to `keras-dist-run`'s argument parser.

    `--emit {tfjob,k8s,slurm}` (dest `emit`, default `None`: run locally),
    `--image` (dest `image`), `--job-name` (dest `job_name`, default
    `None`: "keras-dist") and `--port` (dest `port`, default `None`: 2222). Pass
    the parsed arguments to `emit_from_args`.

    Args:
        parser: An `argparse.ArgumentParser`.

    Returns:
        The argument group the options were added to.

    Example:

    >>> import argparse
    >>> from keras_dist import recipes
    >>> parser = argparse.ArgumentParser()
    >>> _ = recipes.add_arguments(parser)
    >>> args = parser.parse_args(["--emit", "tfjob", "--image", "train:1"])
    >>> args.emit, args.image, args.job_name, args.port
    ('tfjob', 'train:1', None, None)
    """
    group = parser.add_argument_group(
        "cluster recipes",
        "print a Kubeflow TFJob manifest, a plain Kubernetes Job or a SLURM batch "
        "script for the same tasks and command, instead of starting them here")
    group.add_argument("--emit", choices=FORMATS, default=None,
                       help="print a recipe and exit without starting anything: "
                            "'tfjob' (Kubeflow's operator) or 'k8s' (an Indexed Job "
                            "and a Service, no operator), for kubectl apply -f; "
                            "'slurm' (for sbatch)")
    group.add_argument("--image", default=None,
                       help="with --emit tfjob or k8s (required): the container image "
                            "every pod runs, with the script and keras-dist installed")
    group.add_argument("--job-name", default=None, dest="job_name", metavar="NAME",
                       help="with --emit: the TFJob's, Job's or SLURM job's name "
                            "(default keras-dist)")
    group.add_argument("--port", type=int, default=None,
                       help=f"with --emit tfjob or k8s: the port every task serves on "
                            f"(default {DEFAULT_PORT})")
    return group


def emit_from_args(args):
    """The recipe `keras-dist-run --emit ...` prints.

    Args:
        args: The launcher's parsed arguments: `workers`, `ps`, `evaluator`,
            `command` (a list; a leading `--` is dropped), and those of
            `add_arguments` (`emit`, `image`, `job_name`, `port`);
            `max_restarts` is used when present.

    Returns:
        The TFJob manifest, Kubernetes Job manifest or SLURM batch script, as
        text.

    Example:

    >>> import argparse
    >>> from keras_dist import recipes
    >>> args = argparse.Namespace(
    ...     workers=2, ps=1, evaluator=False, command=["python", "train.py"],
    ...     emit="tfjob", image="train:1", job_name="digits", port=None)
    >>> print(recipes.emit_from_args(args).splitlines()[0])
    # Kubeflow TFJob from keras-dist: 1 chief, 2 workers, 1 ps (asynchronous training).

    Raises:
        ValueError: naming the flag, the value received and the fix, e.g.
            for `--emit tfjob` or `--emit k8s` without `--image`, or
            `--image` or `--port` with `--emit slurm`.
    """
    emit = getattr(args, "emit", None)
    command = list(args.command or ())
    if command[:1] == ["--"]:
        command = command[1:]
    image, port = getattr(args, "image", None), getattr(args, "port", None)
    name = getattr(args, "job_name", None)
    name = "keras-dist" if name is None else name
    if emit in ("tfjob", "k8s"):
        if image is None or not str(image).strip():
            raise ValueError(
                f"--emit {emit} needs --image: the container image every pod runs, "
                "with your script and keras-dist installed. Received: no --image. "
                "Add e.g. --image registry.example.com/train:1.")
        pod_args = (command, args.workers, args.ps, args.evaluator, image, name, None,
                    DEFAULT_PORT if port is None else port,
                    getattr(args, "max_restarts", 3), _CLI)
        if emit == "k8s":
            from keras_dist.cluster import k8s  # a module of its own, built on this one

            return k8s._k8s_job(*pod_args)
        return _tfjob(*pod_args)
    if emit == "slurm":
        if image is not None:
            raise ValueError(
                f"--image applies to --emit tfjob and --emit k8s only. Received: "
                f"--image {image} with --emit slurm, where the tasks run in the "
                "nodes' own environment. Drop --image.")
        if port is not None:
            raise ValueError(
                f"--port applies to --emit tfjob and --emit k8s only. Received: "
                f"--port {port} with --emit slurm, where keras-dist uses port "
                f"{SLURM_PORT} on each node (the next ones for further tasks on a "
                "node). Drop --port.")
        return _slurm(command, args.workers, args.ps, args.evaluator, name,
                      "01:00:00", None, 1, None, None, _CLI)
    raise ValueError(
        f"Nothing to emit: --emit must be one of {', '.join(FORMATS)}. Received: "
        f"--emit {emit}. Add e.g. --emit tfjob.")


# ------------------------------------------------------------------- TFJob
def _tfjob(command, workers, ps, evaluator, image, name, namespace, port,
           max_restarts, names):
    command = _check_command(command)
    counts = _counts(workers, ps, evaluator, names)
    _check_int(port, "port", 1, names, upper=65535)
    _check_int(max_restarts, "max_restarts", 0, names)
    _check_image(image, names)
    _check_k8s_name(name, counts, names)
    _check_namespace(namespace, names)

    container = {
        "name": _CONTAINER,
        "image": image,
        "command": command[:1],
        "args": command[1:],
        "ports": [{"name": _PORT_NAME, "containerPort": port}],
        "env": [{"name": key, "value": value} for key, value in TASK_ENV],
    }
    if not container["args"]:
        del container["args"]
    replicas = {}
    for role, replica_type in _REPLICA_TYPES:
        if counts[role]:
            # As the launcher: with ps, a worker that dies is restarted (the
            # coordinator re-runs its steps); any other failure ends the job.
            restart = "OnFailure" if role == "worker" and ps else "Never"
            replicas[replica_type] = {
                "replicas": counts[role],
                "restartPolicy": restart,
                "template": {"spec": {"containers": [container]}},
            }
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    # Servers (ps, and workers under ps) never exit on their own: delete what
    # still runs when the job is done. The operator's default is to keep it.
    run_policy = {"cleanPodPolicy": "Running"}
    spec = {"runPolicy": run_policy}
    if ps:
        run_policy["backoffLimit"] = max_restarts
    else:
        # No chief: the job is done when every worker is, as with the launcher
        # (the operator's default would stop at worker 0).
        spec["successPolicy"] = "AllWorkers"
    spec["tfReplicaSpecs"] = replicas
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
                "metadata": metadata, "spec": spec}
    header = [
        f"# Kubeflow TFJob from keras-dist: {_describe(counts)}.",
        "# Apply with `kubectl apply -f FILE`; the training operator sets TF_CONFIG in",
        f"# every pod. TensorFlow's port {port} has no authentication: keep the pods on",
        "# a private network (see docs/security.md).",
    ]
    return "\n".join(header + _yaml(manifest)) + "\n"


def _yaml(value, indent=0):
    """Block-style YAML lines for nested dicts and lists of scalars or dicts."""
    pad = "  " * indent
    lines = []
    for key, item in value.items():
        if isinstance(item, dict):
            lines.append(f"{pad}{key}:")
            lines += _yaml(item, indent + 1)
        elif isinstance(item, list) and item and isinstance(item[0], dict):
            lines.append(f"{pad}{key}:")
            for element in item:
                block = _yaml(element, indent + 2)
                lines.append(f"{pad}  - {block[0].lstrip()}")
                lines += block[1:]
        elif isinstance(item, list):
            lines.append(f"{pad}{key}: [{', '.join(_scalar(v) for v in item)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar(item)}")
    return lines


def _scalar(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    # A JSON string is a YAML double-quoted scalar, except that YAML has no
    # surrogate pairs: characters beyond U+FFFF are written as \UXXXXXXXX.
    return '"' + "".join(
        f"\\U{ord(c):08x}" if ord(c) > 0xFFFF else json.dumps(c)[1:-1]
        for c in value) + '"'


def _check_image(image, names):
    if not isinstance(image, str) or not image.strip() or any(
            c.isspace() for c in image):
        raise ValueError(
            f"The container image must be a non-empty name without spaces. "
            f"Received: {_show('image', image, names)}. Use e.g. "
            f"{_show('image', 'registry.example.com/train:1', names)}.")


def _check_namespace(namespace, names):
    if namespace is not None and not (
            isinstance(namespace, str) and len(namespace) <= 63
            and _DNS_1123.fullmatch(namespace)):
        raise ValueError(
            f"{_show('namespace', namespace, names)} is not a Kubernetes namespace "
            "name: use at most 63 lowercase letters, digits and '-', starting and "
            "ending with a letter or digit, e.g. namespace='training'.")


def _check_k8s_name(name, counts, names):
    fix = ("Use lowercase letters, digits and '-', starting with a letter and "
           "ending with a letter or digit, e.g. "
           f"{_show('name', 'digits-async', names)}.")
    if not isinstance(name, str) or not _DNS_1035.fullmatch(name):
        raise ValueError(
            f"{_show('name', name, names)} is not a valid TFJob name (a DNS-1035 "
            f"label, as the training operator requires). {fix}")
    longest = max((f"{name}-{role}-{counts[role] - 1}" for role in counts
                   if counts[role]), key=len)
    if len(longest) > 63:
        raise ValueError(
            f"{_show('name', name, names)} is too long: the operator names a "
            f"Service after each task, e.g. {longest!r} ({len(longest)} "
            f"characters), and Kubernetes allows 63. Use a name of at most "
            f"{len(name) - (len(longest) - 63)} characters.")


# -------------------------------------------------------------------- SLURM
def _slurm(command, workers, ps, evaluator, name, time, partition, tasks_per_node,
           cpus_per_task, gpus_per_task, names):
    command = _check_command(command)
    counts = _counts(workers, ps, evaluator, names)
    for key, value in (("name", name), ("partition", partition)):
        if value is not None and not (
                isinstance(value, str) and _SLURM_NAME.fullmatch(value)):
            raise ValueError(
                f"{_show(key, value, names)} is not a valid SLURM {key}: use "
                f"letters, digits, '.', '_' and '-', e.g. "
                f"{_show(key, 'keras-dist' if key == 'name' else 'gpu', names)}.")
    if not (isinstance(time, str) and _SLURM_TIME.fullmatch(time)):
        raise ValueError(
            f"time={time!r} is not a SLURM time limit: write minutes ('90') or "
            "[days-]hours:minutes:seconds, e.g. time='01:00:00' or '2-00:00:00'.")
    _check_int(tasks_per_node, "tasks_per_node", 1, names)
    for key, value in (("cpus_per_task", cpus_per_task),
                       ("gpus_per_task", gpus_per_task)):
        if value is not None:
            _check_int(value, key, 1, names)

    tasks = sum(counts.values())
    per_node = min(tasks_per_node, tasks)
    sbatch = {"job-name": name, "ntasks": tasks,
              "nodes": math.ceil(tasks / per_node), "ntasks-per-node": per_node,
              "time": time, "output": "%x-%j.out", "partition": partition,
              "cpus-per-task": cpus_per_task, "gpus-per-task": gpus_per_task,
              # SIGTERM to the tasks a minute before the time limit: with a
              # kd.callbacks.BackupAndRestore they back up and exit 75.
              "signal": f"TERM@{SLURM_SIGNAL_SECONDS}"}
    srun = ["srun", f"--ntasks={tasks}", "--distribution=block",
            "--kill-on-bad-exit=1"]
    if ps:
        # The ps and worker tasks serve forever: end them SLURM_WAIT seconds
        # after the first task (the chief, when training is done) exits.
        srun.append(f"--wait={SLURM_WAIT}")
    srun.append("--label")
    if cpus_per_task is not None:
        # srun does not take --cpus-per-task over from sbatch on every SLURM
        # release (22.05 stopped doing it): say it again.
        srun.append(f"--cpus-per-task={cpus_per_task}")
    lines = ["#!/bin/bash",
             f"# SLURM batch script from keras-dist: {_describe(counts)}."]
    lines += _comment(
        "Submit with `sbatch FILE`. Each task reads its role from SLURM and "
        f"{SLURM_JOBS_ENV}. TensorFlow gives ranks to roles in alphabetical "
        f"order (chief, evaluator, ps, worker): {_slurm_ranks(counts)}. "
        + ("The chief leads." if counts["chief"] else "Worker 0 leads."))
    if ps:
        lines += _comment(
            f"The ps and worker tasks serve until stopped: srun ends the step "
            f"{SLURM_WAIT} s after the first task exits (the chief, when training "
            "is done" + ("; an evaluator must not exit before it" if evaluator
                         else "") + "), and at once if any task fails "
            "(--kill-on-bad-exit=1). srun then exits non-zero for the tasks it "
            'stopped: the chief\'s lines (prefix "0: ") tell how training went.')
    else:
        lines += _comment(
            "srun waits for every task, and ends them all at once if one fails "
            "(--kill-on-bad-exit=1).")
    lines += _comment(
        f"Ports start at {SLURM_PORT} on each node and have no authentication: "
        "keep the nodes on a private network (see docs/security.md).")
    lines += _comment(
        f"Preemption: the tasks get SIGTERM {SLURM_SIGNAL_SECONDS} s before the time "
        "limit; with kd.callbacks.BackupAndRestore they back up and exit 75. "
        "--requeue: SLURM requeues the job when it preempts it or a node fails, and the "
        "rerun resumes from the newest backup (docs/fault-tolerance.md).")
    lines += [f"#SBATCH --{key}={value}" for key, value in sbatch.items()
              if value is not None]
    lines.append("#SBATCH --requeue")
    lines += [
        "",
        "set -euo pipefail",
        "# keras-dist reads TF_CONFIG before SLURM: one left in the environment",
        "# sbatch was called from must not reach the tasks.",
        "unset TF_CONFIG",
        f"export {SLURM_JOBS_ENV}=" + ",".join(
            f"{role}:{n}" for role, n in counts.items() if n),
    ]
    for key, value in TASK_ENV:
        lines.append(f"export {key}={value}" if key == "PYTHONUNBUFFERED"
                     else f'export {key}="${{{key}:-{value}}}"')
    lines += ["", shlex.join(srun) + " \\", "  " + shlex.join(command)]
    return "\n".join(lines) + "\n"


def _slurm_ranks(counts, words=("rank", "ranks")):
    """Which ranks each role gets, in words (`ClusterConfig.from_slurm`'s
    order, `keras_dist.cluster.slurm.role_ranks`), e.g. `rank 0 is the
    chief, ranks 1-2 are workers 0-1`; `words` names them otherwise (a
    Kubernetes Job's indexes)."""
    one, many = words
    parts = []
    for role, ranks in role_ranks(counts).items():
        n = len(ranks)
        if n == 1:
            who = f"the {role}" if role in ("chief", "evaluator") else f"{role} 0"
            parts.append(f"{one} {ranks.start} is {who}")
        elif n:
            plural = role if role == "ps" else role + "s"
            parts.append(f"{many} {ranks.start}-{ranks[-1]} are {plural} 0-{n - 1}")
    return ", ".join(parts)


def _comment(text):
    """`text` as `# ` comment lines of at most 80 characters."""
    return ["# " + line for line in textwrap.wrap(text, 78, break_long_words=False,
                                                  break_on_hyphens=False)]


# ------------------------------------------------------------------ shared
def _counts(workers, ps, evaluator, names):
    """Tasks per role, as `ClusterConfig.local` lays them out."""
    _check_int(workers, "workers", 1, names)
    _check_int(ps, "ps", 0, names)
    if not isinstance(evaluator, bool):
        raise ValueError(
            f"`evaluator` must be True or False. Received: evaluator={evaluator!r}.")
    return {"chief": int(ps > 0), "worker": workers, "ps": ps,
            "evaluator": int(evaluator)}


def _describe(counts):
    parts = ", ".join(f"{n} {role if n == 1 or role == 'ps' else role + 's'}"
                      for role, n in counts.items() if n)
    if counts["ps"]:
        return parts + " (asynchronous training)"
    if counts["worker"] > 1:
        return parts + " (synchronous multi-worker)"
    return parts + " (one worker: trains like a single machine)"


def _check_command(command):
    if isinstance(command, str):
        raise ValueError(
            f"The command must be a list of arguments, not one string. Received: "
            f"{command!r}. Pass e.g. {shlex.split(command) or ['python', 'train.py']!r}"
            " (shlex.split splits a shell line).")
    command = list(command or ())
    if not command:
        raise ValueError(
            "No command given: every task needs one to run. Pass e.g. "
            "['python', 'train.py'] (on the launcher: put it after --, as in "
            "keras-dist-run --emit slurm --workers 2 -- python train.py).")
    for arg in command:
        if not isinstance(arg, str):
            raise ValueError(
                f"Every argument of the command must be a string. Received: "
                f"{arg!r} in {command!r}. Convert it, e.g. str({arg!r}).")
    if not command[0].strip():
        raise ValueError(
            f"The command's first argument (the program) is empty. Received: "
            f"{command!r}. Start it with the program, e.g. 'python'.")
    return command


def _check_int(value, key, lowest, names, upper=None):
    if (isinstance(value, bool) or not isinstance(value, int) or value < lowest
            or (upper is not None and value > upper)):
        bound = (f"from {lowest} to {upper}" if upper is not None
                 else f"at least {lowest}" if lowest else "0 or more")
        raise ValueError(
            f"`{key}` must be an integer {bound}. Received: "
            f"{_show(key, value, names)}.")


def _show(key, value, names):
    """`--flag value` if the value came from the command line, else `key=value`."""
    if key in names:
        return f"{names[key]} {value}"
    return f"{key}={value!r}"


# The plain Kubernetes Job has a module of its own, built on the helpers above:
# `k8s_job` is looked up there on first use, so either module can load first.
def __getattr__(name):
    if name == "k8s_job":
        from keras_dist.cluster.k8s import k8s_job

        return k8s_job
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
