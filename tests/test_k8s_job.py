"""Tests for the plain Kubernetes Job of `keras-dist-run --emit k8s`.

The manifest is checked against the Kubernetes API schema, as the
`kubernetes` Python client's models (release 37: the API of Kubernetes 1.37)
type it: each document is deserialized into its model (`V1Service`,
`V1Job`: strict types, every required field) and serialized back, which
must give the document unchanged, because deserializing silently drops a
field the model does not know (a misspelt one). Fields that take one of a
set of values must have one the field's own API description names. The
checker is shown to refuse broken manifests, so a pass means something.

Then each pod's environment is built from the manifest as Kubernetes builds
it (the container's `env`, plus `JOB_COMPLETION_INDEX` and `HOSTNAME`), and
`ClusterConfig.from_env` must give every pod the role, leader, strategy and
address `keras-dist-run` gives the same task (`ClusterConfig.local`).
tests/test_k8s_cluster.py runs such pods as a real cluster.
"""

import argparse
import json
import re
import subprocess
import sys

import pytest
import yaml

from keras_dist import ClusterConfig, recipes
from keras_dist.cluster import k8s

COMMAND = ["python", "train.py", "--epochs", "5"]
IMAGE = "registry.example.com/train:1"
SHAPES = [
    pytest.param(dict(workers=2, ps=0, evaluator=False), id="sync-2-workers"),
    pytest.param(dict(workers=2, ps=1, evaluator=False), id="async-chief-2-workers-1-ps"),
    pytest.param(dict(workers=3, ps=2, evaluator=True), id="async-with-evaluator"),
    pytest.param(dict(workers=2, ps=0, evaluator=True), id="sync-with-evaluator"),
    pytest.param(dict(workers=1, ps=0, evaluator=False), id="one-worker"),
]


def _documents(**kwargs):
    kwargs = {"image": IMAGE, "name": "digits", **kwargs}
    service, job = yaml.safe_load_all(recipes.k8s_job(COMMAND, **kwargs))
    return service, job


def _local_tasks(shape):
    local = ClusterConfig.local(**shape)
    return [local.for_task(role, index) for role, addresses in local.cluster.items()
            for index in range(len(addresses))]


# ------------------------------------------------------------------ schema
# (path of a field in a document, its model, the model's attribute): fields
# whose value must be one of those the API's description of the field names.
ENUMS = [
    (("spec", "clusterIP"), "V1ServiceSpec", "cluster_ip"),
    (("spec", "completionMode"), "V1JobSpec", "completion_mode"),
    (("spec", "podReplacementPolicy"), "V1JobSpec", "pod_replacement_policy"),
    (("spec", "podFailurePolicy", "rules", "*", "action"), "V1PodFailurePolicyRule", "action"),
    (("spec", "podFailurePolicy", "rules", "*", "onExitCodes", "operator"),
     "V1PodFailurePolicyOnExitCodesRequirement", "operator"),
    (("spec", "template", "spec", "restartPolicy"), "V1PodSpec", "restart_policy"),
]


def _values_at(document, path):
    if not path:
        return [document]
    head, *rest = path
    if head == "*":
        return [v for item in document for v in _values_at(item, rest)]
    return _values_at(document[head], rest) if head in document else []


def check_schema(document):
    """Raises unless `document` is a valid object of its kind (see the module
    docstring); returns the model object."""
    from kubernetes import client

    api = client.ApiClient()
    version = document["apiVersion"].rpartition("/")[2]
    model_name = f"{version.upper()}{document['kind']}"
    model = api.deserialize(json.dumps(document), model_name, None)
    back = api.sanitize_for_serialization(model)
    if back != document:
        raise AssertionError(f"{model_name} does not read the document back unchanged "
                             f"(a field it does not know?):\n{back}\n!=\n{document}")
    for path, owner, attribute in ENUMS:
        description = getattr(client, owner).model_fields[attribute].description
        for value in _values_at(document, path):
            if value not in re.findall(r"[A-Za-z]+", description):
                raise AssertionError(f"{'.'.join(path)}={value!r} is not a value "
                                     f"{owner}.{attribute} takes: {description}")
    return model


