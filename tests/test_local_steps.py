"""Local steps (Downpour / local SGD / DiLoCo): keras_dist.training.local_steps.

In-process: Keras' update rules on tensors (`keras_dist.training.stateless`) equal
the optimizers' own `apply`, and bad options get clear errors. On a real
cluster (chief, 2 workers, 1 ps): one round of k local steps equals k
sequential Keras steps, racing workers lose no pushed change, and digits
training learns with and without an outer optimizer.
"""

import numpy as np
import pytest

import keras
import tensorflow as tf

import keras_dist as kd
from keras_dist.training import stateless
from procs import ASYNC_LEARNS, SHARED_TIMEOUT

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_clipped": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stateless_apply_equals_apply(name):
    rng = np.random.default_rng(0)
    w0 = [rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=(2,)).astype("float32")]
    grads = [[rng.normal(size=w.shape).astype("float32") for w in w0] for _ in range(5)]
    stateful = [keras.Variable(w) for w in w0]
    reference = OPTIMIZERS[name]()
    reference.build(stateful)
    for g in grads:
        reference.apply(g, stateful)
    variables = [keras.Variable(w) for w in w0]
    optimizer = OPTIMIZERS[name]()
    optimizer.build(variables)

    @tf.function
    def steps():
        w = [v.value for v in variables]
        state = [v.value for v in optimizer.variables]
        for g in grads:
            w, state = stateless.stateless_apply(optimizer, state, [tf.constant(x) for x in g], w)
        return w, state

    w, state = steps()
    for a, b in zip(stateful, w):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-7)
    for a, b in zip(reference.variables, state):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-7)
    # The variables themselves were not touched.
    for v, original in zip(variables, w0):
        np.testing.assert_array_equal(v.numpy(), original)


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_local_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"local_steps.*integer >= 1.*" + repr(bad)[:3]):
        kd.fit(_model(), np.ones((8, 4)), np.ones((8, 1)), strategy="default", verbose=0,
               local_steps=bad)


def test_local_steps_under_a_synchronous_strategy_is_refused():
    x, y = np.ones((8, 4)), np.ones((8, 1))
    with pytest.raises(ValueError, match="need parameter servers.*MirroredStrategy"):
        kd.fit(_model, x, y, strategy="mirrored", verbose=0, local_steps=4)
    model = kd.AsyncModel.from_model(_model())
    with pytest.raises(ValueError, match="need parameter servers"):
        model.fit(x, y, verbose=0, outer_optimizer=keras.optimizers.SGD(0.7))
    # local_steps=1 is plain training anywhere: a script runs locally unchanged.
    assert len(model.fit(x, y, verbose=0, local_steps=1).history["loss"]) == 1


def test_elastic_is_checked_and_needs_parameter_servers():
    x, y = np.ones((8, 4)), np.ones((8, 1))
    with pytest.raises(ValueError, match=r"`elastic` must be a float in \(0, 1\].*elastic=1.5"):
        kd.fit(_model(), x, y, strategy="default", verbose=0, local_steps=4, elastic=1.5)
    with pytest.raises(ValueError, match="two ways to push a round"):
        kd.fit(_model(), x, y, strategy="default", verbose=0, local_steps=4, elastic=0.5,
               outer_optimizer=keras.optimizers.SGD(0.7))
    with pytest.raises(ValueError, match="elastic need parameter servers.*MirroredStrategy"):
        kd.fit(_model, x, y, strategy="mirrored", verbose=0, elastic=0.5)
    model = kd.AsyncModel.from_model(_model())
    with pytest.raises(ValueError, match="need parameter servers"):
        model.fit(x, y, verbose=0, local_steps=2, elastic=0.5)


def test_outer_optimizer_must_be_an_optimizer():
    with pytest.raises(ValueError, match="outer_optimizer.*'sgd'"):
        kd.fit(_model(), np.ones((8, 4)), np.ones((8, 1)), strategy="default", verbose=0,
               local_steps=2, outer_optimizer="sgd")


