"""The staleness frontier's methods: `DelayedNesterov` (Liu et al. 2024)
against a NumPy replay of the paper's Algorithm 3, and `DelayAdaptive`,
`Ringmaster` and `DelayedNesterov` in `keras_dist.simulate.fit`.

(`DelayAdaptive` and `Ringmaster`'s own rules are replayed in NumPy in
tests/test_optimizers.py beside the other wrappers', and on tensors in
tests/test_local_wrappers.py; on a real cluster in tests/test_async.py and
tests/test_local_steps.py.)
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import simulate
from keras_dist.optimizers import DelayAdaptive, DelayedNesterov, Ringmaster
from procs import digits_model, mean_output_model

SHAPES = [(3, 2), (2,)]


def delayed_nesterov_numpy(weights, pushes, eps, beta, n, c):
    """Liu et al. 2024, Algorithm 3, written from the paper."""
    theta = [w.astype("float64").copy() for w in weights]
    m = [np.zeros_like(w) for w in theta]
    delta = [np.zeros_like(w) for w in theta]
    for t, g in enumerate(pushes):
        for i, gi in enumerate(g):
            delta[i] = delta[i] + gi
            if (t + 1) % n == 0:
                m[i] = beta * m[i] + delta[i] / n
                theta[i] = theta[i] - eps * ((1 - c * n + c) * beta * m[i] + gi / n)
                delta[i] = np.zeros_like(delta[i])
            else:
                theta[i] = theta[i] - eps * (c * beta * m[i] + gi / n)
    return theta, m, delta


def _pushes(count, seed=0):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype("float32") for s in SHAPES]
    return weights, [[rng.normal(size=s).astype("float32") for s in SHAPES]
                     for _ in range(count)]


def _apply_all(optimizer, weights, pushes):
    variables = [keras.Variable(w) for w in weights]
    for g in pushes:
        optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], variables)
    return variables


@pytest.mark.parametrize("workers, c, count", [(3, 0.0, 7), (3, 0.2, 9), (4, 0.25, 8)])
def test_delayed_nesterov_matches_the_papers_algorithm(workers, c, count):
    weights, pushes = _pushes(count)
    opt = DelayedNesterov(learning_rate=0.3, momentum=0.9, workers=workers, c=c)
    variables = _apply_all(opt, weights, pushes)
    theta, m, delta = delayed_nesterov_numpy(weights, pushes, 0.3, 0.9, workers, c)
    for got, want in zip(variables, theta):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    for got, want in zip(opt.momentums + opt.buffers, m + delta):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    assert int(opt.iterations.numpy()) == count
    # The momentum moved only at pushes N, 2N, ...: different from Nesterov
    # applied at every push.
    nesterov = _apply_all(keras.optimizers.SGD(0.3, momentum=0.9, nesterov=True), weights,
                          pushes)
    assert any(not np.allclose(a.numpy(), b.numpy(), atol=1e-4)
               for a, b in zip(variables, nesterov))


def test_delayed_nesterov_with_a_period_of_one_is_keras_nesterov():
    weights, pushes = _pushes(6, seed=1)
    delayed = _apply_all(DelayedNesterov(0.3, momentum=0.9, workers=1), weights, pushes)
    nesterov = _apply_all(keras.optimizers.SGD(0.3, momentum=0.9, nesterov=True), weights,
                          pushes)
    for a, b in zip(delayed, nesterov):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_n_pushes_with_c_zero_are_one_nesterov_step_on_their_mean():
    """The paper's point: every N pushes move the weights as synchronous
    DiLoCo's outer Nesterov step on the N workers' average would."""
    weights, pushes = _pushes(3 * 4, seed=2)
    delayed = _apply_all(DelayedNesterov(0.7, momentum=0.9, workers=4), weights, pushes)
    means = [[np.mean([p[i] for p in pushes[j:j + 4]], axis=0) for i in range(len(SHAPES))]
             for j in range(0, 12, 4)]
    synchronous = _apply_all(keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True), weights,
                             means)
    for a, b in zip(delayed, synchronous):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": 1.0}, r"`momentum` must be a float in \[0, 1\). Received: momentum=1.0"),
    ({"workers": 0}, "`workers` must be an integer >= 1 or None. Received: workers=0"),
    ({"workers": 4, "c": 0.5}, r"`c` must be a float in \[0, 1 / workers\].*c=0.5 with "
                               "workers=4"),
    ({"c": -0.1}, r"`c` must be a float in \[0, 1 / workers\].*Received: c=-0.1"),
])
def test_delayed_nesterov_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedNesterov(**kwargs)


def test_delayed_nesterov_refuses_a_c_too_large_for_the_cluster_when_built():
    opt = DelayedNesterov(c=0.5)  # workers=None: 1 outside parameter servers, c <= 1 fine
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    assert opt.workers == 1
    model = digits_model(keras.optimizers.SGD(0.1), hidden=8, metrics=None, seed=0)
    x, y = np.zeros((128, 64), "float32"), np.zeros(128, "int32")
    with pytest.raises(ValueError, match=r"`c` must be at most 1 / workers = 1 / 4"):
        simulate.fit(model, x, y, workers=4, local_steps=2,
                     outer_optimizer=DelayedNesterov(c=0.5))


def test_delayed_nesterov_config_round_trip_keeps_its_state_after_saving(tmp_path):
    opt = DelayedNesterov(learning_rate=0.5, momentum=0.8, workers=3, c=0.1)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert type(restored) is DelayedNesterov
    assert restored.get_config() == opt.get_config()
    # As a model's optimizer, its momentum and push sum survive .keras.
    model = digits_model(DelayedNesterov(0.05, momentum=0.9, workers=3), hidden=8,
                         metrics=None, seed=0)
    x = np.random.default_rng(0).random((64, 64)).astype("float32")
    y = np.arange(64) % 10
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)  # 2 steps: the buffer is not empty
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is DelayedNesterov and loaded.optimizer.workers == 3
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert any(np.abs(b.numpy()).max() > 0 for b in loaded.optimizer.buffers)


# ------------------------------------------------------------ in simulation
@pytest.fixture(scope="module")
def digits():
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    return x[:640], y[:640]


def _mlp(optimizer):
    return digits_model(optimizer, hidden=16, metrics=None, seed=0)


def test_simulation_gives_the_wrappers_its_worker_count(digits):
    x, y = digits
    for make in (lambda: DelayAdaptive(keras.optimizers.SGD(0.1)),
                 lambda: DelayedNesterov()):
        opt = make()
        model = _mlp(keras.optimizers.SGD(0.1) if isinstance(opt, DelayedNesterov) else opt)
        kwargs = {"local_steps": 2, "outer_optimizer": opt} if isinstance(
            opt, DelayedNesterov) else {}
        simulate.fit(model, x, y, workers=5, seed=0, **kwargs)
        assert opt.workers == 5, type(opt).__name__


def test_delay_adaptive_keeps_every_update_of_equal_workers_and_damps_a_stragglers(digits):
    """Equal constant workers: tau = N - 1 < N, so it is plain SGD exactly;
    a 4x straggler's updates have tau > N and are damped by N / tau."""
    x, y = digits
    plain, adaptive = _mlp(keras.optimizers.SGD(0.1)), _mlp(
        DelayAdaptive(keras.optimizers.SGD(0.1)))
    for model in (plain, adaptive):
        simulate.fit(model, x, y, workers=4, seed=1, speed="constant")
    for a, b in zip(plain.weights, adaptive.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert adaptive.optimizer.staleness_logs()["delay_adaptive_scale_mean"] == 1.0

    opt = DelayAdaptive(keras.optimizers.SGD(0.1))
    _, sched = simulate.fit(_mlp(opt), x, y, workers=4, seed=1, speed="constant",
                            stragglers={0: 4.0})
    expected = np.mean(4 / np.maximum(4, sched.staleness))
    assert expected < 0.99  # some updates were staler than N
    assert opt.staleness_logs()["delay_adaptive_scale_mean"] == pytest.approx(expected,
                                                                             rel=1e-5)


def test_ringmaster_drops_exactly_the_updates_at_or_past_its_threshold(digits):
    x, y = digits
    opt = Ringmaster(keras.optimizers.SGD(0.1), threshold=4)
    _, sched = simulate.fit(_mlp(opt), x, y, workers=4, seed=2, speed="constant",
                            stragglers={0: 3.0})
    dropped = int(np.sum(sched.staleness >= 4))
    assert dropped > 0
    assert opt.staleness_logs()["dropped_updates"] == dropped
    assert int(opt.iterations.numpy()) == len(sched.staleness) - dropped
    # At threshold N, equal workers (tau = N - 1) lose nothing: plain SGD exactly.
    plain, ring = _mlp(keras.optimizers.SGD(0.1)), _mlp(
        Ringmaster(keras.optimizers.SGD(0.1), threshold=4))
    for model in (plain, ring):
        simulate.fit(model, x, y, workers=4, seed=2, speed="constant")
    for a, b in zip(plain.weights, ring.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_simulated_local_steps_with_delayed_nesterov_from_one_worker_is_outer_nesterov(digits):
    """One worker, period 1: each push is one Keras Nesterov step on minus its change."""
    x, y = digits
    delayed, nesterov = _mlp(keras.optimizers.SGD(0.1)), _mlp(keras.optimizers.SGD(0.1))
    simulate.fit(delayed, x, y, workers=1, local_steps=4, seed=3,
                 outer_optimizer=DelayedNesterov(0.7, momentum=0.9))
    simulate.fit(nesterov, x, y, workers=1, local_steps=4, seed=3,
                 outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True))
    for a, b in zip(delayed.weights, nesterov.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_learns_with_many_simulated_workers(digits):
    """8 workers, k = 4: outer Nesterov momentum applied at every stale push
    diverges where the delayed form learns (Liu et al.'s finding), at the
    same outer learning rate and momentum (measured: 0.88 against 0.10;
    without an outer optimizer the pushes' sum diverges too)."""
    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()

    def accuracy(outer, seed):
        model = digits_model(keras.optimizers.SGD(0.1), hidden=32, seed=seed)
        simulate.fit(model, x, y, workers=8, local_steps=4, epochs=10, seed=seed,
                     outer_optimizer=outer)
        return model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]

    delayed = np.mean([accuracy(DelayedNesterov(0.7, momentum=0.9), s) for s in (0, 1)])
    every_push = np.mean([accuracy(keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True), s)
                          for s in (0, 1)])
    assert delayed >= 0.8, delayed
    assert delayed > every_push + 0.3, (delayed, every_push)


