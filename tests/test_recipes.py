"""Tests for `keras_dist.recipes`: TFJob manifests and SLURM batch scripts.

Each recipe is checked the way its scheduler would read it: the manifest is
parsed with PyYAML and the `TF_CONFIG` the Kubeflow training operator would
set in each pod is built from it (as `genClusterSpec` in the operator's
`pkg/controller.v1/tensorflow/tensorflow.go` does); the batch script is run by
bash with a stand-in `srun` that records what it was given, and the SLURM
variables `srun` sets are added for every rank. Each task's
`ClusterConfig.from_env` must then see the role and layout that
`keras-dist-run` gives it on one machine (`ClusterConfig.local`).
"""

import argparse
import json
import math
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml

from keras_dist import ClusterConfig, recipes

COMMAND = ["python", "train.py", "--epochs", "5"]
IMAGE = "registry.example.com/train:1"
REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS",
                 "evaluator": "Evaluator"}
SHAPES = [
    pytest.param(dict(workers=2, ps=0, evaluator=False), id="sync-2-workers"),
    pytest.param(dict(workers=2, ps=1, evaluator=False), id="async-chief-2-workers-1-ps"),
    pytest.param(dict(workers=3, ps=2, evaluator=True), id="async-with-evaluator"),
    pytest.param(dict(workers=2, ps=0, evaluator=True), id="sync-with-evaluator"),
    pytest.param(dict(workers=1, ps=0, evaluator=False), id="one-worker"),
]


def _local_counts(shape):
    """Tasks per role that `keras-dist-run` starts for these flags."""
    local = ClusterConfig.local(**shape)
    return {role: len(addresses) for role, addresses in local.cluster.items()}


def _local_tasks(shape):
    local = ClusterConfig.local(**shape)
    return [local.for_task(role, index) for role, addresses in local.cluster.items()
            for index in range(len(addresses))]


