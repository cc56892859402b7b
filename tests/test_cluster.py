"""Tests for `keras_dist.cluster.config.ClusterConfig`.

Nothing here starts TensorFlow's runtime: cluster specs and resolvers are plain
Python objects, so the logical-CPU set-up in conftest.py stays valid.
"""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import keras
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist import ClusterConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PS_CLUSTER = {
    "chief": ["10.0.0.1:2222"],
    "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
    "ps": ["10.0.0.4:2222"],
}
TWO_WORKERS = {"worker": ["host1:2222", "host2:2222"]}


def _tf_config(cluster, task_type=None, index=None, **extra):
    config = {"cluster": cluster, **extra}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return json.dumps(config)


def _slurm_env(procid=0, num_tasks=3, nodelist="node[1-3]", tasks_per_node="1(x3)"):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(num_tasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
    }


# ----------------------------------------------------------------- TF_CONFIG
def test_from_tf_config_reads_cluster_and_task():
    config = ClusterConfig.from_tf_config(_tf_config(PS_CLUSTER, "worker", 1))
    assert config.cluster == {role: tuple(a) for role, a in PS_CLUSTER.items()}
    assert (config.task_type, config.task_index) == ("worker", 1)
    assert config.address == "10.0.0.3:2222"
    assert config.source == "TF_CONFIG"


def test_from_tf_config_counts_training_tasks_and_ps():
    config = ClusterConfig.from_tf_config(_tf_config(PS_CLUSTER, "ps", 0))
    assert config.num_workers == 3  # chief + 2 workers; ps does not train
    assert config.num_ps == 1


def test_from_tf_config_keeps_rpc_layer():
    config = ClusterConfig.from_tf_config(
        _tf_config(TWO_WORKERS, "worker", 0, rpc_layer="grpc+verbs"))
    assert config.rpc_layer == "grpc+verbs"


def test_task_without_index_means_index_zero():
    config = ClusterConfig.from_dict({"cluster": TWO_WORKERS, "task": {"type": "worker"}})
    assert config.task_index == 0


def test_config_without_task_is_a_template():
    config = ClusterConfig.from_dict({"cluster": TWO_WORKERS})
    assert (config.task_type, config.task_index, config.address) == (None, None, None)
    assert not config.is_chief


def test_from_env_reads_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 1))
    config = ClusterConfig.from_env()
    assert (config.task_type, config.task_index) == ("worker", 1)


@pytest.mark.parametrize(
    "environ",
    [{}, {"TF_CONFIG": "  "}, {"SLURM_STEP_NUM_TASKS": "1"}],
    ids=["empty", "blank-tf-config", "one-task-slurm-step"],
)
def test_from_env_without_cluster_is_none(environ):
    assert ClusterConfig.from_env(environ) is None


def test_from_env_prefers_tf_config_over_slurm():
    environ = {**_slurm_env(), "TF_CONFIG": _tf_config(TWO_WORKERS, "worker", 0)}
    assert ClusterConfig.from_env(environ).source == "TF_CONFIG"


def test_from_env_reads_multi_task_slurm_step():
    config = ClusterConfig.from_env(_slurm_env(procid=2))
    assert config.source == "SLURM"
    assert config.address == "node3:8888"


def test_empty_role_list_is_no_role():
    # Generated configs sometimes carry "chief": []; worker 0 must still lead.
    config = ClusterConfig.from_dict(
        {"cluster": {"chief": [], **TWO_WORKERS}, "task": {"type": "worker", "index": 0}})
    assert "chief" not in config.cluster
    assert config.is_chief


# ---------------------------------------------------------------------- SLURM
def test_from_slurm_assigns_jobs_to_nodes():
    config = ClusterConfig.from_slurm(
        jobs={"chief": 1, "worker": 1, "ps": 1}, environ=_slurm_env(procid=1))
    assert sorted(config.cluster) == ["chief", "ps", "worker"]
    addresses = sorted(a for addrs in config.cluster.values() for a in addrs)
    assert addresses == ["node1:8888", "node2:8888", "node3:8888"]
    # TensorFlow's resolver hands out ranks in sorted job order.
    assert (config.task_type, config.task_index) == ("ps", 0)
    assert config.strategy_kind == "parameter_server"


