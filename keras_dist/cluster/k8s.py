r"""Kubernetes without an operator: an Indexed Job, and what its pods read.

`keras-dist-run --emit k8s` prints two plain Kubernetes objects for
`kubectl apply -f`: a headless Service and an Indexed `batch/v1` Job with one
pod per TensorFlow task. No custom resource, no operator (the Kubeflow TFJob
of `--emit tfjob` needs one). Kubernetes gives each pod of an Indexed Job
its index, `JOB_COMPLETION_INDEX`, and the host name `<job>-<index>`, which
the Service (the pods' `subdomain`) makes the DNS name
`<job>-<index>.<service>`. The manifest adds the roles, the names and the
port; `ClusterConfig.from_env()` reads them in each pod (`read_pod`, through
`ClusterConfig.from_kubernetes`), so the same command runs unchanged in
every pod and learns its role there.

Indexes go to roles as SLURM ranks do (`keras_dist.cluster.slurm.role_ranks`):
roles in alphabetical order of their names, each taking the next indexes.
With a chief, `--workers 2 --ps 1` makes index 0 the chief, 1 ps 0, 2 and 3
workers 0 and 1.

Plain Python without TensorFlow, like `keras_dist.cluster.recipes`, whose
helpers it shares; `keras_dist.recipes.k8s_job` is its public path.

Example:

>>> from keras_dist import recipes
>>> text = recipes.k8s_job(["python", "train.py"], workers=2, ps=1,
...                        image="registry.example.com/train:1", name="digits")
>>> [line for line in text.splitlines() if line.startswith("kind:")]
['kind: "Service"', 'kind: "Job"']
"""

from keras_dist.cluster import recipes
from keras_dist.cluster.config import (DEFAULT_GRACE_PERIOD, K8S_JOBS_ENV, PREEMPTED_EXIT_CODE,
                                       parse_role_counts)
from keras_dist.cluster.slurm import role_ranks

__all__ = ["k8s_job", "read_pod"]

INDEX_ENV = "JOB_COMPLETION_INDEX"
"""Set by Kubernetes in every pod of an Indexed Job: the pod's index."""

JOB_NAME_ENV = "KERAS_DIST_K8S_JOB_NAME"
"""Set by the manifest: the Job's name; pod `i`'s host name is `<name>-<i>`."""

SERVICE_ENV = "KERAS_DIST_K8S_SERVICE"
"""Set by the manifest: the headless Service, the pods' DNS subdomain."""

PORT_ENV = "KERAS_DIST_K8S_PORT"
"""Set by the manifest: the port every task serves on."""

GRACE_PERIOD = int(DEFAULT_GRACE_PERIOD)
"""`terminationGracePeriodSeconds`: Kubernetes' default, the time
`kd.callbacks.BackupAndRestore` (`grace_period`) and `keras-dist-run`
(`PREEMPTION_WAIT`) give a preempted task to back up and exit."""


MIN_KUBERNETES = "1.31"
"""The oldest Kubernetes with every field the manifest uses on by default
(`successPolicy` went beta in 1.31; `backoffLimitPerIndex` and
`podReplacementPolicy` in 1.29, `podFailurePolicy` GA in 1.31)."""

_CONTAINER = "train"
_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set on its pods by the Job controller


