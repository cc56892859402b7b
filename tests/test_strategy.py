"""Tests for `keras_dist.cluster.strategy`: choosing and building a strategy.

`choose_strategy` is tested through its own seams (`devices=`, `environ=`,
`cluster=`), so every branch runs on a CPU-only machine. `resolve_strategy`
builds real strategies on the two logical CPUs from conftest.py. No test
builds a MultiWorkerMirroredStrategy: in-process it would wait for its peers
(tests/test_fit_multiworker.py covers it with real processes).
"""

import json
import logging

import time

import pytest
import tensorflow as tf

from keras_dist import ClusterConfig, StrategyKind, choose_strategy, resolve_strategy
from procs import CPUS

TWO_WORKERS = {
    "cluster": {"worker": ["host1:2222", "host2:2222"]},
    "task": {"type": "worker", "index": 0},
}
WITH_PS = {
    "cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": ["host2:2222"]},
    "task": {"type": "chief", "index": 0},
}
ONE_WORKER = {"cluster": {"worker": ["host1:2222"]}, "task": {"type": "worker", "index": 0}}
GPUS = ["/gpu:0", "/gpu:1"]


def _env(tf_config=None, **variables):
    environ = dict(variables)
    if tf_config is not None:
        environ["TF_CONFIG"] = json.dumps(tf_config)
    return environ


# ------------------------------------------------------- auto, no cluster
@pytest.mark.parametrize(
    "devices, kind",
    [
        ([], StrategyKind.DEFAULT),
        (["/gpu:0"], StrategyKind.ONE_DEVICE),
        (["/gpu:0", "/gpu:1"], StrategyKind.MIRRORED),
        (["/gpu:0", "/gpu:1", "/gpu:2"], StrategyKind.MIRRORED),
    ],
)
def test_auto_without_cluster_follows_local_devices(devices, kind):
    choice = choose_strategy(devices=devices, environ={})
    assert choice.kind is kind
    assert choice.cluster is None


@pytest.mark.parametrize("devices", [["/gpu:0"], ["/gpu:0", "/gpu:1"]])
def test_auto_reason_and_devices_name_the_devices(devices):
    choice = choose_strategy(devices=devices, environ={})
    assert choice.devices == tuple(devices)
    for device in devices:
        assert device in choice.reason


def test_auto_without_devices_says_so():
    choice = choose_strategy(devices=[], environ={})
    assert choice.devices == ()
    assert "no GPU" in choice.reason


def test_one_task_cluster_trains_like_one_machine():
    choice = choose_strategy(devices=GPUS, environ=_env(ONE_WORKER))
    assert choice.kind is StrategyKind.MIRRORED


# ---------------------------------------------------------- auto, cluster
@pytest.mark.parametrize(
    "tf_config, kind",
    [(WITH_PS, StrategyKind.PARAMETER_SERVER), (TWO_WORKERS, StrategyKind.MULTI_WORKER)],
    ids=["ps", "two-workers"],
)
def test_auto_follows_cluster_in_tf_config(tf_config, kind):
    choice = choose_strategy(devices=[], environ=_env(tf_config))
    assert choice.kind is kind
    assert choice.cluster == ClusterConfig.from_dict(tf_config)
    assert "TF_CONFIG" in choice.reason


def test_cluster_outranks_local_devices():
    choice = choose_strategy(devices=GPUS, environ=_env(TWO_WORKERS))
    assert choice.kind is StrategyKind.MULTI_WORKER
    assert choice.devices == ()


def test_auto_follows_multi_task_slurm_step():
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    choice = choose_strategy(devices=[], environ=environ)
    assert choice.kind is StrategyKind.MULTI_WORKER
    assert choice.cluster.source == "SLURM"


@pytest.mark.parametrize(
    "cluster",
    [WITH_PS, ClusterConfig.from_dict(WITH_PS)],
    ids=["dict", "ClusterConfig"],
)
def test_cluster_argument_outranks_environment(cluster):
    choice = choose_strategy(cluster=cluster, devices=[], environ=_env(TWO_WORKERS))
    assert choice.kind is StrategyKind.PARAMETER_SERVER
    assert choice.cluster == ClusterConfig.from_dict(WITH_PS)


# ----------------------------------------------------- explicit and env var
@pytest.mark.parametrize("name", [kind.value for kind in StrategyKind
                                  if kind is not StrategyKind.PARAMETER_SERVER])
def test_explicit_name_is_used_without_cluster(name):
    choice = choose_strategy(name, devices=GPUS, environ={})
    assert choice.kind is StrategyKind(name)


def test_env_var_beats_local_devices():
    choice = choose_strategy(devices=GPUS, environ=_env(KERAS_DIST_STRATEGY="one_device"))
    assert choice.kind is StrategyKind.ONE_DEVICE
    assert "KERAS_DIST_STRATEGY" in choice.reason


def test_env_var_agreeing_with_cluster_is_the_reason():
    environ = _env(TWO_WORKERS, KERAS_DIST_STRATEGY="multi_worker")
    choice = choose_strategy(devices=[], environ=environ)
    assert choice.kind is StrategyKind.MULTI_WORKER
    assert "KERAS_DIST_STRATEGY" in choice.reason


def test_explicit_argument_beats_env_var():
    environ = _env(KERAS_DIST_STRATEGY="mirrored")
    choice = choose_strategy("one_device", devices=GPUS, environ=environ)
    assert choice.kind is StrategyKind.ONE_DEVICE


def test_explicit_argument_means_env_var_is_not_consulted():
    # Alone, this env var would be an error (no ps cluster); the argument wins first.
    environ = _env(KERAS_DIST_STRATEGY="parameter_server")
    assert choose_strategy("default", devices=[], environ=environ).kind is StrategyKind.DEFAULT