@pytest.mark.multiprocess
def test_importing_recipes_does_not_import_tensorflow_or_keras():
    code = ("import sys, keras_dist.recipes; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------- TFJob
def _replica(manifest, replica_type):
    return manifest["spec"]["tfReplicaSpecs"][replica_type]


def _container(replica):
    (container,) = replica["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("shape", SHAPES)
def test_tfjob_has_one_replica_spec_per_role_with_the_launchers_counts(shape):
    manifest = yaml.safe_load(recipes.tfjob(COMMAND, image=IMAGE, name="digits", **shape))
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "digits"}
    expected = {REPLICA_TYPES[role]: n for role, n in _local_counts(shape).items()}
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {rtype: spec["replicas"] for rtype, spec in specs.items()} == expected
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Never", "OnFailure")
        container = _container(spec)
        assert container["name"] == "tensorflow"  # the operator requires it
        assert container["image"] == IMAGE
        assert container["command"] + container.get("args", []) == COMMAND
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        env = {item["name"]: item["value"] for item in container["env"]}
        assert env["GRPC_FAIL_FAST"] == "use_caller"  # as keras-dist-run sets it
        assert "TF_CONFIG" not in env  # the operator sets it
    # Servers never exit on their own: they must go when the job is done.
    assert manifest["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"


def test_tfjob_async_restarts_workers_and_ends_with_the_chief():
    manifest = yaml.safe_load(
        recipes.tfjob(COMMAND, workers=2, ps=1, image=IMAGE, max_restarts=5))
    assert _replica(manifest, "Worker")["restartPolicy"] == "OnFailure"
    assert _replica(manifest, "Chief")["restartPolicy"] == "Never"
    assert _replica(manifest, "PS")["restartPolicy"] == "Never"
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == 5
    assert "successPolicy" not in manifest["spec"]  # the chief decides


def test_tfjob_sync_waits_for_every_worker_and_never_restarts():
    manifest = yaml.safe_load(recipes.tfjob(COMMAND, workers=3, image=IMAGE))
    assert manifest["spec"]["successPolicy"] == "AllWorkers"
    assert _replica(manifest, "Worker")["restartPolicy"] == "Never"
    assert "backoffLimit" not in manifest["spec"]["runPolicy"]


def test_tfjob_namespace_port_and_command_without_args():
    manifest = yaml.safe_load(recipes.tfjob(
        ["./train"], workers=2, image=IMAGE, namespace="ml-team", port=3333))
    assert manifest["metadata"] == {"name": "keras-dist", "namespace": "ml-team"}
    container = _container(_replica(manifest, "Worker"))
    assert container["command"] == ["./train"] and "args" not in container
    assert container["ports"] == [{"name": "tfjob-port", "containerPort": 3333}]


def test_tfjob_quotes_every_string_so_yaml_reads_it_back_unchanged():
    nasty = ["python", "train.py", "yes", "no", "null", "~", "123", "1e3", "- x",
             "# not a comment", "a: b", "{x: 1}", "[1, 2]", '"', "'", "\\", "a\nb",
             "\ttab", "é", "😀 emoji", "\x7f", "", "  padded  ", "*alias", "&anchor",
             "!tag", "%percent", "@at", "`tick`", "$(rm -rf /)", "--flag=a b"]
    manifest = yaml.safe_load(recipes.tfjob(
        nasty, workers=2, ps=1, image="img@sha256:" + "0" * 64, name="x"))
    for spec in manifest["spec"]["tfReplicaSpecs"].values():
        container = _container(spec)
        assert container["command"] + container["args"] == nasty
        assert container["image"] == "img@sha256:" + "0" * 64


def _operator_env(manifest, replica_type, index):
    """The environment the training operator (v1.9) gives one replica's pod.

    Mirrors `SetClusterSpec` + `genClusterSpec`: no `TF_CONFIG` when the job
    has a single replica; otherwise every replica type, lowercased, lists
    `<job>-<role>-<i>.<namespace>.svc:<port>`, the port being the one named
    `tfjob-port` on the container named `tensorflow` (else 2222).
    """
    name = manifest["metadata"]["name"]
    namespace = manifest["metadata"].get("namespace", "default")  # kubectl's default
    specs = manifest["spec"]["tfReplicaSpecs"]
    container = _container(specs[replica_type])
    env = {item["name"]: item["value"] for item in container.get("env", [])}
    if sum(spec["replicas"] for spec in specs.values()) == 1:
        return env
    cluster = {}
    for rtype, spec in specs.items():
        port = next((p["containerPort"] for c in spec["template"]["spec"]["containers"]
                     if c["name"] == "tensorflow" for p in c.get("ports", [])
                     if p["name"] == "tfjob-port"), 2222)
        role = rtype.lower()
        cluster[role] = [f"{name}-{role}-{i}.{namespace}.svc:{port}"
                         for i in range(spec["replicas"])]
    env["TF_CONFIG"] = json.dumps({
        "cluster": cluster,
        "task": {"type": replica_type.lower(), "index": index},
        "environment": "cloud",
    })
    return env


@pytest.mark.parametrize("shape", SHAPES)
def test_tfjob_pods_read_the_roles_and_strategy_the_launcher_gives(shape):
    manifest = yaml.safe_load(
        recipes.tfjob(COMMAND, image=IMAGE, name="digits", port=2345, **shape))
    for local in _local_tasks(shape):
        replica_type = REPLICA_TYPES[local.task_type]
        config = ClusterConfig.from_env(_operator_env(manifest, replica_type,
                                                      local.task_index))
        if config is None:  # one replica: no TF_CONFIG, a single machine
            assert local.strategy_kind is None and local.is_chief
            continue
        assert (config.task_type, config.task_index) == (local.task_type,
                                                         local.task_index)
        assert config.strategy_kind == local.strategy_kind
        assert config.is_chief == local.is_chief
        assert {r: len(a) for r, a in config.cluster.items()} == _local_counts(shape)
        assert config.address == (f"digits-{local.task_type}-{local.task_index}"
                                  ".default.svc:2345")


def test_tfjob_async_pods_get_parameter_server_training_led_by_the_chief():
    manifest = yaml.safe_load(recipes.tfjob(COMMAND, workers=2, ps=1, image=IMAGE))
    chief = ClusterConfig.from_env(_operator_env(manifest, "Chief", 0))
    worker = ClusterConfig.from_env(_operator_env(manifest, "Worker", 0))
    assert chief.strategy_kind == worker.strategy_kind == "parameter_server"
    assert chief.is_chief and not worker.is_chief


def test_tfjob_sync_pods_are_led_by_worker_0():
    manifest = yaml.safe_load(recipes.tfjob(COMMAND, workers=2, image=IMAGE))
    leaders = [ClusterConfig.from_env(_operator_env(manifest, "Worker", i)).is_chief
               for i in range(2)]
    assert leaders == [True, False]
    assert ClusterConfig.from_env(
        _operator_env(manifest, "Worker", 1)).strategy_kind == "multi_worker"


# -------------------------------------------------------------------- SLURM
SLURM_SHAPES = [
    pytest.param(2, 1, id="2-workers-1-per-node"),
    pytest.param(4, 1, id="4-workers-1-per-node"),
    pytest.param(3, 2, id="3-workers-2-per-node"),
    pytest.param(4, 2, id="4-workers-2-per-node"),
    pytest.param(1, 1, id="one-worker"),
]


def _sbatch(script, option):
    values = re.findall(rf"^#SBATCH --{option}=(\S+)$", script, re.MULTILINE)
    assert len(values) <= 1, f"--{option} given twice"
    return values[0] if values else None


def _bash_syntax_ok(script, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _run_with_fake_srun(script, tmp_path, extra_env=None):
    """Runs the batch script with a stand-in `srun`; returns its argv and env.

    The script must call `srun` exactly once (one job step for all tasks).
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\n'
                    'echo called >> "$RECORD.calls"\n'
                    'printf "%s\\0" "$@" > "$RECORD.argv"\n'
                    'env -0 > "$RECORD.env"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    job = tmp_path / "job.sh"
    job.write_text(script)
    record = tmp_path / "record"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "RECORD": str(record), **(extra_env or {})}
    subprocess.run(["bash", str(job)], env=env, check=True, timeout=30)
    assert (tmp_path / "record.calls").read_text() == "called\n"
    argv = (tmp_path / "record.argv").read_bytes().split(b"\0")[:-1]
    pairs = (tmp_path / "record.env").read_bytes().split(b"\0")[:-1]
    recorded = dict(p.decode().split("=", 1) for p in pairs)
    for name in ("RECORD", "PATH", "HOME", "PWD", "SHLVL", "_", "OLDPWD"):
        recorded.pop(name, None)
    return [a.decode() for a in argv], recorded


def _block_layout(tasks, per_node):
    """Nodes, SLURM's tasks-per-node string and each rank's node, as `srun
    --distribution=block` lays out `tasks` tasks at most `per_node` a node."""
    nodes = math.ceil(tasks / per_node)
    counts = [min(per_node, tasks - per_node * n) for n in range(nodes)]
    hosts = [f"node{n + 1}" for n in range(nodes)]
    runs = []  # SLURM compresses repeats: "2(x2),1"
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    tasks_per_node = ",".join(f"{c}(x{r})" if r > 1 else str(c) for c, r in runs)
    rank_hosts = [host for host, count in zip(hosts, counts) for _ in range(count)]
    nodelist = f"node[1-{nodes}]" if nodes > 1 else "node1"
    return nodelist, tasks_per_node, rank_hosts


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,per_node", SLURM_SHAPES)
def test_slurm_script_is_valid_bash_asking_for_one_slurm_task_per_tf_task(
        workers, per_node, tmp_path):
    script = recipes.slurm(COMMAND, workers=workers, tasks_per_node=per_node,
                           name="digits")
    assert script.startswith("#!/bin/bash\n")
    _bash_syntax_ok(script, tmp_path)
    tasks = sum(_local_counts(dict(workers=workers)).values())
    assert int(_sbatch(script, "ntasks")) == tasks
    nodes, ntasks_per_node = int(_sbatch(script, "nodes")), int(_sbatch(script, "ntasks-per-node"))
    assert nodes * ntasks_per_node >= tasks and (nodes - 1) * ntasks_per_node < tasks
    assert _sbatch(script, "job-name") == "digits"
    assert _sbatch(script, "time") == "01:00:00"
    # #SBATCH lines are read only before the first command.
    first_command = next(i for i, line in enumerate(script.splitlines()[1:], 1)
                         if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines())
               if line.startswith("#SBATCH"))


@pytest.mark.multiprocess
def test_slurm_script_runs_the_exact_command_once_through_srun(tmp_path):
    command = ["python", "train.py", "--note", "it's \"quoted\" $(rm -rf /) `x` ; |",
               "a b", "*", "\\", "é"]
    script = recipes.slurm(command, workers=3, tasks_per_node=2, cpus_per_task=4)
    argv, _ = _run_with_fake_srun(script, tmp_path)
    assert argv[-len(command):] == command
    options = argv[:-len(command)]
    assert all(option.startswith("--") for option in options)
    assert "--ntasks=3" in options and "--kill-on-bad-exit=1" in options
    assert "--cpus-per-task=4" in options  # srun does not always inherit it
    assert _sbatch(script, "cpus-per-task") == "4"


@pytest.mark.multiprocess
def test_slurm_script_drops_a_tf_config_from_the_submitting_shell(tmp_path):
    stale = json.dumps({"cluster": {"worker": ["laptop:1234"]},
                        "task": {"type": "worker", "index": 0}})
    _, env = _run_with_fake_srun(recipes.slurm(COMMAND, workers=2), tmp_path,
                                 {"TF_CONFIG": stale, "GRPC_FAIL_FAST": "true"})
    assert "TF_CONFIG" not in env  # it would win over SLURM in from_env
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["GRPC_FAIL_FAST"] == "true"  # the user's own setting is kept
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "2"


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,per_node", SLURM_SHAPES)
def test_slurm_ranks_read_the_roles_and_strategy_the_launcher_gives(
        workers, per_node, tmp_path):
    script = recipes.slurm(COMMAND, workers=workers, tasks_per_node=per_node)
    _, exported = _run_with_fake_srun(script, tmp_path)
    tasks = int(_sbatch(script, "ntasks"))
    nodelist, tasks_per_node, rank_hosts = _block_layout(tasks, per_node)
    local_tasks = _local_tasks(dict(workers=workers))
    assert len(local_tasks) == tasks
    for rank, local in enumerate(local_tasks):
        env = {**exported, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
               "SLURM_STEP_NODELIST": nodelist,
               "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
               "SLURMD_NODENAME": rank_hosts[rank]}
        config = ClusterConfig.from_env(env)
        if config is None:  # a one-task step: a single machine, as one local worker
            assert tasks == 1 and local.strategy_kind is None
            continue
        assert config.source == "SLURM"
        assert (config.task_type, config.task_index) == ("worker", rank)
        assert (config.task_type, config.task_index) == (local.task_type,
                                                         local.task_index)
        assert config.strategy_kind == local.strategy_kind == "multi_worker"
        assert config.is_chief == local.is_chief == (rank == 0)
        # The address others dial for this task is on the node srun put it on.
        assert config.address.rpartition(":")[0] == rank_hosts[rank]


def _slurm_rank_configs(script, tmp_path, per_node=1):
    """Each rank's `ClusterConfig.from_env`, in the environment srun gives it."""
    _, exported = _run_with_fake_srun(script, tmp_path)
    tasks = int(_sbatch(script, "ntasks"))
    nodelist, tasks_per_node, rank_hosts = _block_layout(tasks, per_node)
    configs = [ClusterConfig.from_env({
        **exported, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURMD_NODENAME": rank_hosts[rank]}) for rank in range(tasks)]
    return configs, rank_hosts, exported


ASYNC_SLURM_SHAPES = [
    pytest.param(dict(workers=2, ps=1, evaluator=False), 1,
                 ["chief", "ps", "worker", "worker"], id="chief-2-workers-1-ps"),
    pytest.param(dict(workers=2, ps=1, evaluator=True), 1,
                 ["chief", "evaluator", "ps", "worker", "worker"],
                 id="chief-2-workers-1-ps-evaluator"),
    pytest.param(dict(workers=3, ps=2, evaluator=True), 2,
                 ["chief", "evaluator", "ps", "ps", "worker", "worker", "worker"],
                 id="chief-3-workers-2-ps-evaluator-2-per-node"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape,per_node,rank_roles", ASYNC_SLURM_SHAPES)
def test_slurm_async_ranks_read_the_roles_the_launcher_gives(
        shape, per_node, rank_roles, tmp_path):
    script = recipes.slurm(COMMAND, tasks_per_node=per_node, **shape)
    configs, rank_hosts, exported = _slurm_rank_configs(script, tmp_path, per_node)
    counts = _local_counts(shape)
    assert exported["KERAS_DIST_SLURM_JOBS"] == ",".join(
        f"{role}:{n}" for role, n in counts.items())
    assert len(configs) == sum(counts.values())
    # TensorFlow's resolver: roles in alphabetical order, each taking the next ranks.
    assert [c.task_type for c in configs] == rank_roles
    for config in configs:
        assert config.source == "SLURM"
        assert config.strategy_kind == "parameter_server"
        assert {r: len(a) for r, a in config.cluster.items()} == counts
    assert [c.is_chief for c in configs] == [True] + [False] * (len(configs) - 1)
    # Every (role, index) of the local cluster, exactly once.
    assert sorted((c.task_type, c.task_index) for c in configs) == sorted(
        (t.task_type, t.task_index) for t in _local_tasks(shape))
    # The address others dial for each task is on the node srun put it on.
    for rank, config in enumerate(configs):
        assert config.address.rpartition(":")[0] == rank_hosts[rank]
    # The script's header says the same.
    assert "rank 0 is the chief" in script and "The chief leads." in script


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", SHAPES)
def test_slurm_ranks_of_every_layout_match_the_launchers_tasks(shape, tmp_path):
    script = recipes.slurm(COMMAND, **shape)
    configs, _, _ = _slurm_rank_configs(script, tmp_path)
    local_tasks = _local_tasks(shape)
    if len(local_tasks) == 1:  # a one-task step: no cluster, as one local worker
        assert configs == [None] and local_tasks[0].strategy_kind is None
        return
    assert sorted((c.task_type, c.task_index) for c in configs) == sorted(
        (t.task_type, t.task_index) for t in local_tasks)
    for config in configs:
        local = next(t for t in local_tasks
                     if (t.task_type, t.task_index) == (config.task_type,
                                                        config.task_index))
        assert config.is_chief == local.is_chief
        assert config.strategy_kind == local.strategy_kind
    assert sum(c.is_chief for c in configs) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("ps,wait", [(0, False), (1, True), (2, True)])
def test_slurm_srun_waits_60_s_after_the_first_exit_only_with_ps(ps, wait, tmp_path):
    argv, _ = _run_with_fake_srun(recipes.slurm(COMMAND, workers=2, ps=ps), tmp_path)
    options = argv[:-len(COMMAND)]
    assert ("--wait=60" in options) == wait
    assert "--kill-on-bad-exit=1" in options


@pytest.mark.multiprocess
def test_slurm_script_overrides_a_role_layout_from_the_submitting_shell(tmp_path):
    _, env = _run_with_fake_srun(recipes.slurm(COMMAND, workers=3), tmp_path,
                                 {"KERAS_DIST_SLURM_JOBS": "chief:1,ps:1,worker:1"})
    assert env["KERAS_DIST_SLURM_JOBS"] == "worker:3"


def test_slurm_jobs_variable_name_is_the_clusters():
    from keras_dist.cluster import config as cluster
    assert recipes.SLURM_JOBS_ENV == cluster.SLURM_JOBS_ENV == "KERAS_DIST_SLURM_JOBS"


@pytest.mark.multiprocess
# TensorFlow's SlurmClusterResolver sorts host names as text (rank 1 of
# node[1-10] got node10's address); from_slurm keeps SLURM's node order.
def test_slurm_addresses_follow_srun_placement_on_ten_nodes(tmp_path):
    script = recipes.slurm(COMMAND, workers=10)
    _, exported = _run_with_fake_srun(script, tmp_path)
    nodelist, tasks_per_node, rank_hosts = _block_layout(10, 1)
    assert nodelist == "node[1-10]"
    for rank in range(10):
        config = ClusterConfig.from_env({
            **exported, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "10",
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node})
        assert config.address == f"{rank_hosts[rank]}:8888"


# ------------------------------------------------------------- the launcher
def _launcher_parser():
    """The launcher's own options (see keras_dist/cluster/launch.py) plus the recipes'."""
    parser = argparse.ArgumentParser(prog="keras-dist-run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=0)
    parser.add_argument("--evaluator", action="store_true")
    parser.add_argument("--max-restarts", type=int, default=3)
    recipes.add_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def _args(*argv):
    return _launcher_parser().parse_args(list(argv))


def test_add_arguments_defaults_mean_run_locally():
    args = _args("--", "python", "train.py")
    assert (args.emit, args.image, args.job_name, args.port) == (
        None, None, None, None)


def test_add_arguments_refuses_an_unknown_format(capsys):
    with pytest.raises(SystemExit):
        _args("--emit", "helm", "--", "python", "train.py")
    assert "invalid choice: 'helm'" in capsys.readouterr().err


def test_emit_from_args_matches_the_functions():
    args = _args("--workers", "3", "--ps", "1", "--evaluator", "--max-restarts", "7",
                 "--emit", "tfjob", "--image", IMAGE, "--job-name", "digits",
                 "--port", "2345", "--", *COMMAND)
    assert recipes.emit_from_args(args) == recipes.tfjob(
        COMMAND, workers=3, ps=1, evaluator=True, image=IMAGE, name="digits",
        port=2345, max_restarts=7)
    args = _args("--workers", "4", "--emit", "slurm", "--job-name", "digits", "--",
                 *COMMAND)
    assert recipes.emit_from_args(args) == recipes.slurm(COMMAND, workers=4,
                                                         name="digits")
    args = _args("--workers", "2", "--ps", "1", "--evaluator", "--emit", "slurm",
                 "--", *COMMAND)
    assert recipes.emit_from_args(args) == recipes.slurm(COMMAND, workers=2, ps=1,
                                                         evaluator=True)


@pytest.mark.parametrize("argv,message", [
    (["--emit", "tfjob"], r"--emit tfjob needs --image.*Received: no --image.*--image "),
    (["--emit", "tfjob", "--image", " "], r"--emit tfjob needs --image"),
    (["--emit", "slurm", "--image", "img"], r"--image applies to --emit tfjob and --emit "
                                            r"k8s only\. Received: --image img.*Drop --image"),
    (["--emit", "slurm", "--port", "2345"], r"--port applies to --emit tfjob and --emit "
                                            r"k8s only\. Received: --port 2345.*8888"),
    (["--emit", "tfjob", "--image", "img", "--job-name", "My_Job"],
     r"--job-name My_Job is not a valid TFJob name.*e\.g\. --job-name digits-async"),
    (["--emit", "tfjob", "--image", "img", "--port", "0"],
     r"`port` must be an integer from 1 to 65535\. Received: --port 0"),
    (["--emit", "slurm", "--workers", "0"],
     r"`workers` must be an integer at least 1\. Received: --workers 0"),
    (["--emit", "slurm", "--ps", "-1"], r"`ps` must be an integer 0 or more\. "
                                        r"Received: --ps -1"),
    (["--emit", "slurm", "--job-name", "my job"], r"--job-name my job is not a valid "
                                                  r"SLURM name"),
])
def test_emit_from_args_errors_name_the_flag_the_value_and_the_fix(argv, message):
    with pytest.raises(ValueError, match=message):
        recipes.emit_from_args(_args(*argv, "--", *COMMAND))


def test_emit_from_args_without_emit_says_what_to_pass():
    with pytest.raises(ValueError, match=r"--emit must be one of tfjob, k8s, slurm\. "
                                         r"Received: --emit None"):
        recipes.emit_from_args(_args("--", *COMMAND))


def test_emit_from_args_without_a_command_says_where_to_put_it():
    with pytest.raises(ValueError, match=r"No command given.*after --"):
        recipes.emit_from_args(_args("--emit", "slurm"))


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,message", [
    (dict(workers=0), r"`workers` must be an integer at least 1\. Received: workers=0"),
    (dict(workers=True), r"`workers` must be an integer.*Received: workers=True"),
    (dict(workers=2, ps=-1), r"`ps` must be an integer 0 or more\. Received: ps=-1"),
    (dict(workers=2, evaluator="yes"), r"`evaluator` must be True or False"),
    (dict(workers=2, command=[]), r"No command given"),
    (dict(workers=2, command="python train.py"),
     r"list of arguments, not one string.*\['python', 'train\.py'\]"),
    (dict(workers=2, command=["python", 5]), r"must be a string\. Received: 5"),
    (dict(workers=2, command=["", "train.py"]), r"first argument \(the program\) is empty"),
])
@pytest.mark.parametrize("recipe", ["tfjob", "slurm"])
def test_bad_shapes_and_commands_are_refused_by_both_recipes(recipe, kwargs, message):
    kwargs = {"command": COMMAND, **kwargs}
    if recipe == "tfjob":
        kwargs["image"] = IMAGE
    with pytest.raises(ValueError, match=message):
        getattr(recipes, recipe)(kwargs.pop("command"), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="My_Job"), r"name='My_Job' is not a valid TFJob name \(a DNS-1035 label"),
    (dict(name="1job"), r"name='1job' is not a valid TFJob name.*starting with a letter"),
    (dict(name="job-"), r"name='job-' is not a valid TFJob name"),
    (dict(name="j" * 55), r"too long.*'j{55}-worker-1' \(64 characters\).*at most 54"),
    (dict(namespace="Team_A"), r"namespace='Team_A' is not a Kubernetes namespace"),
    (dict(image=""), r"non-empty name without spaces\. Received: image=''"),
    (dict(image="my image"), r"Received: image='my image'"),
    (dict(port=0), r"`port` must be an integer from 1 to 65535\. Received: port=0"),
    (dict(port=70000), r"Received: port=70000"),
    (dict(max_restarts=-1), r"`max_restarts` must be an integer 0 or more"),
])
def test_tfjob_refuses_what_kubernetes_or_the_operator_would(kwargs, message):
    kwargs = {"workers": 2, "image": IMAGE, **kwargs}
    with pytest.raises(ValueError, match=message):
        recipes.tfjob(COMMAND, **kwargs)


def test_tfjob_name_length_limit_is_the_services_limit():
    name = "j" * 53  # j...j-worker-1 is 62 characters; j...j-evaluator-0 65
    assert yaml.safe_load(recipes.tfjob(COMMAND, workers=2, image=IMAGE, name=name))
    with pytest.raises(ValueError, match=r"'j{53}-evaluator-0' \(65 characters\).*at most 51"):
        recipes.tfjob(COMMAND, workers=2, evaluator=True, image=IMAGE, name=name)


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="my job"), r"name='my job' is not a valid SLURM name"),
    (dict(partition="gpu;rm"), r"partition='gpu;rm' is not a valid SLURM partition"),
    (dict(time="soon"), r"time='soon' is not a SLURM time limit.*'01:00:00'"),
    (dict(tasks_per_node=0), r"`tasks_per_node` must be an integer at least 1"),
    (dict(cpus_per_task=0), r"`cpus_per_task` must be an integer at least 1"),
    (dict(gpus_per_task=1.5), r"`gpus_per_task` must be an integer.*gpus_per_task=1\.5"),
])
def test_slurm_refuses_what_slurm_would(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recipes.slurm(COMMAND, **{"workers": 2, **kwargs})