@pytest.mark.parametrize("shape", SHAPES)
def test_every_document_is_a_valid_kubernetes_object(shape):
    for document in _documents(**shape):
        check_schema(document)
    for document in _documents(namespace="ml-team", port=3333, max_restarts=0, **shape):
        check_schema(document)


def _broken(change):
    service, job = _documents(workers=2, ps=1)
    change(service, job)
    return service, job


BROKEN = [
    pytest.param(lambda s, j: j["spec"].update(completionsMode="Indexed"),
                 "does not read the document back", id="misspelt-field"),
    pytest.param(lambda s, j: j["spec"]["template"]["spec"].update(gracePeriod=30),
                 "does not read the document back", id="unknown-nested-field"),
    pytest.param(lambda s, j: j["spec"].update(completions="4"),
                 "valid integer", id="string-for-integer"),
    pytest.param(lambda s, j: j["spec"]["template"]["spec"]["containers"][0]["env"][0]
                 .update(value=4), "valid string", id="integer-for-string"),
    pytest.param(lambda s, j: j["spec"]["template"]["spec"]["containers"][0].pop("name"),
                 r"V1Container\s+name\s+Input should be a valid string",
                 id="missing-required-field"),
    pytest.param(lambda s, j: j["spec"].update(completionMode="Indexd"),
                 "completionMode='Indexd' is not a value", id="unknown-enum-value"),
    pytest.param(lambda s, j: j["spec"]["podFailurePolicy"]["rules"][0].update(
        action="Restart"), "action='Restart' is not a value", id="unknown-action"),
    pytest.param(lambda s, j: s["spec"].update(clusterIP="none"),
                 "clusterIP='none' is not a value", id="headless-misspelt"),
]


@pytest.mark.parametrize("change,message", BROKEN)
def test_the_schema_check_refuses_a_broken_manifest(change, message):
    service, job = _broken(change)
    with pytest.raises(Exception, match=message):
        for document in (service, job):
            check_schema(document)


# ------------------------------------------------------------- the layout
def _container(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def pod_env(job, index):
    """What Kubernetes gives pod `index` of the Job: its container's `env`,
    the index, and its host name."""
    env = {}
    for item in _container(job)["env"]:
        assert set(item) == {"name", "value"}, item  # no downward API in use
        env[item["name"]] = item["value"]
    env.update(JOB_COMPLETION_INDEX=str(index),
               HOSTNAME=f"{job['metadata']['name']}-{index}")
    return env


@pytest.mark.parametrize("shape", SHAPES)
def test_one_pod_per_task_with_the_launchers_counts(shape):
    service, job = _documents(**shape)
    spec = job["spec"]
    local = ClusterConfig.local(**shape)
    counts = {role: len(addresses) for role, addresses in local.cluster.items()}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == sum(counts.values())
    env = pod_env(job, 0)
    assert recipes.FORMATS == ("tfjob", "k8s", "slurm")
    assert dict(pair.split(":") for pair in env["KERAS_DIST_K8S_JOBS"].split(",")) == {
        role: str(n) for role, n in counts.items()}
    container = _container(job)
    assert container["image"] == IMAGE
    assert container["command"] + container["args"] == COMMAND
    assert "TF_CONFIG" not in env
    assert env["GRPC_FAIL_FAST"] == "use_caller"  # what keras-dist-run sets too
    # The Service gives the pods their DNS names: headless, selecting the
    # label the Job controller puts on the Job's pods, the pods' subdomain.
    assert service["metadata"]["name"] == job["metadata"]["name"] == "digits"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "digits"}
    assert job["spec"]["template"]["spec"]["subdomain"] == "digits"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]


