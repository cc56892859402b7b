"""DANA (`kd.optimizers.DANA`), checked against the paper's own form.

The wrapper keeps the look-ahead weights in the model and updates them
directly. The tests replay the paper's master in NumPy -- the true weights
`theta`, one velocity per worker, and `theta_hat = theta - eta * gamma *
sum_j v_j` sent to each worker -- on the same simulated schedule, and
compare. The real-cluster case is in tests/scripts/ps_dana.py.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import simulate
from keras_dist.optimizers import DANA, DynSGD, GapAware
from keras_dist.training.update import UpdateInfo
from procs import ASYNC_LEARNS, SHARED_TIMEOUT, digits_model

ETA, GAMMA = 0.05, 0.9


def linear_problem(seed=0, n=96):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 5)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


def linear_model(optimizer, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    return model


def paper_master(weights, x, y, sched, *, workers, epochs, batch_size, seed):
    """The paper's master for a linear model with MSE, in float64: returns
    (theta, theta_hat) after replaying `sched` with simulate.fit's batches."""
    theta = [w.astype(np.float64) for w in weights]
    velocity = [[np.zeros_like(t) for t in theta] for _ in range(workers)]

    def look_ahead():
        return [t - ETA * GAMMA * sum(v[k] for v in velocity) for k, t in enumerate(theta)]

    sent = {0: look_ahead()}
    read = np.arange(len(sched.staleness)) - sched.staleness
    rng, update = np.random.default_rng(seed), 0
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(len(x) // batch_size):
            idx = order[i * batch_size:(i + 1) * batch_size]
            kernel, bias = sent[int(read[update])]  # what this worker read
            residual = x[idx] @ kernel + bias - y[idx]
            grads = (2 * x[idx].T @ residual / len(idx), 2 * residual.mean(0))
            w = int(sched.workers[update])
            for k, g in enumerate(grads):
                velocity[w][k] = GAMMA * velocity[w][k] + g
                theta[k] = theta[k] - ETA * velocity[w][k]
            update += 1
            sent[update] = look_ahead()
    return theta, look_ahead()


@pytest.mark.compat("wrappers")
@pytest.mark.parametrize("workers", [2, 5])
def test_simulated_dana_is_the_papers_master_exactly(workers):
    x, y = linear_problem()
    model = linear_model(DANA(keras.optimizers.SGD(ETA), momentum=GAMMA))
    initial = model.get_weights()
    _, sched = simulate.fit(model, x, y, workers=workers, epochs=2, batch_size=8, seed=3)
    assert sched.mean_staleness > 0.5
    theta, theta_hat = paper_master(initial, x, y, sched, workers=workers, epochs=2,
                                    batch_size=8, seed=3)
    # The model holds what workers read, theta_hat; master_weights() is theta.
    for got, want in zip(model.get_weights(), theta_hat):
        np.testing.assert_allclose(got, want, atol=2e-6)
    for got, want in zip(model.optimizer.master_weights(), theta):
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert max(np.abs(a - b).max() for a, b in zip(theta, theta_hat)) > 1e-3  # they differ
    # One velocity row per worker, each pushed only by its worker's updates.
    velocities = model.optimizer.velocities[0].numpy()
    assert velocities.shape == (workers, 5, 1)
    assert all(np.abs(velocities[w]).max() > 0 for w in range(workers))


def test_one_worker_is_keras_nesterov_sgd():
    x, y = linear_problem()
    dana = linear_model(DANA(keras.optimizers.SGD(ETA), momentum=GAMMA, workers=1))
    simulate.fit(dana, x, y, workers=1, epochs=2, batch_size=16, seed=0)
    nesterov = linear_model(keras.optimizers.SGD(ETA, momentum=GAMMA, nesterov=True))
    rng = np.random.default_rng(0)  # simulate.fit's batch order
    for _ in range(2):
        order = rng.permutation(len(x))
        for i in range(len(x) // 16):
            idx = order[i * 16:(i + 1) * 16]
            nesterov.train_on_batch(x[idx], y[idx])
    for a, b in zip(dana.get_weights(), nesterov.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_an_update_moves_only_its_workers_velocity():
    variable = keras.Variable(np.ones((3, 2), "float32"))
    optimizer = DANA(keras.optimizers.SGD(0.1), momentum=0.5, workers=4)
    g = np.full((3, 2), 2.0, "float32")
    optimizer.apply([g], [variable], update=UpdateInfo(staleness=1, worker=2))
    optimizer.apply([g], [variable], update=UpdateInfo(staleness=1, worker=2))
    velocity = optimizer.velocities[0].numpy()
    np.testing.assert_allclose(velocity[2], 0.5 * 2.0 + 2.0)  # gamma * v + g, twice
    assert not velocity[[0, 1, 3]].any()
    # theta_hat: 1 - 0.1 * (g + 0.5 * 2) - 0.1 * (g + 0.5 * 3)
    np.testing.assert_allclose(variable.numpy(), 1 - 0.1 * 3.0 - 0.1 * 3.5, rtol=1e-6)


def test_keras_fit_warns_once_and_trains_as_nesterov():
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    dana = digits_model(DANA(keras.optimizers.SGD(0.02)), hidden=32, metrics=None, seed=0)
    with pytest.warns(UserWarning, match="unknown.*trains as the only worker") as record:
        h_dana = dana.fit(x, y, epochs=2, batch_size=64, shuffle=False, verbose=0)
    assert len([w for w in record if "staleness" in str(w.message)]) == 1
    assert dana.optimizer.workers == 1
    nesterov = digits_model(keras.optimizers.SGD(0.02, momentum=0.9, nesterov=True),
                            hidden=32, metrics=None, seed=0)
    h_nesterov = nesterov.fit(x, y, epochs=2, batch_size=64, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_dana.history["loss"], h_nesterov.history["loss"], rtol=1e-5)


def test_save_load_keeps_every_workers_velocity(tmp_path):
    x, y = linear_problem()
    model = linear_model(GapAware(DANA(keras.optimizers.SGD(ETA), momentum=GAMMA)))
    simulate.fit(model, x, y, workers=3, epochs=1, batch_size=8, seed=0)
    model.save(tmp_path / "dana.keras")
    loaded = keras.models.load_model(tmp_path / "dana.keras")
    inner = loaded.optimizer.inner_optimizer
    assert type(inner) is DANA and inner.workers == 3 and inner.momentum == GAMMA
    for a, b in zip(inner.velocities, model.optimizer.inner_optimizer.velocities):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Training goes on with the restored velocities (same schedule, same result).
    simulate.fit(loaded, x, y, workers=3, epochs=1, batch_size=8, seed=1)
    simulate.fit(model, x, y, workers=3, epochs=1, batch_size=8, seed=1)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_dana_trains_the_digits_with_many_simulated_workers():
    """16 workers: DANA learns, where the same momentum in the inner SGD
    (one velocity shared by every stale gradient) does much worse."""
    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()

    def accuracy(optimizer):
        model = digits_model(optimizer, metrics=None, seed=0)
        simulate.fit(model, x, y, workers=16, epochs=10, seed=0)
        return float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean())

    dana = accuracy(DANA(keras.optimizers.SGD(0.01), momentum=0.9))
    shared = accuracy(keras.optimizers.SGD(0.01, momentum=0.9))
    assert dana >= 0.85, dana
    assert dana > shared + 0.05, (dana, shared)


@pytest.mark.parametrize("make, message", [
    (lambda: DANA(keras.optimizers.SGD(0.1), momentum=1.0),
     r"`momentum` must be a float in \[0, 1\). Received: momentum=1.0"),
    (lambda: DANA(keras.optimizers.SGD(0.1), workers=0),
     "`workers` must be an integer >= 1 or None. Received: workers=0"),
    (lambda: DANA(keras.optimizers.Adam(0.1)),
     "must be keras.optimizers.SGD without momentum.*Received: Adam"),
    (lambda: DANA(keras.optimizers.SGD(0.1, momentum=0.9)),
     r"SGD without momentum.*Received: SGD\(momentum=0.9\)"),
    (lambda: DANA(DynSGD(keras.optimizers.SGD(0.1, momentum=0.5))),
     r"Received: SGD\(momentum=0.5\)"),
    (lambda: DANA(DANA(keras.optimizers.SGD(0.1))), "DANA cannot wrap DANA"),
], ids=["momentum", "workers", "adam", "sgd_momentum", "deep_momentum", "nested"])
def test_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_fewer_velocity_slots_than_simulated_workers_is_refused():
    x, y = linear_problem()
    model = linear_model(DANA(keras.optimizers.SGD(ETA), workers=2))
    with pytest.raises(ValueError, match=r"keeps state for 2 workers.*workers=4"):
        simulate.fit(model, x, y, workers=4, epochs=1, batch_size=8)


def test_no_worker_in_the_update_is_a_clear_error():
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer = DANA(keras.optimizers.SGD(0.1), workers=2)
    with pytest.raises(ValueError, match="DANA needs the worker of each update"):
        optimizer.apply([np.ones((2,), "float32")], [variable],
                        update=UpdateInfo(staleness=0))
    np.testing.assert_array_equal(variable.numpy(), [1.0, 1.0])


def test_listed_with_the_other_wrappers():
    assert "DANA" in kd.optimizers.__all__ and kd.optimizers.DANA is DANA


@pytest.mark.multiprocess
@pytest.mark.timeout(SHARED_TIMEOUT + 60)
def test_dana_on_a_real_cluster(request, shared_cluster):
    """Two workers, one ps (tests/scripts/ps_dana.py): the velocities live on
    the parameter server, one row per worker, and each update uses its
    worker's row."""
    result, _ = shared_cluster.result(request.node)
    one = result["one_execution"]
    assert one["workers"] == 2  # read from the cluster
    # One execution of 4 steps on one worker is Keras' Nesterov SGD exactly,
    # and only that worker's velocity row moved.
    assert one["weights"] <= 1e-6, one
    assert one["velocity_vs_keras"] <= 1e-4 * max(1.0, one["velocity_size"]), one
    assert one["velocity_size"] > 0.01 and one["other_rows"] == 0.0, one
    train = result["train"]
    assert train["test_accuracy"] >= ASYNC_LEARNS, train
    assert train["version"] == 8 * 45, train
    # Both workers sent updates, and each into its own row.
    assert sorted(train["updates_per_worker"]) == ["0", "1"], train
    assert train["rows_moved"] == [True, True], train


@pytest.mark.parametrize("argument", ["clipnorm", "use_ema", "weight_decay"])
def test_base_optimizer_arguments_are_refused_not_dropped(argument):
    with pytest.raises(ValueError, match=f"does not take base-optimizer arguments.*{argument}="):
        DANA(keras.optimizers.SGD(0.1), **{argument: 1})
