"""The bad-input catalogue: malformed input across the public surface.

Each case must fail fast with its own clear message (matched here), hang
nowhere (pytest-timeout guards every case) and leave no process behind
(the launcher cases are checked for survivors).
"""

import json
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import ClusterConfig, simulate
from keras_dist.optimizers import DCASGD, DynSGD, GapAware, StalenessLimit
from procs import CPUS, REPO


def tf_config(text):
    return lambda: ClusterConfig.from_tf_config(text)


def cluster(spec):
    return lambda: ClusterConfig.from_dict(spec)


def compiled():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def unreachable_chief():
    config = ClusterConfig.local(workers=1, ps=1).for_task("chief")  # nobody listens
    return kd.resolve_strategy(cluster=config, connect_timeout=1)


CASES = {
    # TF_CONFIG and clusters
    "tf_config_not_json": (tf_config("{cluster:"), ValueError, "TF_CONFIG is not valid JSON"),
    "tf_config_not_object": (tf_config("[1, 2]"), ValueError, "must be a JSON object"),
    "tf_config_no_cluster": (tf_config('{"task": {}}'), ValueError, "has no 'cluster' key"),
    "unknown_role": (cluster({"cluster": {"master": ["a:1"]}}), ValueError,
                     "Unknown role 'master'.*use 'chief'"),
    "index_out_of_range": (cluster({"cluster": {"worker": ["a:1"]},
                                    "task": {"type": "worker", "index": 3}}), ValueError,
                           r"index'\]=3 is out of range"),
    "ps_without_chief": (cluster({"cluster": {"worker": ["a:1"], "ps": ["b:1"]}}), ValueError,
                         "'ps' tasks but no 'chief'"),
    "duplicate_address": (cluster({"cluster": {"worker": ["a:1", "a:1"]}}), ValueError,
                          "Duplicate address 'a:1'"),
    "address_without_port": (cluster({"cluster": {"worker": ["localhost"]}}), ValueError,
                             "has no port"),
    # strategies
    "unknown_strategy": (lambda: kd.resolve_strategy("tpu"), ValueError, "Unknown strategy 'tpu'"),
    "strategy_contradicts_cluster": (
        lambda: kd.choose_strategy("mirrored", environ={}, cluster={
            "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
            "task": {"type": "chief", "index": 0}}),
        ValueError, "'mirrored' was requested.*implies 'parameter_server'"),
    "unreachable_address": (unreachable_chief, TimeoutError,
                            "did not come up within 1 s: worker:0 at 127.0.0.1:"),
    # fit and data
    "fit_uncompiled": (lambda: kd.fit(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
                                      np.ones((4, 3)), np.ones((4, 1)), strategy="default"),
                       ValueError, "not compiled"),
    "fit_not_a_model": (lambda: kd.fit(42, np.ones((4, 3))), TypeError,
                        "compiled keras.Model or a zero-argument function"),
    "mismatched_x_y": (lambda: kd.fit(compiled, np.ones((8, 3)), np.ones((5, 1)),
                                      strategy=kd.resolve_strategy("mirrored", devices=CPUS),
                                      verbose=0),
                       ValueError, "different numbers of samples: 8 and 5"),
    # optimizer wrappers
    "wrapper_of_non_optimizer": (lambda: DynSGD("adam"), TypeError, "wraps a Keras optimizer"),
    "negative_lambda": (lambda: DCASGD(keras.optimizers.SGD(), lambda_=-1.0), ValueError,
                        "`lambda_` must be >= 0"),
    "negative_limit": (lambda: StalenessLimit(keras.optimizers.SGD(), max_staleness=-2),
                       ValueError, "`max_staleness` must be an integer >= 0"),
    "double_scaling": (lambda: GapAware(DynSGD(keras.optimizers.SGD())), ValueError,
                       "apply the correction twice"),
    # AsyncModel and the simulator
    "bad_nonfinite_mode": (lambda: _nonfinite("ignore"), ValueError,
                           "`nonfinite_updates` must be one of \\('skip', 'raise'\\). "
                           "Received: nonfinite_updates='ignore'"),
    "simulate_zero_workers": (lambda: simulate.schedule(0, 10), ValueError,
                              "`workers` must be an integer >= 1"),
    "simulate_bad_straggler": (lambda: simulate.schedule(2, 10, stragglers={5: 2.0}), ValueError,
                               "`stragglers` maps a worker index"),
    # callbacks and fault injection
    "straggler_window_too_small": (lambda: kd.callbacks.StragglerDetector(window=1), ValueError,
                                   "`window` must be an integer >= 2"),
    "straggler_threshold_outside": (lambda: kd.callbacks.StragglerDetector(threshold=1.5),
                                    ValueError, "strictly between 0 and 1"),
    "straggler_unknown_action": (lambda: kd.callbacks.StragglerDetector(action="page"),
                                 ValueError, "`action` must be 'warn', 'raise' or a callable"),
    "per_replica_bad_log_dir": (lambda: kd.callbacks.PerReplicaMetrics(log_dir=["a"]),
                                ValueError, "`log_dir` must be a directory path or None"),
    "backup_dir_empty": (lambda: kd.callbacks.BackupAndRestore(""), ValueError,
                         "`backup_dir` must be a non-empty directory path"),
    "backup_keep_zero": (lambda: kd.callbacks.BackupAndRestore("b", keep=0), ValueError,
                         "`keep` must be an integer >= 1"),
    "slow_worker_env_malformed": (
        lambda: kd.testing.slow_workers_from_env({"KERAS_DIST_SLOW_WORKER": "1x3"}),
        ValueError, "each item must be `index:factor`"),
    # fit()'s counts (Keras itself accepts these and trains nothing or fails deep inside)
    "batch_size_zero": (lambda: _fit_digits(batch_size=0), ValueError,
                        r"`batch_size` must be an integer >= 1 or None\. Received: batch_size=0\."),
    "epochs_negative": (lambda: _fit_digits(epochs=-3), ValueError,
                        r"`epochs` must be an integer >= 0\. Received: epochs=-3\."),
    "steps_per_epoch_float": (lambda: _fit_digits(steps_per_epoch=2.0), ValueError,
                              r"`steps_per_epoch` must be an integer >= 1 or None\. "
                              r"Received: steps_per_epoch=2\.0\. Pass int\(2\.0\)\."),
    "validation_steps_zero": (lambda: _fit_digits(validation_steps=0), ValueError,
                              "`validation_steps` must be an integer >= 1 or None"),
    "async_model_batch_size_negative": (
        lambda: _async_model().fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=-1, verbose=0),
        ValueError, r"`batch_size` must be an integer >= 1 or None\. Received: batch_size=-1\."),
}