# ------------------------------------------- Ringmaster's stops, DyLU (simulated)
def test_stopped_workers_restart_on_the_weights_of_the_moment_they_are_stopped():
    """Three equal workers, R = 1: all finish together, worker 0 lands (tau
    0) and the other two, now one update behind, restart on its weights;
    so worker 0 lands every update, one per time unit, and 2 stops each."""
    sched = simulate.schedule(3, 6, speed="constant", restart_stale=1)
    assert sched.workers.tolist() == [0] * 6
    assert sched.staleness.tolist() == [0] * 6
    assert sched.times.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert sched.stopped == 12


@pytest.mark.parametrize("threshold", [2, 8, "adaptive"])
def test_with_stops_every_update_lands_below_the_threshold(threshold):
    sched = simulate.schedule(32, 600, restart_stale=threshold, seed=4)
    k = np.arange(1, 601)
    limit = np.maximum(1, np.floor(np.sqrt(k))) if threshold == "adaptive" else threshold
    assert np.all(sched.staleness < limit)
    assert sched.stopped > 0
    if threshold != "adaptive":  # the threshold is reached: R - 1 is the stalest kept
        assert sched.staleness.max() == threshold - 1
    # Without stops, the same workers land updates up to ~2N stale.
    assert simulate.schedule(32, 600, seed=4).staleness.max() >= 31