@pytest.mark.parametrize("shape", SHAPES)
def test_pods_read_the_roles_leader_and_strategy_the_launcher_gives(shape):
    _, job = _documents(port=2345, **shape)
    tasks = job["spec"]["completions"]
    configs = [ClusterConfig.from_env(pod_env(job, index)) for index in range(tasks)]
    local_tasks = _local_tasks(shape)
    if tasks == 1:  # one pod: a single machine, as one local worker
        assert configs == [None] and local_tasks[0].strategy_kind is None
        return
    assert sorted((c.task_type, c.task_index) for c in configs) == sorted(
        (t.task_type, t.task_index) for t in local_tasks)
    for index, config in enumerate(configs):
        local = next(t for t in local_tasks
                     if (t.task_type, t.task_index) == (config.task_type, config.task_index))
        assert config.source == "Kubernetes"
        assert config.is_chief == local.is_chief
        assert config.strategy_kind == local.strategy_kind
        assert {r: len(a) for r, a in config.cluster.items()} == {
            r: len(a) for r, a in local.cluster.items()}
        # What the others dial for this pod: its DNS name through the Service.
        assert config.address == f"digits-{index}.digits:2345"
    assert sum(c.is_chief for c in configs) == 1


@pytest.mark.parametrize("shape,rank_roles", [
    (dict(workers=2, ps=1), ["chief", "ps", "worker", "worker"]),
    (dict(workers=2, ps=1, evaluator=True), ["chief", "evaluator", "ps", "worker", "worker"]),
    (dict(workers=3), ["worker"] * 3),
    (dict(workers=2, evaluator=True), ["evaluator", "worker", "worker"]),
])
def test_indexes_go_to_roles_as_slurm_ranks_do(shape, rank_roles):
    _, job = _documents(**shape)
    roles = [ClusterConfig.from_env(pod_env(job, i)).task_type for i in range(len(rank_roles))]
    assert roles == rank_roles
    # Both recipes' headers say so, in the same words but the unit.
    counts = recipes._counts(shape["workers"], shape.get("ps", 0),
                             shape.get("evaluator", False), {})
    ranks = recipes._slurm_ranks(counts)
    assert ranks.startswith("rank")
    assert ranks in _comments(recipes.slurm(COMMAND, **shape))
    assert ranks.replace("ranks ", "indexes ").replace("rank ", "index ") in _comments(
        recipes.k8s_job(COMMAND, image=IMAGE, **shape))


def _comments(text):
    """A recipe's comment lines, as one line."""
    return " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))


# ------------------------------------------------------- ends and restarts
@pytest.mark.parametrize("shape,indexes", [
    (dict(workers=2, ps=1), "0"),                       # the chief
    (dict(workers=3, ps=2, evaluator=True), "0"),       # the chief, before the evaluator
    (dict(workers=2, evaluator=True), "1-2"),           # the workers, not the evaluator
    (dict(workers=2), None),                            # every index: Kubernetes' default
    (dict(workers=1), None),
])
def test_the_job_succeeds_when_the_launcher_would_stop(shape, indexes):
    _, job = _documents(**shape)
    policy = job["spec"].get("successPolicy")
    if indexes is None:
        assert policy is None
        return
    assert policy == {"rules": [{"succeededIndexes": indexes}]}
    first, _, last = indexes.partition("-")
    needed = set(range(int(first), int(last or first) + 1))
    configs = {i: ClusterConfig.from_env(pod_env(job, i))
               for i in range(job["spec"]["completions"])}
    # The launcher waits for the chief, or without one for every worker.
    if shape.get("ps"):
        assert needed == {i for i, c in configs.items() if c.is_chief}
    else:
        assert needed == {i for i, c in configs.items() if c.task_type == "worker"}