def _small_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def _fit_digits(**kwargs):
    kd.fit(_small_model(), np.ones((8, 3)), np.ones((8, 1)), verbose=0, **kwargs)


def _async_model():
    inputs = keras.Input((3,))
    model = kd.AsyncModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    return model


def _nonfinite(mode):
    inputs = keras.Input((3,))
    model = kd.AsyncModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    kd.fit(model, np.ones((2, 3)), np.ones((2, 1)), nonfinite_updates=mode, verbose=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_library_input(name):
    make, error, message = CASES[name]
    start = time.monotonic()
    with pytest.raises(error, match=message):
        make()
    assert time.monotonic() - start < 30


LAUNCHER = {
    "workers_zero": (["--workers", "0", "--", "python", "x.py"], "--workers must be at least 1"),
    "negative_ps": (["--ps", "-3", "--", "python", "x.py"], "--ps must be 0 or more"),
    "no_command": (["--workers", "1"], "no command given"),
    "missing_script": (["--", sys.executable, "nope/train.py"], "script 'nope/train.py' does not exist"),
    "unknown_flag": (["--gpus", "2", "--", "python", "x.py"], "unrecognized arguments: --gpus"),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_launcher_input(name):
    args, message = LAUNCHER[name]
    proc = subprocess.run([sys.executable, "-m", "keras_dist.cluster.launch", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1500:]


def test_catalogue_has_at_least_twenty_distinct_messages():
    messages = [m for _, _, m in CASES.values()] + [m for _, m in LAUNCHER.values()]
    assert len(messages) >= 20 and len(set(messages)) == len(messages)
    json.dumps(messages)  # plain data, printable in a report


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_mismatched_input_shapes_across_workers_fail_fast_without_a_hang():
    """Worker 1 feeds 32 features to a 64-feature model while worker 0 waits
    in the gradient all-reduce: the launcher sees worker 1 fail, stops worker
    0 instead of letting it wait forever, and reports the shape error."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--",
         sys.executable, "tests/scripts/mwms_mismatch.py"],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "expected axis -1 of input shape to have value 64" in proc.stdout
    assert "[keras-dist-run] worker:1 exited with code 1; stopping the cluster" in proc.stdout
    assert "finished" not in proc.stdout
    assert time.monotonic() - start < 150