def test_a_threshold_above_every_delay_stops_nothing():
    plain = simulate.schedule(8, 200, seed=1)
    stopping = simulate.schedule(8, 200, seed=1, restart_stale=1000)
    assert stopping.stopped == 0
    for a, b in zip((plain.workers, plain.staleness, plain.times),
                    (stopping.workers, stopping.staleness, stopping.times)):
        np.testing.assert_array_equal(a, b)


def test_simulated_ringmaster_with_stops_drops_nothing(digits):
    x, y = digits
    opt = Ringmaster(keras.optimizers.SGD(0.1), threshold=3)
    _, sched = simulate.fit(_mlp(opt), x, y, workers=8, seed=5, restart_stale=3)
    assert sched.stopped > 0 and sched.staleness.max() <= 2
    assert opt.staleness_logs()["dropped_updates"] == 0
    assert int(opt.iterations.numpy()) == len(sched.staleness) == len(x) // 32


@pytest.mark.parametrize("kwargs, message", [
    ({"restart_stale": 0}, "`restart_stale` must be an integer >= 1. Received: restart_stale=0"),
    ({"restart_stale": 2, "gap": 0.5}, "`restart_stale` .* does not combine with `outages`, "
                                       "`gap` or `concurrency`"),
    ({"restart_stale": 2, "concurrency": 2}, "does not combine"),
])
def test_bad_restart_stale(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate.schedule(4, 10, **kwargs)


def test_dynamic_local_steps_give_each_worker_steps_in_proportion_to_its_speed():
    """DyLU (Liu et al. 2024, eq. 6): speeds 1/2, 1/4 and 1 with k = 8 give
    rounds of 4, 2 and 8 steps, which take equal time, so the three workers
    push equally often (4:2:1 without it); every batch an epoch's pushes
    took is applied once: the weights end at w0 - lr * (their gradients)."""
    x = np.random.default_rng(0).normal(size=(32 * 40, 3)).astype("float32")
    y = np.zeros((len(x), 1), "float32")
    stragglers = {0: 2.0, 1: 4.0}
    model = mean_output_model(0.01)
    w0 = model.weights[0].numpy().copy()
    history, sched = simulate.fit(model, x, y, workers=3, epochs=3, local_steps=8, seed=7,
                                  speed="constant", stragglers=stragglers,
                                  dynamic_local_steps=True)
    steps = {0: 4, 1: 2, 2: 8}
    counts = np.bincount(sched.workers, minlength=3)
    assert counts.max() - counts.min() <= 1, counts
    _, fixed = simulate.fit(mean_output_model(0.01), x, y, workers=3, epochs=3, local_steps=8,
                            seed=7, speed="constant", stragglers=stragglers)
    fixed_counts = np.bincount(fixed.workers, minlength=3)
    assert fixed_counts[2] >= 3 * fixed_counts[1], fixed_counts
    # The replay: each epoch's pushes take the next k_w batches of its
    # permutation, until the next push does not fit in the 40 batches.
    rng = np.random.default_rng(7)
    change, start = np.zeros(3), 0
    for end in sched.epoch_ends:
        order, used = rng.permutation(len(x)), 0
        for w in sched.workers[start:end]:
            rows = order[used * 32:(used + steps[int(w)]) * 32]
            change += x[rows].reshape(steps[int(w)], 32, 3).mean(axis=1).sum(axis=0)
            used += steps[int(w)]
        assert used <= 40 and used + min(steps.values()) > 40 - 8  # little left over
        start = end
    np.testing.assert_allclose(model.weights[0].numpy()[:, 0], w0[:, 0] - 0.01 * change,
                               rtol=1e-4, atol=1e-5)
    assert len(history["loss"]) == 3 and len(simulate.epoch_times(sched, 3)) == 3


def test_dynamic_local_steps_needs_local_steps():
    with pytest.raises(ValueError, match="`dynamic_local_steps` is True or False, and True "
                                         "needs local_steps >= 2.*local_steps=1"):
        simulate.fit(mean_output_model(0.1), np.zeros((64, 3), "float32"),
                     np.zeros((64, 1), "float32"), workers=2, dynamic_local_steps=True)