def test_restarts_count_per_task_and_preemptions_do_not():
    from keras_dist.callbacks import BackupAndRestore, PREEMPTED_EXIT_CODE
    from keras_dist.cluster import launch

    _, job = _documents(workers=2, ps=1, max_restarts=5)
    spec = job["spec"]
    assert spec["backoffLimitPerIndex"] == 5 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec  # per index instead
    rules = spec["podFailurePolicy"]["rules"]
    container = _container(job)["name"]
    assert rules == [
        {"action": "Ignore", "onExitCodes": {"containerName": container, "operator": "In",
                                             "values": [PREEMPTED_EXIT_CODE]}},
        # Without `status` the Job fails schema validation on Kubernetes
        # 1.31-1.34 ("'status' is a required property", issue 48).
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                  "status": "True"}]},
    ]
    assert spec["podReplacementPolicy"] == "Failed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # The time to back up: the launcher's, and BackupAndRestore's default.
    default = BackupAndRestore.__init__.__defaults__[-1]
    assert pod["terminationGracePeriodSeconds"] == launch.PREEMPTION_WAIT == default


def test_the_header_says_how_the_job_ends_and_restarts():
    flat = _comments(recipes.k8s_job(COMMAND, workers=2, ps=1, image=IMAGE, max_restarts=2))
    assert "The Job succeeds when the chief (index 0) does" in flat
    assert "index 0 is the chief, index 1 is ps 0, indexes 2-3 are workers 0-1" in flat
    assert "failed 3 times (backoffLimitPerIndex: 2)" in flat
    assert "Kubernetes 1.31 or newer" in flat
    sync = _comments(recipes.k8s_job(COMMAND, workers=3, image=IMAGE))
    assert "The Job succeeds when every worker (indexes 0-2) does." in sync


def test_every_string_is_quoted_so_yaml_reads_it_back_unchanged():
    nasty = ["python", "train.py", "yes", "no", "null", "~", "123", "1e3", "- x",
             "# not a comment", "a: b", "{x: 1}", "[1, 2]", '"', "'", "\\", "a\nb",
             "\ttab", "é", "😀 emoji", "\x7f", "", "  padded  ", "*alias", "&anchor",
             "!tag", "%percent", "@at", "`tick`", "$(rm -rf /)", "--flag=a b"]
    service, job = yaml.safe_load_all(recipes.k8s_job(
        nasty, workers=2, ps=1, image="img@sha256:" + "0" * 64, name="x"))
    container = _container(job)
    assert container["command"] + container["args"] == nasty
    check_schema(job)


def test_a_command_without_arguments_has_no_args_and_a_namespace_goes_on_both():
    service, job = _documents(workers=2, namespace="ml-team")
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml-team"
    _, job = yaml.safe_load_all(recipes.k8s_job(["./train"], workers=2, image=IMAGE))
    assert _container(job)["command"] == ["./train"] and "args" not in _container(job)


# -------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,message", [
    (dict(name="My_Job"), r"name='My_Job' is not a valid name for the Job and its "
                          r"Service \(a DNS-1035 label"),
    (dict(name="1job"), r"name='1job' is not a valid name.*starting with a letter"),
    (dict(name="job-"), r"name='job-' is not a valid name"),
    (dict(name="j" * 62), r"too long.*'j{62}-1' \(64 characters\).*at most 61"),
    (dict(namespace="Team_A"), r"namespace='Team_A' is not a Kubernetes namespace"),
    (dict(image=""), r"non-empty name without spaces\. Received: image=''"),
    (dict(port=0), r"`port` must be an integer from 1 to 65535\. Received: port=0"),
    (dict(max_restarts=-1), r"`max_restarts` must be an integer 0 or more"),
    (dict(workers=0), r"`workers` must be an integer at least 1"),
    (dict(ps=-1), r"`ps` must be an integer 0 or more"),
])
def test_k8s_job_refuses_what_kubernetes_would(kwargs, message):
    kwargs = {"workers": 2, "image": IMAGE, **kwargs}
    with pytest.raises(ValueError, match=message):
        recipes.k8s_job(COMMAND, **kwargs)


def test_the_name_limit_is_the_pods_host_names():
    name = "j" * 61  # j...j-1 is 63 characters, the limit
    _, job = yaml.safe_load_all(recipes.k8s_job(COMMAND, workers=2, image=IMAGE, name=name))
    check_schema(job)
    with pytest.raises(ValueError, match=r"'j{61}-10' \(64 characters\).*at most 60"):
        recipes.k8s_job(COMMAND, workers=11, image=IMAGE, name=name)


