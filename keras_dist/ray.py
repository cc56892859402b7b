"""Run a training script or function as a keras-dist cluster on Ray.

    python -m keras_dist.ray --workers 2 --ps 1 -- python train.py --epochs 5

Each task (chief, workers, ps, evaluator) is a Ray actor that picks a port
on its own node and runs the command, with its `TF_CONFIG`, as a fresh
process; the output comes back prefixed with the task (`[worker:1] ...`),
and failures follow `keras-dist-run`'s rules (see `run`). Needs the `ray`
extra (`pip install ray`). Neither Ray nor TensorFlow is
imported with this module: `--help` answers at once.
"""

import argparse
import os
import sys

from keras_dist.cluster import jobs
from keras_dist.cluster import launch
from keras_dist.cluster import ray_tasks
from keras_dist.cluster.config import ROLES, ClusterConfig

PLACE_SECONDS = 300.0
"""How long the task actors may wait for room on the Ray cluster."""


def run(target, *, workers=2, ps=0, evaluator=False, address=None, max_restarts=3,
        env=None, actor_options=None, cwd=None, out=None):
    """Runs `target` as every task of a keras-dist cluster on Ray actors.

    Each task is one Ray actor: it picks a free port on its node, gets its
    `TF_CONFIG` once every task has one, and runs `target` in a fresh process
    of its own (TensorFlow's servers live as long as their process). Every
    output line is written to `out` prefixed with its task, `[worker:1] ...`.

    Failures follow `keras-dist-run`'s rules: with `ps` (asynchronous
    training) a worker that dies is restarted alone on its actor, at its
    address, up to `max_restarts` times; any other task killed by a signal
    (its actor or node lost included) or preempted (exit code 75, having
    saved a `keras_dist.callbacks.BackupAndRestore` backup) stops every task
    and restarts the job on new actors, up to `max_restarts` times, resuming
    from the newest backup. On a cluster of several nodes the backup
    directory must be on storage every node sees. Every process and actor is
    stopped when the run ends, fails or is interrupted.

    Args:
        target: List of strings, or a callable. A command, the same on every
            task (`["python", "train.py"]`), run in the driver's working
            directory where the node has it; or a function taking no
            arguments, sent with Ray's cloudpickle and called in a fresh
            Python process (its exceptions fail the task).
        workers: Integer. Number of worker tasks. Defaults to `2`.
        ps: Integer. Number of parameter-server tasks; more than 0 means
            asynchronous training with a chief. Defaults to `0`
            (synchronous `MultiWorkerMirroredStrategy`).
        evaluator: Boolean. Whether to add an evaluator task.
        address: String or `None`. The Ray cluster: `None` uses the one this
            process is connected to, else starts a local one
            (`ray.init()`); `"auto"`, `"HOST:PORT"` or `"ray://HOST:PORT"`
            connects to an existing one.
        max_restarts: Integer. How many times the job (and, with `ps`, each
            worker alone) may be restarted. Defaults to `3`.
        env: Dict or `None`. Environment variables set in every task, over
            its actor's own.
        actor_options: Dict or `None`. Ray options for each task's actor
            (`num_cpus`, `num_gpus`, `resources`, `runtime_env`,
            `scheduling_strategy`, ...). Defaults to 0 CPUs and the `"SPREAD"`
            strategy: a task reserves nothing, so 4 tasks fit a 2-core
            machine; ask for what your tasks use on a shared cluster.
        cwd: String or `None`. The tasks' working directory, where it exists
            on their node. Defaults to this process's.
        out: File or `None`. Where the output goes. Defaults to `sys.stdout`.

    Returns:
        The exit code of the task that leads (the chief, or worker 0 without
        one); for a task that failed the job, its code (128 + the signal's
        number for a killed one); 130 when interrupted.

    Raises:
        ImportError: Ray is not installed.
        ValueError: a bad argument, named in the message.
        RuntimeError: the tasks' actors found no room on the cluster, or a
            node cannot start the command.

    Example:

    >>> import keras_dist.ray
    >>> keras_dist.ray.run(["python", "train.py"], workers=0)
    Traceback (most recent call last):
    ...
    ValueError: `workers` must be an integer of at least 1. Received: workers=0.
    """
    counts = _check(target, workers, ps, max_restarts, env, actor_options)
    counts["evaluator"] = int(bool(evaluator))
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        _connect(ray, address)
    env = dict(env or {})
    command = target if not callable(target) else ray.cloudpickle.dumps(target)
    options = {"num_cpus": 0, "scheduling_strategy": "SPREAD", **(actor_options or {})}
    out = out or sys.stdout
    actor_class = ray_tasks.actor_class()

    def new_cluster(restarts):
        actors = _place_actors(ray, actor_class, options, counts)
        config = ClusterConfig(cluster={
            role: [address for (r, _), (address, _) in actors.items() if r == role]
            for role in ROLES if counts.get(role)}, source="Ray")
        job = ray_tasks.RayCluster(
            config, command, {t: actor for t, (_, actor) in actors.items()}, env,
            cwd or os.getcwd(), out, max_restarts)
        if restarts == 0:
            nodes = sorted({a.rsplit(":", 1)[0] for a, _ in actors.values()})
            job._say(f"cluster: {config.describe()}; nodes {', '.join(nodes)}")
        return job

    try:
        return jobs.run_jobs(new_cluster, max_restarts)
    finally:
        if started:
            ray.shutdown()