def k8s_job(command, *, workers, ps=0, evaluator=False, image, name="keras-dist",
            namespace=None, port=recipes.DEFAULT_PORT, max_restarts=3):
    """A Kubernetes Job and headless Service that run `command` as every task.

    The tasks are those `keras-dist-run` would start: `workers` workers,
    plus a chief and `ps` parameter servers when `ps > 0` (asynchronous
    training), plus an evaluator if asked. One Indexed Job runs them all,
    one pod per task (`completions` = `parallelism` = tasks), each with one
    container running `image` and `command` and serving on `port`; a
    headless Service named like the Job (`clusterIP: None`, also listing pods
    not ready yet) gives pod `i` the DNS name `<name>-<i>.<name>`. Each pod
    reads its role in `ClusterConfig.from_env()` from its index and the
    manifest's `KERAS_DIST_K8S_*` variables. Needs Kubernetes 1.31 or newer,
    and no operator.

    How it ends, as with the launcher: with `ps`, the Job succeeds when the
    chief's pod does (`successPolicy`), and Kubernetes then stops the
    serving pods; without `ps`, when every worker's has. Restarts: a pod
    that exits with code 75 (backed up on SIGTERM) or is disrupted
    (preempted, evicted, its node drained: the `DisruptionTarget`
    condition) is replaced without counting; any other failure counts
    against its index's `max_restarts` (`backoffLimitPerIndex`), and the Job
    fails when one index has used them all (`maxFailedIndexes: 0`). A
    replacement pod starts once the old one is gone and has the same DNS
    name, so its peers find it again. Pods get
    `terminationGracePeriodSeconds: 30` to back up.

    Args:
        command: List of strings. The command every task runs, e.g.
            `["python", "train.py", "--epochs", "5"]`; its first element
            becomes the container's `command`, the rest its `args`.
        workers: Integer, at least 1. Number of worker tasks.
        ps: Integer, 0 or more. Number of parameter-server tasks; more than
            0 also adds a chief. Defaults to `0` (synchronous multi-worker).
        evaluator: Boolean. Whether to add an evaluator task. Defaults to
            `False`.
        image: String. The container image, with the command's script and
            keras-dist installed.
        name: String. The Job's and the Service's name: lowercase letters,
            digits and `-`, starting with a letter, short enough for the
            pods' host names, `<name>-<index>` (63 characters). Defaults to
            `"keras-dist"`.
        namespace: String or `None`. The Kubernetes namespace; `None` leaves
            it to `kubectl` (its `-n` or the current context). Defaults to
            `None`.
        port: Integer. The port every task serves on. Defaults to `2222`.
        max_restarts: Integer. How many times each task's pod is replaced
            after a failure, preemptions not counted
            (`backoffLimitPerIndex`); its next failure fails the Job.
            Defaults to `3`.

    Returns:
        The manifest, as YAML text: the Service, then the Job.

    Example:

    >>> from keras_dist import recipes
    >>> text = recipes.k8s_job(["python", "train.py"], workers=2, ps=1,
    ...                        image="registry.example.com/train:1", name="digits")
    >>> print(text[:text.index("apiVersion")])
    # Kubernetes Job from keras-dist: 1 chief, 2 workers, 1 ps (asynchronous training).
    # No operator needed (Kubernetes 1.31 or newer). Apply with `kubectl apply -f
    # FILE`, delete with `kubectl delete -f FILE`. The headless Service gives pod i
    # of the Job the DNS name digits-<i>.digits. Each pod reads its role from its
    # index (JOB_COMPLETION_INDEX) and KERAS_DIST_K8S_JOBS: index 0 is the chief,
    # index 1 is ps 0, indexes 2-3 are workers 0-1.
    # The Job succeeds when the chief (index 0) does; Kubernetes then stops the
    # other pods, which serve until stopped.
    # Restarts: a pod that exits with code 75 (it backed up on SIGTERM) or is
    # disrupted (preempted, evicted, drained) is replaced without counting; any
    # other failure counts, and the Job fails once one index has failed 4 times
    # (backoffLimitPerIndex: 3).
    # Port 2222 has no authentication: keep the pods on a private network (see
    # docs/security.md).
    <BLANKLINE>

    Raises:
        ValueError: for an empty command, `workers < 1`, `ps < 0`, a missing
            image, a port outside 1..65535, a negative `max_restarts`, or a
            name or namespace that Kubernetes would refuse.
    """
    return _k8s_job(command, workers, ps, evaluator, image, name, namespace, port,
                    max_restarts, recipes._API)