@pytest.mark.parametrize(
    "strategy, environ, match",
    [
        ("mirrored", _env(WITH_PS),
         r"'mirrored'.*strategy argument.*implies 'parameter_server'"),
        ("default", _env(TWO_WORKERS), r"'default'.*implies 'multi_worker'"),
        ("multi_worker", _env(WITH_PS), r"'multi_worker'.*implies 'parameter_server'"),
        ("parameter_server", {},
         r"'parameter_server'.*strategy argument.*no cluster with 'ps' tasks"),
        ("parameter_server", _env(ONE_WORKER), r"'parameter_server'.*no cluster with 'ps' tasks"),
        ("auto", _env(TWO_WORKERS, KERAS_DIST_STRATEGY="mirrored"),
         r"'mirrored'.*KERAS_DIST_STRATEGY=mirrored.*implies 'multi_worker'"),
    ],
    ids=["mirrored-vs-ps", "default-vs-workers", "multi-worker-vs-ps", "ps-without-cluster",
         "ps-one-task-cluster", "env-mirrored-vs-workers"],
)
def test_explicit_choice_contradicting_cluster_is_an_error(strategy, environ, match):
    with pytest.raises(ValueError, match=match):
        choose_strategy(strategy, devices=[], environ=environ)


@pytest.mark.parametrize(
    "strategy, environ, match",
    [
        ("mirror", {}, r"Unknown strategy 'mirror' \(from strategy\)"),
        ("MIRRORED", {}, r"Unknown strategy 'MIRRORED'"),
        (None, {}, r"Unknown strategy None"),
        ("auto", {"KERAS_DIST_STRATEGY": "tpu"},
         r"Unknown strategy 'tpu' \(from KERAS_DIST_STRATEGY\)"),
    ],
    ids=["typo", "upper-case", "none", "env-var"],
)
def test_unknown_strategy_name_is_an_error(strategy, environ, match):
    with pytest.raises(ValueError, match=match):
        choose_strategy(strategy, devices=[], environ=environ)


def test_bad_cluster_argument_is_an_error():
    with pytest.raises(ValueError, match=r"Unknown role 'master'"):
        choose_strategy(cluster={"cluster": {"master": ["a:1"]}}, devices=[], environ={})


# ------------------------------------------------------- resolve_strategy
@pytest.fixture
def clean_env(monkeypatch):
    """resolve_strategy reads os.environ: make sure no cluster or choice is in it."""
    for name in ("TF_CONFIG", "KERAS_DIST_STRATEGY", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def keras_dist_log(caplog, monkeypatch):
    """Records of the "keras_dist" logger (which does not propagate by default)."""
    monkeypatch.setattr(logging.getLogger("keras_dist"), "propagate", True)
    caplog.set_level(logging.INFO, logger="keras_dist")
    return caplog


def _device_index(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


def test_strategy_instance_is_returned_unchanged(clean_env, monkeypatch):
    monkeypatch.setenv("KERAS_DIST_STRATEGY", "mirrored")
    strategy = tf.distribute.OneDeviceStrategy(CPUS[1])
    assert resolve_strategy(strategy) is strategy


def test_resolve_default(clean_env):
    strategy = resolve_strategy("default", devices=[])
    # The default strategy is what tf.distribute hands out outside any scope.
    assert strategy is tf.distribute.get_strategy()
    assert strategy.num_replicas_in_sync == 1


def test_resolve_one_device_uses_the_given_device(clean_env):
    strategy = resolve_strategy("one_device", devices=[CPUS[1]])
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert [_device_index(d) for d in strategy.extended.worker_devices] == [("CPU", 1)]


def test_resolve_auto_mirrors_over_two_devices(clean_env):
    strategy = resolve_strategy(devices=CPUS)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert sorted(_device_index(d) for d in strategy.extended.worker_devices) == [
        ("CPU", 0), ("CPU", 1)]


def test_resolve_parameter_server_names_tasks_that_never_come_up(clean_env):
    cluster = ClusterConfig.local(workers=2, ps=1).for_task("chief")  # nobody listens
    missing = f"worker:1 at {cluster.cluster['worker'][1]}"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"did not come up within 1 s: .*{missing}"):
        resolve_strategy(cluster=cluster, connect_timeout=1)
    assert time.monotonic() - start < 10


def test_resolve_parameter_server_rejects_evaluator_task(clean_env):
    cluster = ClusterConfig.local(workers=1, ps=1, evaluator=True).for_task("evaluator")
    with pytest.raises(ValueError, match="Evaluator tasks are not supported yet"):
        resolve_strategy(cluster=cluster)


def test_resolve_logs_one_line_with_choice_and_reason(clean_env, keras_dist_log, monkeypatch):
    from keras_dist.cluster import strategy as strategy_lib

    monkeypatch.setattr(strategy_lib, "_LOGGED", set())
    resolve_strategy("mirrored", devices=CPUS)
    records = [r for r in keras_dist_log.records if r.name == "keras_dist"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "mirrored" in message
    assert "strategy argument" in message
    # The same choice again (resolve_strategy() then kd.fit): not logged twice.
    resolve_strategy("mirrored", devices=CPUS)
    assert len([r for r in keras_dist_log.records if r.name == "keras_dist"]) == 1


def test_mirrored_strategy_is_built_once_per_device_set(clean_env):
    """A second MirroredStrategy in one process collides with the first one's
    collective keys ("Shape mismatch in the collective"), so it is reused."""
    first = resolve_strategy("mirrored", devices=CPUS)
    assert resolve_strategy("mirrored", devices=CPUS) is first
    assert resolve_strategy("mirrored", devices=CPUS[:1]) is not first