def _connect(ray, address):
    """`ray.init(address=address)`, with the fix named when the cluster
    refuses this process's token (a cluster with token authentication
    needs its clients to set `RAY_AUTH_MODE=token` and have the token)."""
    try:
        ray.init(address=address)
    except Exception as error:  # noqa: BLE001 (Ray wraps it: look down the chain)
        cause, refused = error, False
        while cause is not None and not refused:
            refused = type(cause).__name__ == "AuthenticationError" or \
                "InvalidAuthToken" in str(cause)
            cause = cause.__cause__ or cause.__context__
        if not refused:
            raise
        raise ConnectionError(
            f"The Ray cluster at address={address!r} uses token authentication and "
            "refused this process's token. Set RAY_AUTH_MODE=token here, with the "
            "cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
            "RAY_AUTH_TOKEN (see https://docs.ray.io/en/latest/ray-security/"
            "token-auth.html), and run again.") from None


def _place_actors(ray, actor_class, options, counts):
    """`{(role, index): (address, actor)}`: one actor per task, each holding
    a port of its node."""
    tasks = [(role, i) for role in ROLES for i in range(counts.get(role, 0))]
    actors = {}
    try:
        for task in tasks:
            actors[task] = actor_class.options(**options).remote()
        try:
            addresses = ray.get([actors[t].address.remote() for t in tasks],
                                timeout=PLACE_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"The Ray cluster found no room for the {len(tasks)} task actors within "
                f"{PLACE_SECONDS:.0f} s, with actor_options={options!r}; its resources: "
                f"{ray.cluster_resources()!r}. Ask for less per task in actor_options "
                "(num_cpus, num_gpus, resources), or add nodes.") from None
    except BaseException:
        for actor in actors.values():
            ray.kill(actor)
        raise
    return {t: (address, actors[t]) for t, address in zip(tasks, addresses)}


def _check(target, workers, ps, max_restarts, env, actor_options):
    """The task counts, once the arguments are checked."""
    command = isinstance(target, (list, tuple)) and target and \
        all(isinstance(a, str) for a in target)
    if not command and not callable(target):
        raise ValueError(
            "`target` must be a command, a non-empty list of strings such as "
            f"['python', 'train.py'], or a function taking no arguments. Received: "
            f"target={target!r}.")
    for name, value, least in (("workers", workers, 1), ("ps", ps, 0),
                               ("max_restarts", max_restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"`{name}` must be an integer of at least {least}. "
                             f"Received: {name}={value!r}.")
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("`env` must be a dict of strings to strings, e.g. "
                         f"{{'TF_CPP_MIN_LOG_LEVEL': '0'}}. Received: env={env!r}.")
    if actor_options is not None and not isinstance(actor_options, dict):
        raise ValueError("`actor_options` must be a dict of Ray actor options, e.g. "
                         f"{{'num_cpus': 4}}. Received: actor_options={actor_options!r}.")
    return {"chief": int(ps > 0), "worker": workers, "ps": ps}


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            "keras_dist.ray needs Ray, which is not installed here. Install it with "
            "`pip install ray`, or with keras-dist's `ray` extra: `pip install "
            "\"<keras_dist wheel>[ray]\"` (`pip install -e '.[ray]'` in a clone).") from error
    return ray


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m keras_dist.ray",
        description="Run a script as every task of a TensorFlow cluster on Ray actors.",
        epilog="Example: python -m keras_dist.ray --address auto --workers 2 --ps 1 -- "
               "python train.py --epochs 5")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                             "(default: start a local one)")
    launch.add_task_arguments(parser)
    parser.add_argument("--num-cpus", type=float, default=0,
                        help="CPUs each task's actor reserves on the Ray cluster (default 0)")
    parser.add_argument("--num-gpus", type=float, default=0,
                        help="GPUs each task's actor reserves (default 0)")
    args = parser.parse_args(argv)
    args.command = launch.check_task_arguments(parser, args)
    return args


def main(argv=None):
    """Entry point of `python -m keras_dist.ray`."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    return run(args.command, workers=args.workers, ps=args.ps, evaluator=args.evaluator,
               address=args.address, max_restarts=args.max_restarts,
               actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus})


if __name__ == "__main__":
    sys.exit(main())