def read_pod(environ):
    """This pod's cluster, from the environment the manifest gives it.

    What `ClusterConfig.from_kubernetes` builds its config from; see there.

    Args:
        environ: Mapping. The pod's environment.

    Returns:
        `(cluster, task_type, task_index)`: the cluster as a dict of role to
        `host:port` addresses, and this pod's role and index in its role.

    Example:

    >>> from keras_dist.cluster import k8s
    >>> cluster, role, index = k8s.read_pod({
    ...     "JOB_COMPLETION_INDEX": "1", "KERAS_DIST_K8S_JOBS": "worker:2",
    ...     "KERAS_DIST_K8S_JOB_NAME": "digits", "KERAS_DIST_K8S_SERVICE": "digits",
    ...     "KERAS_DIST_K8S_PORT": "2222"})
    >>> cluster, role, index
    ({'worker': ['digits-0.digits:2222', 'digits-1.digits:2222']}, 'worker', 1)

    Raises:
        ValueError: naming the variable, its value and the fix.
    """
    jobs = parse_role_counts(environ.get(K8S_JOBS_ENV), K8S_JOBS_ENV)
    if jobs is None:
        raise ValueError(
            f"{K8S_JOBS_ENV} is not set: it names the roles of the Job's pods, e.g. "
            f"{K8S_JOBS_ENV}=chief:1,ps:1,worker:2. Run the pods from the manifest "
            "`keras-dist-run --emit k8s` prints, which sets it.")
    tasks = sum(jobs.values())
    text = environ.get(INDEX_ENV)
    if text is None:
        raise ValueError(
            f"{INDEX_ENV} is not set: this process is not in a pod of an Indexed "
            f"Job, where Kubernetes sets it to the pod's index ({K8S_JOBS_ENV}="
            f"{environ[K8S_JOBS_ENV]!r} says it should be one of {tasks} tasks). Run it "
            "from the manifest `keras-dist-run --emit k8s` prints (completionMode: "
            f"Indexed), or unset {K8S_JOBS_ENV} to train on this machine alone.")
    if not (text.isascii() and text.isdigit() and int(text) < tasks):
        raise ValueError(
            f"{INDEX_ENV}={text!r} is not an index of the Job's {tasks} tasks "
            f"(0..{tasks - 1}, from {K8S_JOBS_ENV}={environ[K8S_JOBS_ENV]!r}). Make "
            f"the Job's completions match the roles: completions: {tasks}.")
    job, service = (_read_name(environ, key) for key in (JOB_NAME_ENV, SERVICE_ENV))
    port = environ.get(PORT_ENV, "")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"{PORT_ENV}={port!r} is not a port: set it to the container's port, "
            f"an integer from 1 to 65535, e.g. {PORT_ENV}={recipes.DEFAULT_PORT}.")
    index = int(text)
    cluster, task = {}, None
    for role, indexes in role_ranks(jobs).items():
        cluster[role] = [f"{job}-{i}.{service}:{int(port)}" for i in indexes]
        if index in indexes:
            task = (role, index - indexes.start)
    return cluster, task[0], task[1]


def _read_name(environ, key):
    value = environ.get(key, "")
    if not (len(value) <= 63 and recipes._DNS_1123.fullmatch(value)):
        raise ValueError(
            f"{key}={value!r} is not a Kubernetes name: use at most 63 lowercase "
            "letters, digits and '-', starting and ending with a letter or digit, "
            f"e.g. {key}=digits (the manifest `keras-dist-run --emit k8s` prints "
            "sets it to the Job's name).")
    return value