@pytest.mark.compat("local steps")
@pytest.mark.multiprocess
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # it may be the one that starts the shared cluster
def test_local_steps_on_a_real_cluster(request, shared_cluster):
    result, _ = shared_cluster.result(request.node)
    # One worker, one round of K=4 steps: Keras' own 4 steps, for SGD,
    # momentum and Adam (weights within one float rounding, slots exact).
    for name, check in result["one_round"].items():
        assert check["weights"] <= 1e-6, (name, check)
        assert check["optimizer_state"] <= 1e-6, (name, check)
        assert check["iterations"] == 4 and check["version"] == 1, (name, check)
    # Two rounds chained in one execution on one worker: Keras' own 8 steps.
    for name, check in result["one_round_chained"].items():
        assert check["weights"] <= 1e-6, (name, check)
        assert check["optimizer_state"] <= 1e-6, (name, check)
        assert check["iterations"] == 8 and check["version"] == 2, (name, check)
    # Two racing workers: the ps holds w0 plus every round's change (none
    # lost), with one round per execution and with two chained.
    for name in ("sum", "sum_chained"):
        total = result[name]
        assert total["version"] == 24 and sum(total["rounds_per_worker"].values()) == 24
        assert total["total_change"] > 0.1
        assert total["max_difference"] <= 1e-5 * max(1.0, total["total_change"]), total
    # Training learns with local steps, with and without an outer optimizer;
    # the version counts pushes (epochs x steps / K) and both workers pushed.
    # EASGD: the exchange conserves centre + copies; both moved, and the two
    # workers' copies went their own ways.
    elastic = result["elastic_sum"]
    assert elastic["version"] == 24 and sorted(elastic["rounds_per_worker"]) == ["0", "1"]
    assert elastic["max_difference"] <= 1e-5 * max(1.0, elastic["total_change"]), elastic
    assert elastic["centre_moved"] > 0.01 and elastic["copies_differ"] > 1e-4, elastic
    # Delayed Nesterov took N = 2 from the cluster, saw every push (3 x 40,
    # even), so its push sum was folded into the momentum at the last one.
    outer = result["train_delayed_nesterov"]["outer"]
    assert outer["workers"] == 2 and outer["iterations"] == 3 * 40, outer
    assert outer["buffer"] == 0.0 and outer["momentum"] > 0, outer
    for name in ("train", "train_outer", "train_elastic", "train_delayed_nesterov"):
        run = result[name]
        assert run["test_accuracy"] >= ASYNC_LEARNS, (name, run["test_accuracy"])
        assert run["version"] == 3 * 40
        assert all(v > 0 for v in run["updates_per_worker"].values())
        assert sorted(run["updates_per_worker"]) == ["0", "1"]
        # Each execution's seconds split into its pull, its steps and its
        # push, as the worker timed them.
        assert run["phases"], name
        for pull, compute, push, seconds in run["phases"]:
            assert min(pull, compute, push) > 0, (name, pull, compute, push)
            assert abs(pull + compute + push - seconds) <= 1e-9 * seconds + 1e-12, (
                name, pull, compute, push, seconds)
    errors = result["errors"]
    assert "steps_per_execution=2" in errors["steps_per_execution"]
    assert "overrides train_step" in errors["train_step"]
    assert "got LossScaleOptimizer" in errors["loss_scale"]


def test_a_backup_holds_the_outer_optimizer_and_the_elastic_copies(request, shared_cluster):
    """BackupAndRestore under local steps keeps the state beside the model:
    an outer optimizer's (SGD with Nesterov momentum, Delayed Nesterov's
    momentum and push buffer) and EASGD's per-worker copies. A fit stopped
    after its first epoch's backup, then a fresh model restoring it
    (tests/scripts/ps_local_backup.py)."""
    result, _ = shared_cluster.result(request.node)
    outer, elastic = ["model", "outer", "outer_slots"], ["elastic", "model"]
    for name, groups in (("nesterov", outer), ("delayed_nesterov", outer), ("elastic", elastic)):
        check = result[name]
        assert check["groups"] == groups, (name, check)
        assert check["restored_epoch"] == 1 and check["epochs_run"] == 2, (name, check)
        # The restore gives back exactly what the backup holds ...
        for group, differences in check["restored"].items():
            assert max(differences) == 0.0, (name, group, differences)
        # ... and each of those variables differed in the fresh run before
        # it (its own initial weights, zero momentum, copies of its weights).
        for group in groups:
            if group != "outer":  # the learning rate is the same in both
                assert min(check["fresh"][group]) > 0, (name, group, check["fresh"][group])