# ------------------------------------------------------------ the launcher
def _args(*argv):
    parser = argparse.ArgumentParser(prog="keras-dist-run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=0)
    parser.add_argument("--evaluator", action="store_true")
    parser.add_argument("--max-restarts", type=int, default=3)
    recipes.add_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser.parse_args(list(argv))


def test_emit_k8s_matches_the_function():
    args = _args("--workers", "3", "--ps", "1", "--evaluator", "--max-restarts", "7",
                 "--emit", "k8s", "--image", IMAGE, "--job-name", "digits",
                 "--port", "2345", "--", *COMMAND)
    assert recipes.emit_from_args(args) == recipes.k8s_job(
        COMMAND, workers=3, ps=1, evaluator=True, image=IMAGE, name="digits",
        port=2345, max_restarts=7)


@pytest.mark.parametrize("argv,message", [
    (["--emit", "k8s"], r"--emit k8s needs --image.*Received: no --image"),
    (["--emit", "k8s", "--image", "img", "--port", "70000"],
     r"`port` must be an integer from 1 to 65535\. Received: --port 70000"),
    (["--emit", "k8s", "--image", "img", "--job-name", "My_Job"],
     r"--job-name My_Job is not a valid name.*e\.g\. --job-name digits-async"),
    (["--emit", "k8s", "--image", "img", "--max-restarts", "-2"],
     r"`max_restarts` must be an integer 0 or more\. Received: --max-restarts -2"),
])
def test_emit_k8s_errors_name_the_flag_the_value_and_the_fix(argv, message):
    with pytest.raises(ValueError, match=message):
        recipes.emit_from_args(_args(*argv, "--", *COMMAND))


@pytest.mark.multiprocess
def test_the_launcher_prints_the_manifest_without_importing_tensorflow(tmp_path):
    code = ("import sys; from keras_dist.cluster import launch; "
            "code = launch.main(['--workers', '2', '--ps', '1', '--emit', 'k8s', "
            "'--image', 'img:1', '--', 'python', 'train.py']); "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules), "
            "code, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stderr.strip() == "[] 0"
    service, job = yaml.safe_load_all(out.stdout)
    check_schema(service)
    check_schema(job)


@pytest.mark.multiprocess
def test_the_launcher_refuses_emit_k8s_without_an_image():
    out = subprocess.run([sys.executable, "-m", "keras_dist.cluster.launch", "--emit", "k8s",
                          "--", "python", "train.py"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert "--emit k8s needs --image" in out.stderr


# ------------------------------------------------------- what a pod reads
POD = {"JOB_COMPLETION_INDEX": "2", "KERAS_DIST_K8S_JOBS": "chief:1,worker:2,ps:1",
       "KERAS_DIST_K8S_JOB_NAME": "digits", "KERAS_DIST_K8S_SERVICE": "svc",
       "KERAS_DIST_K8S_PORT": "2222"}


def test_from_kubernetes_reads_only_the_environment_it_is_given(monkeypatch):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    config = ClusterConfig.from_kubernetes(POD)
    assert (config.task_type, config.task_index) == ("worker", 0)
    assert config.address == "digits-2.svc:2222"
    assert config.cluster == {"chief": ("digits-0.svc:2222",), "ps": ("digits-1.svc:2222",),
                              "worker": ("digits-2.svc:2222", "digits-3.svc:2222")}
    assert config.source == "Kubernetes"
    for key, value in POD.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert ClusterConfig.from_kubernetes().task_index == 1  # os.environ by default


def test_from_env_order_is_tf_config_then_kubernetes_then_slurm():
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                            "task": {"type": "worker", "index": 1}})
    assert ClusterConfig.from_env({**POD, "TF_CONFIG": tf_config}).source == "TF_CONFIG"
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert ClusterConfig.from_env({**POD, **slurm}).source == "Kubernetes"
    assert ClusterConfig.from_env(slurm).source == "SLURM"
    # An Indexed Job of keras-dist's with one pod: a single machine.
    assert ClusterConfig.from_env({**POD, "KERAS_DIST_K8S_JOBS": "worker:1",
                                   "JOB_COMPLETION_INDEX": "0"}) is None
    # Another Indexed Job's pod (no roles from keras-dist): not a cluster.
    assert ClusterConfig.from_env({"JOB_COMPLETION_INDEX": "3"}) is None
    assert ClusterConfig.from_env({**POD, "KERAS_DIST_K8S_JOBS": " "}) is None


@pytest.mark.parametrize("change,message", [
    (dict(JOB_COMPLETION_INDEX=None),
     r"JOB_COMPLETION_INDEX is not set: this process is not in a pod of an Indexed Job.*"
     r"KERAS_DIST_K8S_JOBS='chief:1,worker:2,ps:1' says it should be one of 4 tasks"),
    (dict(JOB_COMPLETION_INDEX="4"),
     r"JOB_COMPLETION_INDEX='4' is not an index of the Job's 4 tasks \(0\.\.3, from "
     r"KERAS_DIST_K8S_JOBS='chief:1,worker:2,ps:1'\)\. .*completions: 4"),
    (dict(JOB_COMPLETION_INDEX="one"), r"JOB_COMPLETION_INDEX='one' is not an index"),
    (dict(KERAS_DIST_K8S_JOBS="chief:1,boss:2"),
     r"KERAS_DIST_K8S_JOBS='chief:1,boss:2' is malformed: 'boss' in 'boss:2' is not a "
     r"role.*e\.g\. KERAS_DIST_K8S_JOBS=chief:1,ps:1,worker:2"),
    (dict(KERAS_DIST_K8S_JOBS="worker:x"), r"the count 'x' in 'worker:x' is not an integer"),
    (dict(KERAS_DIST_K8S_JOBS="worker:2,ps:1"),
     r"'ps' tasks but no 'chief'.*Roles from KERAS_DIST_K8S_JOBS='worker:2,ps:1'"),
    (dict(KERAS_DIST_K8S_PORT="http"),
     r"KERAS_DIST_K8S_PORT='http' is not a port.*KERAS_DIST_K8S_PORT=2222"),
    (dict(KERAS_DIST_K8S_SERVICE="My_Service"),
     r"KERAS_DIST_K8S_SERVICE='My_Service' is not a Kubernetes name"),
    (dict(KERAS_DIST_K8S_JOB_NAME=None), r"KERAS_DIST_K8S_JOB_NAME='' is not a Kubernetes"),
])
def test_from_env_in_a_bad_pod_says_which_variable_and_the_fix(change, message):
    env = {key: value for key, value in {**POD, **change}.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_env(env)


def test_from_kubernetes_outside_a_job_says_what_is_missing():
    with pytest.raises(ValueError, match=r"KERAS_DIST_K8S_JOBS is not set.*--emit k8s"):
        ClusterConfig.from_kubernetes({"JOB_COMPLETION_INDEX": "0"})


def test_the_variables_are_the_manifests():
    from keras_dist.cluster import config as cluster

    _, job = _documents(workers=2)
    names = {item["name"] for item in _container(job)["env"]}
    assert {cluster.K8S_JOBS_ENV, k8s.JOB_NAME_ENV, k8s.SERVICE_ENV, k8s.PORT_ENV} <= names
    assert cluster.K8S_JOBS_ENV == "KERAS_DIST_K8S_JOBS"


def test_the_manifest_the_docs_show_is_what_emit_k8s_prints():
    import docblocks

    blocks = docblocks.parse_page("docs/kubernetes-and-slurm.md")
    (shown,) = [b for b in blocks if b.kind == "text" and "`digits-job.yaml` holds" in b.before]
    assert shown.code.rstrip("\n") == recipes.k8s_job(
        ["python", "examples/train_digits.py", "--epochs", "5"], workers=2, ps=1,
        image="registry.example.com/digits:1", name="digits").rstrip("\n")