# ---------------------------------------------------------------- manifest
def _k8s_job(command, workers, ps, evaluator, image, name, namespace, port,
             max_restarts, names):
    command = recipes._check_command(command)
    counts = recipes._counts(workers, ps, evaluator, names)
    recipes._check_int(port, "port", 1, names, upper=65535)
    recipes._check_int(max_restarts, "max_restarts", 0, names)
    recipes._check_image(image, names)
    recipes._check_namespace(namespace, names)
    tasks = sum(counts.values())
    _check_name(name, tasks, names)

    ranks = role_ranks(counts)
    layout = ",".join(f"{role}:{n}" for role, n in counts.items() if n)
    env = [{"name": K8S_JOBS_ENV, "value": layout},
           {"name": JOB_NAME_ENV, "value": name},
           {"name": SERVICE_ENV, "value": name},
           {"name": PORT_ENV, "value": str(port)}]
    env += [{"name": key, "value": value} for key, value in recipes.TASK_ENV]
    container = {"name": _CONTAINER, "image": image, "command": command[:1],
                 "args": command[1:], "ports": [{"name": "tf", "containerPort": port}],
                 "env": env}
    if not container["args"]:
        del container["args"]
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace

    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": dict(metadata),
        "spec": {
            "clusterIP": "None",  # headless: a DNS name per pod, no proxy
            # A name as soon as a pod has an address, not once it is Ready:
            # the chief waits for the others by connecting to them.
            "publishNotReadyAddresses": True,
            "selector": {_JOB_NAME_LABEL: name},
            "ports": [{"name": "tf", "port": port}],
        },
    }
    spec = {
        "completionMode": "Indexed",  # JOB_COMPLETION_INDEX and <name>-<index> host names
        "completions": tasks,
        "parallelism": tasks,  # every task at once: they serve one another
        # Per task, as the launcher restarts each worker: a failure counts
        # against its own index, and the first index out of restarts fails
        # the Job. Not a script error alone: a lost parameter server makes the
        # chief fail too, and TensorFlow's fix is to restart both.
        "backoffLimitPerIndex": max_restarts,
        "maxFailedIndexes": 0,
        "podFailurePolicy": {"rules": [
            # Backed up on SIGTERM ("preempted, resume me"): replaced, not counted.
            {"action": "Ignore", "onExitCodes": {
                "containerName": _CONTAINER, "operator": "In",
                "values": [PREEMPTED_EXIT_CODE]}},
            # Preempted, evicted or drained by Kubernetes: the same.
            # `status` too: the schemas of Kubernetes 1.31-1.34 require it.
            {"action": "Ignore",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        # A replacement starts once the old pod is gone: two pods of one index
        # make TensorFlow fail ("Duplicate task registration"). The default
        # with a podFailurePolicy, said here.
        "podReplacementPolicy": "Failed",
    }
    # Who must succeed, as the launcher waits: the chief, or without one
    # every worker. Other pods (ps, workers under ps, an evaluator) never end
    # on their own: Kubernetes stops them once the rule is met.
    leaders = ranks["chief"] if counts["chief"] else ranks["worker"]
    if len(leaders) < tasks:
        first, last = leaders.start, leaders[-1]
        spec["successPolicy"] = {"rules": [
            {"succeededIndexes": f"{first}" if first == last else f"{first}-{last}"}]}
    spec["template"] = {"spec": {
        "subdomain": name,  # with the Service: <name>-<index>.<name> in DNS
        "restartPolicy": "Never",  # a new pod per restart (podFailurePolicy needs it)
        "terminationGracePeriodSeconds": GRACE_PERIOD,
        "containers": [container],
    }}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": dict(metadata),
           "spec": spec}

    leader = (f"the chief (index {leaders.start})" if counts["chief"] else
              "every worker (index" + (f" {leaders.start})" if len(leaders) == 1 else
                                       f"es {leaders.start}-{leaders[-1]})"))
    header = [f"# Kubernetes Job from keras-dist: {recipes._describe(counts)}."]
    header += recipes._comment(
        f"No operator needed (Kubernetes {MIN_KUBERNETES} or newer). Apply with "
        "`kubectl apply -f FILE`, delete with `kubectl delete -f FILE`. The headless "
        f"Service gives pod i of the Job the DNS name {name}-<i>.{name}. Each pod reads "
        f"its role from its index ({INDEX_ENV}) and {K8S_JOBS_ENV}: "
        f"{recipes._slurm_ranks(counts, ('index', 'indexes'))}.")
    if counts["ps"]:
        ending = "; Kubernetes then stops the other pods, which serve until stopped."
    elif counts["evaluator"]:
        ending = "; Kubernetes then stops the evaluator if it still runs."
    else:
        ending = "."
    header += recipes._comment(f"The Job succeeds when {leader} does{ending}")
    header += recipes._comment(
        f"Restarts: a pod that exits with code {PREEMPTED_EXIT_CODE} (it backed up on "
        "SIGTERM) or is disrupted (preempted, evicted, drained) is replaced without "
        "counting; any other failure counts, and the Job fails once one index has "
        f"failed {max_restarts + 1} times (backoffLimitPerIndex: {max_restarts}).")
    header += recipes._comment(
        f"Port {port} has no authentication: keep the pods on a private network "
        "(see docs/security.md).")
    documents = ["\n".join(recipes._yaml(document)) for document in (service, job)]
    return "\n".join(header) + "\n" + "\n---\n".join(documents) + "\n"


def _check_name(name, tasks, names):
    if not isinstance(name, str) or not recipes._DNS_1035.fullmatch(name):
        raise ValueError(
            f"{recipes._show('name', name, names)} is not a valid name for the Job "
            "and its Service (a DNS-1035 label, as Kubernetes requires of a "
            "Service). Use lowercase letters, digits and '-', starting with a "
            "letter and ending with a letter or digit, e.g. "
            f"{recipes._show('name', 'digits-async', names)}.")
    longest = f"{name}-{tasks - 1}"
    if len(longest) > 63:
        raise ValueError(
            f"{recipes._show('name', name, names)} is too long: Kubernetes names "
            f"the Job's pods' hosts <name>-<index>, e.g. {longest!r} ({len(longest)} "
            f"characters), and allows 63. Use a name of at most "
            f"{len(name) - (len(longest) - 63)} characters.")