def test_from_slurm_defaults_to_all_workers():
    config = ClusterConfig.from_slurm(environ=_slurm_env(procid=2))
    assert config.cluster == {"worker": ("node1:8888", "node2:8888", "node3:8888")}
    assert (config.task_type, config.task_index) == ("worker", 2)


def test_from_slurm_gives_tasks_on_one_node_distinct_ports():
    environ = _slurm_env(procid=3, num_tasks=4, nodelist="node[1-2]", tasks_per_node="2(x2)")
    config = ClusterConfig.from_slurm(port_base=9000, environ=environ)
    assert config.cluster["worker"] == (
        "node1:9000", "node1:9001", "node2:9000", "node2:9001")
    assert config.address == "node2:9001"


def test_from_slurm_leaves_process_environment_unchanged(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
    before = dict(os.environ)
    ClusterConfig.from_slurm(environ=_slurm_env(procid=0))
    assert dict(os.environ) == before


@pytest.mark.multiprocess
def test_reading_slurm_never_writes_the_process_environment():
    # setenv while TensorFlow threads call getenv can crash the process (CI
    # saw it), so reading a caller's mapping must not write os.environ even
    # for a moment. Python audits every putenv/unsetenv; a subprocess keeps
    # the audit hook out of this one.
    code = textwrap.dedent("""
        import sys
        from keras_dist import ClusterConfig
        ClusterConfig.from_env({})  # loads what the first call loads
        writes = []
        sys.addaudithook(lambda event, args: event in ("os.putenv", "os.unsetenv")
                         and writes.append((event, args[0])))
        env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
               "SLURM_STEP_NODELIST": "node[1-4]", "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
               "KERAS_DIST_SLURM_JOBS": "chief:1,ps:1,worker:2"}
        config = ClusterConfig.from_env(env)
        assert (config.task_type, config.address) == ("ps", "node2:8888"), config
        ClusterConfig.from_slurm(environ=env)
        print(writes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": _ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("nodelist, tasks_per_node, addresses", [
    ("node[1-10]", "1(x10)", [f"node{i}:8888" for i in range(1, 11)]),
    ("node[08-10]", "2,1(x2)", ["node08:8888", "node08:8889", "node09:8888", "node10:8888"]),
    ("b[2,1],a", "1(x3)", ["b2:8888", "b1:8888", "a:8888"]),
    ("gpu[1-2]-ib,login", "2(x2),1", ["gpu1-ib:8888", "gpu1-ib:8889", "gpu2-ib:8888",
                                      "gpu2-ib:8889", "login:8888"]),
], ids=["ten-nodes", "padded", "slurm-order", "suffix"])
def test_from_slurm_places_ranks_in_slurm_node_order(nodelist, tasks_per_node, addresses):
    env = {"SLURM_STEP_NUM_TASKS": str(len(addresses)), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}
    got = [ClusterConfig.from_slurm(environ={**env, "SLURM_PROCID": str(rank)}).address
           for rank in range(len(addresses))]
    assert got == addresses


@pytest.mark.parametrize("nodelist, tasks_per_node, match", [
    ("node[1-3", "1(x3)", "SLURM_STEP_NODELIST='node\\[1-3' has unbalanced brackets"),
    ("node[a-c]", "1(x3)", "bad range 'a-c'"),
    ("node[3-1]", "1(x3)", "descending range '3-1'"),
    ("node[1-2],node2", "1(x3)", "names a node twice"),
    ("node[1-2]x[1-2]", "1(x4)", "cannot read 'node\\[1-2\\]x\\[1-2\\]'"),
    ("node[1-3]", "1(3)", "SLURM_STEP_TASKS_PER_NODE='1\\(3\\)' is not a SLURM tasks-per-node"),
    ("node[1-2]", "1(x3)", "names 2 node\\(s\\) but SLURM_STEP_TASKS_PER_NODE='1\\(x3\\)'"),
    ("node[1-3]", "2(x3)", "adds up to 6 tasks but SLURM_STEP_NUM_TASKS=3"),
])
def test_from_slurm_rejects_malformed_node_lists(nodelist, tasks_per_node, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_slurm(environ=_slurm_env(0, 3, nodelist, tasks_per_node))


# --------------------------------------------------------------------- roles
@pytest.mark.parametrize(
    "cluster, task_type, index, expected",
    [
        (PS_CLUSTER, "chief", 0, True),
        (PS_CLUSTER, "worker", 0, False),
        (PS_CLUSTER, "ps", 0, False),
        (TWO_WORKERS, "worker", 0, True),
        (TWO_WORKERS, "worker", 1, False),
        ({"chief": ["c:1"], "evaluator": ["e:1"]}, "evaluator", 0, False),
    ],
)
def test_is_chief(cluster, task_type, index, expected):
    config = ClusterConfig.from_dict(
        {"cluster": cluster, "task": {"type": task_type, "index": index}})
    assert config.is_chief is expected


@pytest.mark.parametrize(
    "cluster, expected",
    [
        ({"worker": ["a:1"]}, None),
        ({"chief": ["a:1"]}, None),
        ({"chief": ["a:1"], "evaluator": ["b:1"]}, None),
        (TWO_WORKERS, "multi_worker"),
        ({"chief": ["a:1"], "worker": ["b:1"]}, "multi_worker"),
        ({"chief": ["a:1"], "ps": ["b:1"]}, "parameter_server"),
        (PS_CLUSTER, "parameter_server"),
    ],
)
def test_strategy_kind(cluster, expected):
    assert ClusterConfig.from_dict({"cluster": cluster}).strategy_kind == expected


def test_for_task_validates_the_task():
    template = ClusterConfig.from_dict({"cluster": TWO_WORKERS})
    with pytest.raises(ValueError, match=r"index'\]=2 is out of range"):
        template.for_task("worker", 2)


# ------------------------------------------------------------- serialization
@pytest.mark.parametrize(
    "config",
    [
        ClusterConfig.from_dict({"cluster": PS_CLUSTER, "task": {"type": "ps", "index": 0}}),
        ClusterConfig.from_dict({"cluster": TWO_WORKERS}),
        ClusterConfig(cluster=TWO_WORKERS, task_type="worker", task_index=1,
                      rpc_layer="grpc+verbs"),
        ClusterConfig.local(workers=2, ps=1).for_task("worker", 1),
    ],
    ids=["ps-task", "template", "rpc-layer", "local"],
)
def test_to_tf_config_round_trip(config):
    assert ClusterConfig.from_tf_config(config.to_tf_config()) == config


def test_to_tf_config_is_read_the_same_by_tensorflow(monkeypatch):
    config = ClusterConfig.from_dict(
        {"cluster": PS_CLUSTER, "task": {"type": "worker", "index": 1}})
    monkeypatch.setenv("TF_CONFIG", config.to_tf_config())
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == PS_CLUSTER
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_cluster_resolver_carries_cluster_and_task():
    config = ClusterConfig.from_dict(
        {"cluster": PS_CLUSTER, "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc+gdr"})
    resolver = config.cluster_resolver()
    assert isinstance(resolver, tf.distribute.cluster_resolver.SimpleClusterResolver)
    assert resolver.cluster_spec().as_dict() == PS_CLUSTER
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)
    assert resolver.rpc_layer == "grpc+gdr"


# --------------------------------------------------------------------- local
def test_local_has_the_requested_roles():
    config = ClusterConfig.local(workers=3, ps=2, evaluator=True)
    counts = {role: len(addrs) for role, addrs in config.cluster.items()}
    assert counts == {"chief": 1, "worker": 3, "ps": 2, "evaluator": 1}
    assert config.task_type is None


@pytest.mark.parametrize(
    "kwargs, has_chief",
    [
        ({"workers": 2}, False),
        ({"workers": 2, "ps": 1}, True),
        ({"workers": 2, "chief": True}, True),
    ],
)
def test_local_adds_chief_when_needed_or_asked(kwargs, has_chief):
    assert ("chief" in ClusterConfig.local(**kwargs).cluster) is has_chief


def test_local_ports_are_distinct_loopback_and_bindable():
    config = ClusterConfig.local(workers=3, ps=1)
    addresses = [a for addrs in config.cluster.values() for a in addrs]
    hosts = {a.rsplit(":", 1)[0] for a in addresses}
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert hosts == {"127.0.0.1"}
    assert len(set(ports)) == len(ports) == 5
    sockets = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", port))  # raises if the port is taken
    finally:
        for sock in sockets:
            sock.close()


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "text, match",
    [
        ('{"cluster": ', r"TF_CONFIG is not valid JSON.*Received: TF_CONFIG='\{\"cluster\": '"),
        ("[1, 2]", r"TF_CONFIG must be a JSON object\. Received: \[1, 2\]"),
        ('"worker"', r"TF_CONFIG must be a JSON object\. Received: 'worker'"),
        ('{"task": {"type": "worker", "index": 0}}', r"TF_CONFIG has no 'cluster' key"),
        ('{"cluster": {}}', r"\['cluster'\] must be a non-empty mapping"),
        ('{"cluster": {"worker": ["a:1"]}, "tasks": {}}', r"Unknown key\(s\) \['tasks'\]"),
        ('{"cluster": {"worker": ["a:1"]}, "task": "worker"}',
         r"\['task'\] must be an object.*Received: 'worker'"),
    ],
    ids=["malformed-json", "json-list", "json-string", "no-cluster", "empty-cluster",
         "unknown-key", "task-not-object"],
)
def test_from_tf_config_rejects_bad_document(text, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_tf_config(text)


@pytest.mark.parametrize(
    "cluster, task, match",
    [
        ({"workers": ["a:1"]}, None, r"Unknown role 'workers'.*Known roles: chief, worker"),
        ({"master": ["a:1"], "worker": ["b:1"]}, None, r"Unknown role 'master'.*use 'chief'"),
        (TWO_WORKERS, ("worker", 2),
         r"\['index'\]=2 is out of range.*2 'worker' task\(s\), indices 0\.\.1"),
        (TWO_WORKERS, ("worker", -1), r"\['index'\]=-1 is out of range"),
        (TWO_WORKERS, ("ps", 0), r"\['type'\]='ps' is not a role of this cluster.*worker"),
        (TWO_WORKERS, (None, 1), r"\['type'\]=None is not a role"),
        (TWO_WORKERS, ("worker", "0"), r"\['index'\] must be an integer\. Received: '0'"),
        (TWO_WORKERS, ("worker", 1.0), r"\['index'\] must be an integer\. Received: 1\.0"),
        (TWO_WORKERS, ("worker", True), r"\['index'\] must be an integer\. Received: True"),
        ({"worker": ["a:1"], "ps": ["b:1"]}, None, r"has 'ps' tasks but no 'chief'"),
        ({"worker": ["a:1", "b:2"], "ps": ["a:1"], "chief": ["c:1"]}, None,
         r"Duplicate address 'a:1'.*worker\[0\] and ps\[0\]"),
        ({"worker": ["host1"]}, None, r"\['worker'\]\[0\]='host1' has no port"),
        ({"worker": ["a:1", "host2:0"]}, None,
         r"\['worker'\]\[1\]='host2:0' has an invalid port '0'"),
        ({"worker": ["host:70000"]}, None, r"'host:70000' has an invalid port '70000'"),
        ({"worker": ["host:abc"]}, None, r"'host:abc' has an invalid port 'abc'"),
        ({"worker": [2222]}, None, r"\['worker'\]\[0\] must be a 'host:port' string"),
        ({"worker": "a:1"}, None, r"\['worker'\] must be a list.*Write it as \['a:1'\]"),
        ({"chief": ["a:1", "b:1"]}, None, r"\['chief'\] has 2 addresses.*at most one chief"),
        ({"chief": ["a:1"], "evaluator": ["b:1", "c:1"]}, None, r"at most one evaluator"),
        ({"evaluator": ["a:1"]}, None, r"no 'worker' or 'chief' task"),
    ],
    ids=["unknown-role", "master", "index-too-big", "index-negative", "type-not-in-cluster",
         "index-without-type", "index-str", "index-float", "index-bool", "ps-without-chief",
         "duplicate-address", "no-port", "port-0", "port-70000", "port-abc",
         "address-not-str", "role-as-string", "two-chiefs", "two-evaluators", "nobody-trains"],
)
def test_rejects_bad_cluster(cluster, task, match):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = {"type": task[0], "index": task[1]}
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_tf_config(json.dumps(config))


def test_constructor_validates_like_readers():
    match = r"cluster \(dict\)\['cluster'\]\['worker'\] must be a list"
    with pytest.raises(ValueError, match=match):
        ClusterConfig(cluster={"worker": "a:1"})


@pytest.mark.parametrize(
    "missing",
    ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"],
)
def test_from_slurm_rejects_incomplete_environment(missing):
    environ = _slurm_env()
    del environ[missing]
    with pytest.raises(ValueError, match=rf"Not inside a SLURM job step: {missing} not set"):
        ClusterConfig.from_slurm(environ=environ)


def test_from_env_rejects_incomplete_multi_task_slurm_step():
    with pytest.raises(ValueError, match=r"SLURM_PROCID, SLURM_STEP_NODELIST.* not set"):
        ClusterConfig.from_env({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"})


@pytest.mark.parametrize("jobs", [{"chief": 1, "worker": 1}, {"chief": 1, "worker": 2, "ps": 1}])
def test_from_slurm_rejects_jobs_not_matching_task_count(jobs):
    total = sum(jobs.values())
    with pytest.raises(ValueError, match=rf"asks for {total} tasks.*SLURM_STEP_NUM_TASKS=3"):
        ClusterConfig.from_slurm(jobs=jobs, environ=_slurm_env())


def test_from_slurm_rejects_procid_out_of_range():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=3 is out of range.*0\.\.2"):
        ClusterConfig.from_slurm(environ=_slurm_env(procid=3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": -1}, r"`workers` must be a non-negative integer\. Received: workers=-1"),
        ({"workers": 1.5}, r"Received: workers=1\.5"),
        ({"workers": True}, r"Received: workers=True"),
        ({"ps": -2}, r"`ps` must be a non-negative integer\. Received: ps=-2"),
    ],
)
def test_local_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.local(**kwargs)


# ------------------------------------------------- KERAS_DIST_SLURM_JOBS
def _slurm_jobs_env(jobs, procid=0, num_tasks=4):
    nodes = f"node[1-{num_tasks}]"
    return {**_slurm_env(procid, num_tasks, nodes, f"1(x{num_tasks})"),
            "KERAS_DIST_SLURM_JOBS": jobs}


def test_slurm_jobs_env_name_is_public():
    from keras_dist.cluster import config as cluster

    assert cluster.SLURM_JOBS_ENV == "KERAS_DIST_SLURM_JOBS"


@pytest.mark.parametrize(
    "jobs",
    ["chief:1,ps:1,worker:2", "worker:2,ps:1,chief:1", " chief : 1 , worker:2,ps:1 ",
     "chief:1,worker:2,ps:1,evaluator:0"],
    ids=["sorted", "any-order", "spaces", "zero-count-dropped"],
)
def test_from_env_gives_slurm_ranks_roles_in_alphabetical_order(jobs):
    configs = [ClusterConfig.from_env(_slurm_jobs_env(jobs, procid=rank))
               for rank in range(4)]
    assert [(c.task_type, c.task_index) for c in configs] == [
        ("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    for config in configs:
        assert config.source == "SLURM"
        assert config.strategy_kind == "parameter_server"
        assert config.cluster == {"chief": ("node1:8888",), "ps": ("node2:8888",),
                                  "worker": ("node3:8888", "node4:8888")}
    assert [c.is_chief for c in configs] == [True, False, False, False]
    # The same as from_slurm(jobs=...), which from_env calls.
    assert configs[1] == ClusterConfig.from_slurm(
        jobs={"chief": 1, "worker": 2, "ps": 1}, environ=_slurm_env(1, 4, "node[1-4]", "1(x4)"))


def test_from_env_slurm_jobs_with_evaluator_and_workers_only():
    env = _slurm_jobs_env("worker:3,evaluator:1", procid=0)
    assert (ClusterConfig.from_env(env).task_type, ClusterConfig.from_env(env).is_chief) == (
        "evaluator", False)
    worker0 = ClusterConfig.from_env({**env, "SLURM_PROCID": "1"})
    assert (worker0.task_type, worker0.task_index, worker0.is_chief) == ("worker", 0, True)
    assert worker0.strategy_kind == "multi_worker"


@pytest.mark.parametrize("jobs", ["", "   "], ids=["empty", "blank"])
def test_from_env_empty_slurm_jobs_means_all_workers(jobs):
    config = ClusterConfig.from_env(_slurm_jobs_env(jobs, procid=3))
    assert config.cluster == {"worker": ("node1:8888", "node2:8888", "node3:8888",
                                         "node4:8888")}
    assert (config.task_type, config.task_index) == ("worker", 3)


def test_from_env_ignores_slurm_jobs_under_tf_config_or_in_a_one_task_step():
    environ = {**_slurm_jobs_env("nonsense"), "TF_CONFIG": _tf_config(TWO_WORKERS, "worker", 0)}
    assert ClusterConfig.from_env(environ).source == "TF_CONFIG"
    assert ClusterConfig.from_env(_slurm_jobs_env("nonsense", num_tasks=1)) is None


_FORM = r"Write comma-separated role:count pairs.*e\.g\. KERAS_DIST_SLURM_JOBS=chief:1,ps:1,worker:2"


@pytest.mark.parametrize(
    "jobs, bad",
    [
        ("worker", r"'worker' is not role:count"),
        ("worker=4", r"'worker=4' is not role:count"),
        ("chief:1,,worker:3", r"an empty entry is not role:count"),
        ("worker:4,", r"an empty entry is not role:count"),
        ("worker:2:2", r"'worker:2:2' is not role:count"),
        (":4", r"':4' is not role:count"),
        ("workers:4", r"'workers' in 'workers:4' is not a role"),
        ("master:1,worker:3", r"'master' in 'master:1' is not a role \('master' is "
                              r"TensorFlow's old name for 'chief'\)"),
        ("worker:2,worker:2", r"role 'worker' is given twice"),
        ("worker:-4", r"the count '-4' in 'worker:-4' is not an integer 0 or more"),
        ("worker:two", r"the count 'two' in 'worker:two' is not an integer"),
        ("worker:2.5,chief:1", r"the count '2\.5' in 'worker:2\.5' is not an integer"),
        ("worker:", r"the count '' in 'worker:' is not an integer"),
        ("worker:0,chief:0", r"every count is 0"),
    ],
)
def test_from_env_rejects_malformed_slurm_jobs(jobs, bad):
    match = rf"KERAS_DIST_SLURM_JOBS={re.escape(repr(jobs))} is malformed: {bad}.*{_FORM}"
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_env(_slurm_jobs_env(jobs))


def test_from_env_rejects_slurm_jobs_not_matching_the_step():
    with pytest.raises(ValueError, match=r"KERAS_DIST_SLURM_JOBS='chief:1,ps:1,worker:1' "
                                         r"names 3 tasks but the SLURM step has "
                                         r"SLURM_STEP_NUM_TASKS=4.*--ntasks=3"):
        ClusterConfig.from_env(_slurm_jobs_env("chief:1,ps:1,worker:1"))


@pytest.mark.parametrize(
    "jobs, match",
    [
        ("ps:1,worker:3", r"'ps' tasks but no 'chief'"),
        ("chief:2,worker:2", r"at most one chief"),
        ("evaluator:2,worker:2", r"at most one evaluator"),
    ],
)
def test_from_env_slurm_jobs_layout_errors_name_the_variable(jobs, match):
    with pytest.raises(ValueError, match=rf"{match}.*Roles from KERAS_DIST_SLURM_JOBS="
                                         rf"{re.escape(repr(jobs))}"):
        ClusterConfig.from_env(_slurm_jobs_env(jobs))


@pytest.mark.parametrize("grace", [0, -1, True, "30", float("nan")])
def test_serve_rejects_a_bad_grace_period_before_it_starts_a_server(grace):
    config = kd.ClusterConfig.local(workers=1, ps=1).for_task("ps")
    with pytest.raises(ValueError, match=r"`grace_period` must be a number of seconds > 0 .*"
                                         rf"Received: grace_period={re.escape(repr(grace))}\."):
        kd.serve(config, grace_period=grace)


def test_fit_gives_a_serving_task_its_backups_grace_period(tmp_path):
    from keras_dist.training.plan import grace_period

    backup = kd.callbacks.BackupAndRestore(str(tmp_path), grace_period=90)
    assert grace_period([keras.callbacks.History(), backup]) == 90.0
    assert grace_period(keras.callbacks.CallbackList([backup])) == 90.0
    assert grace_period([keras.callbacks.History()]) is None
    assert grace_period(None) is None
