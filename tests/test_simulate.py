"""keras_dist.simulate: the schedule against known results, and simulated training."""

import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import simulate
from procs import digits_model, mean_output_model


@pytest.mark.parametrize("workers", [1, 2, 4, 16, 64, 256])
def test_equal_constant_workers_have_staleness_n_minus_one(workers):
    """The dist-keras thesis' sanity check, exactly: after the first round,
    N equally fast workers take turns and every update is N - 1 stale."""
    sched = simulate.schedule(workers, 4 * workers + 10, speed="constant")
    assert list(sched.staleness[:workers]) == list(range(workers))
    assert set(sched.staleness[workers:]) == {workers - 1}
    assert list(sched.workers[:2 * workers]) == list(range(workers)) * 2


@pytest.mark.parametrize("workers", [4, 16, 64])
def test_noisy_equal_workers_average_n_minus_one(workers):
    sched = simulate.schedule(workers, 200 * workers, sigma=0.2, seed=1)
    assert sched.mean_staleness == pytest.approx(workers - 1, rel=0.03)
    counts = np.bincount(sched.workers, minlength=workers)
    assert counts.min() > 0.8 * counts.mean()  # everyone contributes about equally


def test_a_straggler_contributes_less_and_its_updates_are_staler():
    sched = simulate.schedule(4, 4000, stragglers={0: 4.0}, seed=2)
    counts = np.bincount(sched.workers, minlength=4)
    assert counts[0] == pytest.approx(counts[1:].mean() / 4, rel=0.15)
    slow_tau = sched.staleness[sched.workers == 0].mean()
    fast_tau = sched.staleness[sched.workers != 0].mean()
    assert slow_tau > 3 * fast_tau


def test_a_worker_in_an_outage_contributes_nothing_then_returns():
    sched = simulate.schedule(4, 400, speed="constant", outages={2: (10.5, 50.0)})
    during = sched.workers[(sched.times > 11) & (sched.times < 50)]
    after = sched.workers[sched.times > 51]
    assert 2 not in during and 2 in after
    first_back = np.argmax((sched.workers == 2) & (sched.times > 50))
    # It re-read the weights when it came back, so its first update is at
    # most N - 1 stale (not the ~120 updates since its last read before).
    assert sched.staleness[first_back] <= 3


@pytest.mark.parametrize("workers, gap", [(4, 1.0), (16, 3.0), (8, 0.5)])
def test_a_gap_between_update_and_read_lowers_staleness_to_n_minus_one_over_one_plus_gap(
        workers, gap):
    """Updates landing while a worker is between its update and its next read
    do not make its next gradient stale."""
    sched = simulate.schedule(workers, 300 * workers, sigma=0.2, gap=gap, seed=3)
    assert sched.mean_staleness == pytest.approx((workers - 1) / (1 + gap), rel=0.05)
    # Each update's tau is exactly the updates landed between its worker's
    # read (its previous update's time + gap) and its own time.
    for i in range(workers, len(sched.staleness), 97):
        w = sched.workers[i]
        previous = np.flatnonzero(sched.workers[:i] == w)[-1]
        read_time = sched.times[previous] + gap
        landed = np.searchsorted(sched.times[:i], read_time, side="right")
        assert sched.staleness[i] == i - landed


def test_a_worker_with_a_long_gap_lands_fewer_updates_and_makes_the_others_fresher():
    sched = simulate.schedule(4, 4000, gap={0: 3.0}, seed=4)
    counts = np.bincount(sched.workers, minlength=4)
    assert counts[0] == pytest.approx(counts[1:].mean() / 4, rel=0.15)
    # tau = what the others land during one step (1 time unit): worker 0
    # sees the 3 others at 1 update each; the others see 2 others and a
    # quarter of worker 0.
    assert sched.staleness[sched.workers == 0].mean() == pytest.approx(3.0, rel=0.05)
    assert sched.staleness[sched.workers != 0].mean() == pytest.approx(2.25, rel=0.05)


@pytest.mark.parametrize("kwargs", [
    dict(speed="constant"), dict(sigma=0.3), dict(stragglers={0: 3.0}), dict(gap=1.5),
    dict(gap={1: 2.0}, stragglers={2: 0.5}), dict(speed="constant", outages={2: (10.5, 50.0)}),
    dict(outages={1: (3.0, 9.0)}, gap=0.7), dict(speed="pareto", alpha=1.8, stragglers={1: 2.0})])
def test_concurrency_of_every_worker_is_the_unlimited_schedule_exactly(kwargs):
    for workers in (3, 4, 16):
        free = simulate.schedule(workers, 500, seed=3, **kwargs)
        limited = simulate.schedule(workers, 500, seed=3, concurrency=workers, **kwargs)
        np.testing.assert_array_equal(free.workers, limited.workers)
        np.testing.assert_array_equal(free.staleness, limited.staleness)
        np.testing.assert_allclose(free.times, limited.times)


@pytest.mark.parametrize("workers, concurrency", [(4, 1), (4, 2), (16, 4), (8, 8)])
def test_at_most_c_workers_computing_makes_equal_workers_c_minus_one_stale(workers, concurrency):
    """Equal workers taking turns for C slots: while one computes, C - 1
    others do, and each of them lands once."""
    sched = simulate.schedule(workers, 40 * workers, speed="constant", concurrency=concurrency)
    assert set(sched.staleness[workers:].tolist()) == {concurrency - 1}
    counts = np.bincount(sched.workers, minlength=workers)
    assert counts.max() - counts.min() <= 1  # first come, first served: everyone in turn


def test_schedule_is_deterministic_under_a_seed():
    a = simulate.schedule(8, 300, seed=5)
    b = simulate.schedule(8, 300, seed=5)
    np.testing.assert_array_equal(a.workers, b.workers)
    assert not np.array_equal(a.workers, simulate.schedule(8, 300, seed=6).workers)


@pytest.mark.parametrize("speed, draw", [
    ("lognormal", lambda rng, n: rng.lognormal(0.0, 0.3, n)),
    ("pareto", lambda rng, n: 0.6 * (1.0 + rng.pareto(2.5, n)))])
def test_one_workers_update_times_add_up_its_seeded_draws_in_order(speed, draw):
    """Pins the random draws: one draw from default_rng(seed) per step, in
    order, so a seed gives the same schedule as before Pareto speeds came."""
    sched = simulate.schedule(1, 50, speed=speed, sigma=0.3, alpha=2.5, seed=7)
    np.testing.assert_allclose(sched.times, np.cumsum(draw(np.random.default_rng(7), 50)),
                               rtol=1e-12)


@pytest.mark.parametrize("alpha", [1.5, 2.5, 4.0])
def test_pareto_step_times_have_mean_one_and_a_power_law_tail(alpha):
    """Pareto with minimum (alpha - 1) / alpha: the survival function is
    (x_m / t) ** alpha, each point within 4 standard errors."""
    n = 40_000
    steps = np.diff(simulate.schedule(1, n, speed="pareto", alpha=alpha, seed=1).times,
                    prepend=0.0)
    x_m = (alpha - 1) / alpha
    assert steps.min() >= x_m
    for t in (0.8, 1.5, 3.0):
        p = (x_m / t) ** alpha
        assert abs(np.mean(steps > t) - p) < 4 * np.sqrt(p * (1 - p) / n), t
    if alpha > 2:  # a finite variance: the mean settles
        sd = x_m * np.sqrt(alpha / (alpha - 2)) / (alpha - 1)
        assert abs(steps.mean() - 1.0) < 4 * sd / np.sqrt(n)


def test_a_pareto_straggler_lands_a_share_set_by_its_factor():
    sched = simulate.schedule(4, 4000, speed="pareto", stragglers={0: 4.0}, seed=2)
    counts = np.bincount(sched.workers, minlength=4)
    assert counts[0] == pytest.approx(counts[1:].mean() / 4, rel=0.15)


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=0, updates=5), "`workers` must be an integer >= 1. Received: workers=0"),
    (dict(workers=2, updates=5, speed="fast"),
     r"`speed` must be one of \('constant', 'lognormal', 'pareto'\). Received: speed='fast'"),
    (dict(workers=2, updates=5, speed="pareto", alpha=1.0),
     r"`alpha` must be a float > 1 .*Received: alpha=1.0"),
    (dict(workers=2, updates=5, alpha=True), "Received: alpha=True"),
    (dict(workers=2, updates=5, sigma=-0.1), r"`sigma` must be a float >= 0. Received: sigma=-0.1"),
    (dict(workers=2, updates=5, stragglers={3: 2.0}), "`stragglers` maps a worker index"),
    (dict(workers=2, updates=5, outages={0: (5, 1)}), "`outages` maps a worker index"),
    (dict(workers=2, updates=5, gap=-1.0), r"`gap` is a time >= 0.*Received: gap=-1.0"),
    (dict(workers=2, updates=5, gap={2: 1.0}), r"Received: gap=\{2: 1.0\}"),
    (dict(workers=2, updates=5, gap="long"), "`gap` is a time >= 0"),
    (dict(workers=2, updates=5, concurrency=0),
     "`concurrency` must be an integer >= 1. Received: concurrency=0"),
])
def test_bad_schedule_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate.schedule(**kwargs)


def _digits_functional(optimizer, seed=0):
    """The digits MLP with 32 hidden units, as a functional keras.Model."""
    return digits_model(optimizer, hidden=32, cls=keras.Model, seed=seed)


@pytest.fixture(scope="module")
def digits():
    from keras_dist.datasets import load_digits

    return load_digits()


def test_one_simulated_worker_is_plain_sgd(digits):
    (x, y), _ = digits
    simulated = _digits_functional(keras.optimizers.SGD(0.1))
    history, sched = simulate.fit(simulated, x, y, workers=1, epochs=1, seed=3)
    assert set(sched.staleness) == {0}
    # The same batches in the same order, applied by Keras itself.
    plain = _digits_functional(keras.optimizers.SGD(0.1))
    order = np.random.default_rng(3).permutation(len(x))
    for step in range(len(x) // 32):
        idx = order[step * 32:(step + 1) * 32]
        plain.train_on_batch(x[idx], y[idx])
    for a, b in zip(simulated.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_plain_async_degrades_with_workers_and_wrappers_hold_up(digits):
    """The trend DC-ASGD and Chen et al. report, as a direction over seeds."""
    (x, y), (x_test, y_test) = digits

    def accuracy(optimizer, workers, seed):
        model = _digits_functional(optimizer, seed)
        simulate.fit(model, x, y, workers=workers, epochs=4, seed=seed)
        return model.evaluate(x_test, y_test, return_dict=True, verbose=0)["accuracy"]

    seeds = [0, 1]
    plain = {n: np.mean([accuracy(keras.optimizers.SGD(0.1), n, s) for s in seeds])
             for n in (2, 32)}
    gap = np.mean([accuracy(kd.optimizers.GapAware(keras.optimizers.SGD(0.1)), 32, s)
                   for s in seeds])
    assert plain[32] < plain[2] - 0.1  # async degrades as workers grow
    assert gap > plain[32] + 0.1       # the wrapper holds up


def test_simulated_fit_trains_models_with_dropout_and_batch_norm(digits):
    (x, y), (x_test, y_test) = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.1),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(kd.optimizers.DynSGD(keras.optimizers.SGD(0.05)),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    moving_mean = model.layers[1].moving_mean.numpy().copy()
    history, _ = simulate.fit(model, x, y, workers=4, epochs=3)
    assert history["loss"][-1] < history["loss"][0]
    assert not np.allclose(model.layers[1].moving_mean.numpy(), moving_mean)
    assert model.evaluate(x_test, y_test, return_dict=True, verbose=0)["accuracy"] > 0.6


def test_simulated_fit_under_mixed_float16_matches_float32(digits):
    """Keras wraps the optimizer in a LossScaleOptimizer under mixed_float16;
    the simulator scales the loss so that it unscales correctly."""
    (x, y), (x_test, y_test) = digits

    def accuracy(policy):
        keras.config.set_dtype_policy(policy)
        try:
            model = _digits_functional(kd.optimizers.GapAware(keras.optimizers.SGD(0.1)))
            wrapped = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            simulate.fit(model, x, y, workers=4, epochs=3)
            return wrapped, model.evaluate(x_test, y_test, return_dict=True,
                                           verbose=0)["accuracy"]
        finally:
            keras.config.set_dtype_policy("float32")

    wrapped, mixed = accuracy("mixed_float16")
    _, full = accuracy("float32")
    assert wrapped
    assert mixed == pytest.approx(full, abs=0.03)


def _digits_mlp(optimizer):
    return digits_model(optimizer, hidden=16, metrics=None, seed=0)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.SGD(0.1),
                                  lambda: keras.optimizers.Adam(0.01)],
                         ids=["sgd", "adam"])
def test_one_worker_with_local_steps_is_sequential_training(make):
    """One worker pushing rounds of k=4 steps takes the same steps on the
    same batches as plain sequential training (one float rounding apart)."""
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    local, plain = _digits_mlp(make()), _digits_mlp(make())
    _, sched = simulate.fit(local, x[:512], y[:512], workers=1, local_steps=4, seed=3)
    simulate.fit(plain, x[:512], y[:512], workers=1, seed=3)
    assert len(sched.staleness) == 512 // 32 // 4  # the schedule counts pushes
    for a, b in zip(local.weights, plain.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    assert int(local.optimizer.iterations.numpy()) == 512 // 32


def test_local_steps_with_an_outer_optimizer_move_less_per_push():
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    full, half = _digits_mlp(keras.optimizers.SGD(0.1)), _digits_mlp(keras.optimizers.SGD(0.1))
    start = [w.numpy() for w in full.trainable_weights]
    simulate.fit(full, x[:256], y[:256], workers=1, local_steps=8, seed=1)
    simulate.fit(half, x[:256], y[:256], workers=1, local_steps=8, seed=1,
                 outer_optimizer=keras.optimizers.SGD(0.5))
    # One push (8 steps), outer SGD(0.5): half of the plain change.
    for w0, a, b in zip(start, full.trainable_weights, half.trainable_weights):
        np.testing.assert_allclose(b.numpy() - w0, 0.5 * (a.numpy() - w0), atol=1e-6)


def test_local_steps_must_be_a_positive_integer_in_the_simulator():
    model = _digits_mlp(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="local_steps.*integer >= 1.*0"):
        simulate.fit(model, np.zeros((64, 64), "float32"), np.zeros(64), workers=2,
                     local_steps=0)


@pytest.mark.parametrize("workers, alpha", [(1, 0.5), (3, 0.3)])
def test_simulated_easgd_is_the_elastic_exchange_exactly(workers, alpha):
    """EASGD in the simulator against a NumPy replay of the same schedule, on
    a linear model whose loss, mean(x @ w), has gradient mean(x) whatever w:
    each round starts from the worker's own copy, and its push moves the copy
    and the centre (as the worker read it) alpha of the way to each other."""
    k, batch, lr = 2, 8, 0.1
    x = np.abs(np.random.default_rng(0).normal(size=(96, 3))).astype("float32")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, use_bias=False)(inputs))
    model.compile(keras.optimizers.SGD(lr), lambda y_true, y_pred: keras.ops.mean(y_pred))
    w0 = model.weights[0].numpy()[:, 0].astype(np.float64)
    _, sched = simulate.fit(model, x, np.zeros((96, 1), "float32"), workers=workers, epochs=2,
                            batch_size=batch, local_steps=k, elastic=alpha, seed=4)
    centres, copies = [w0], {w: w0 for w in range(workers)}
    rng, u = np.random.default_rng(4), 0
    for _ in range(2):
        order = rng.permutation(96)
        for i in range(96 // (k * batch)):
            idx = order[i * k * batch:(i + 1) * k * batch].reshape(k, batch)
            w = int(sched.workers[u])
            local = copies[w] - lr * sum(x[b].mean(axis=0) for b in idx)
            move = alpha * (local - centres[u - int(sched.staleness[u])])
            copies[w] = local - move
            centres.append(centres[-1] + move)
            u += 1
    np.testing.assert_allclose(model.weights[0].numpy()[:, 0], centres[-1], atol=1e-5)
    assert np.abs(centres[-1] - w0).max() > 0.05


@pytest.mark.parametrize("kwargs, message", [
    (dict(elastic=0.0), r"`elastic` must be a float in \(0, 1\].*Received: elastic=0.0"),
    (dict(elastic=True), "Received: elastic=True"),
    (dict(elastic=0.5, outer_optimizer=keras.optimizers.SGD(1.0)),
     "`elastic` and `outer_optimizer` are two ways to push a round"),
])
def test_bad_elastic_in_the_simulator(kwargs, message):
    model = _digits_mlp(keras.optimizers.SGD(0.1))
    x, y = np.zeros((64, 64), "float32"), np.zeros((64,), "int64")
    with pytest.raises(ValueError, match=message):
        simulate.fit(model, x, y, workers=2, local_steps=2, **kwargs)


# ------------------------------------------- synchronous SGD with backup workers
@pytest.mark.parametrize("workers, backup, kwargs", [
    (4, 0, dict(speed="pareto")), (8, 2, dict(speed="pareto", alpha=1.7)),
    (5, 3, dict(sigma=0.5, stragglers={6: 3.0}))])
def test_sync_steps_wait_for_the_nth_fastest_and_drop_the_slowest(workers, backup, kwargs):
    """Every step draws N + b step times (worker order, one seeded stream, as
    `schedule`); it lasts the N-th smallest and drops the b largest."""
    sched = simulate.sync_schedule(workers, 50, backup=backup, seed=4, **kwargs)
    rng, total = np.random.default_rng(4), workers + backup
    factor = np.array([kwargs.get("stragglers", {}).get(w, 1.0) for w in range(total)])
    now = 0.0
    for u in range(50):
        if kwargs.get("speed") == "pareto":
            alpha = kwargs.get("alpha", 2.5)
            draws = (alpha - 1) / alpha * (1.0 + np.array([rng.pareto(alpha) for _ in factor]))
        else:
            draws = np.array([rng.lognormal(0.0, kwargs["sigma"]) for _ in factor])
        steps = draws * factor
        now += np.sort(steps)[workers - 1]
        assert sched.times[u] == pytest.approx(now, rel=1e-12)
        assert sorted(sched.dropped[u].tolist()) == sorted(np.argsort(steps)[workers:].tolist())
    assert sched.dropped.shape == (50, backup)


def test_backup_workers_cut_the_simulated_time_of_heavy_tailed_steps():
    """64 workers: waiting for the slowest of 64 Pareto(2.5) draws costs
    about 4.7 units a step; the 64th of 67 about 2. Constant steps: no gain."""
    plain = simulate.sync_schedule(64, 300, speed="pareto", seed=1)
    backed = simulate.sync_schedule(64, 300, backup=3, speed="pareto", seed=1)
    assert plain.step_times.mean() == pytest.approx(4.7, rel=0.15)
    assert backed.step_times.mean() == pytest.approx(2.0, rel=0.1)
    assert backed.times[-1] < 0.5 * plain.times[-1]
    lognormal = simulate.sync_schedule(64, 300, backup=3, sigma=0.2, seed=1)
    assert lognormal.step_times.mean() < backed.step_times.mean()  # a light tail gains less
    even = [simulate.sync_schedule(64, 10, backup=b, speed="constant").times for b in (0, 3)]
    np.testing.assert_array_equal(even[0], even[1])


def test_sync_fit_without_backups_is_one_step_on_the_concatenated_batches(digits):
    """backup=0: the mean of N batch gradients is the gradient of their
    concatenation (a mean loss); the rate ramps from lr to N lr over the
    first 10% of the updates (the staleness benchmark's `_sync_fit`)."""
    (x, y), _ = digits
    x, y = x[:1024], y[:1024]
    workers, epochs, lr = 4, 3, 0.05
    simulated, plain = _digits_mlp(keras.optimizers.SGD(lr)), _digits_mlp(keras.optimizers.SGD(lr))
    start = [w.numpy() for w in simulated.trainable_weights]
    history, sched = simulate.sync_fit(simulated, x, y, workers=workers, epochs=epochs, seed=3)
    rng, batches = np.random.default_rng(3), []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        batches += [order[i * 32:(i + 1) * 32] for i in range(len(x) // 32)]
    updates = len(batches) // workers
    warmup = max(1, updates // 10)
    for u in range(updates):
        scale = workers if u >= warmup else 1 + (workers - 1) * u / warmup
        plain.optimizer.learning_rate = lr * scale
        idx = np.concatenate(batches[u * workers:(u + 1) * workers])
        plain.train_on_batch(x[idx], y[idx])
    assert len(sched.times) == updates == 24 and warmup == 2
    for a, b, w0 in zip(simulated.trainable_weights, plain.trainable_weights, start):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
        assert np.abs(a.numpy() - w0).max() > 0.01
    assert float(simulated.optimizer.learning_rate) == pytest.approx(lr)  # set back
    assert len(history["loss"]) == epochs and history["loss"][-1] < history["loss"][0]


@pytest.mark.parametrize("workers, backup, kwargs", [
    (3, 1, dict(stragglers={1: 100.0}, lr_scaling="linear", warmup=0.0)),
    (4, 2, dict(speed="pareto", lr_scaling="sqrt", warmup=0.25))])
def test_sync_fit_applies_the_mean_of_the_n_fastest_gradients(workers, backup, kwargs):
    """A NumPy replay: each update takes the stream's next N + b batches
    (worker w the w-th), and applies rate x the mean gradient of the
    workers not dropped. With a 100x straggler, it is always worker 1."""
    lr, batch, epochs, n = 0.01, 8, 3, 96
    x = np.abs(np.random.default_rng(0).normal(size=(n, 3))).astype("float32")
    model = mean_output_model(lr)
    w0 = model.weights[0].numpy()[:, 0].astype(np.float64)
    _, sched = simulate.sync_fit(model, x, np.zeros((n, 1), "float32"), workers=workers,
                                 backup=backup, epochs=epochs, batch_size=batch, seed=5,
                                 **kwargs)
    if "stragglers" in kwargs:
        assert set(sched.dropped.ravel().tolist()) == {1}
    else:
        assert len(set(map(tuple, sched.dropped.tolist()))) > 3  # the dropped ones vary
    total, updates = workers + backup, epochs * (n // batch) // workers
    rng, stream = np.random.default_rng(5), []
    while len(stream) < updates * total:
        order = rng.permutation(n)
        stream += [order[i * batch:(i + 1) * batch] for i in range(n // batch)]
    top = workers if kwargs["lr_scaling"] == "linear" else np.sqrt(workers)
    ramp = max(1, int(kwargs["warmup"] * updates)) if kwargs["warmup"] else 0
    w = w0.copy()
    for u in range(updates):
        rate = lr * (top if u >= ramp else 1 + (top - 1) * u / ramp)
        kept = [k for k in range(total) if k not in sched.dropped[u]]
        w -= rate * np.mean([x[stream[u * total + k]].mean(axis=0) for k in kept], axis=0)
    np.testing.assert_allclose(model.weights[0].numpy()[:, 0], w, atol=1e-5)
    assert np.abs(w - w0).max() > 0.05


def test_sync_fit_counts_examples_by_the_applied_batches():
    """Backups read more batches, not more updates; epochs end where their
    passes' worth of applied batches does, also when one update spans
    several epochs."""
    x, y = np.ones((96, 3), "float32"), np.zeros((96, 1), "float32")
    runs = {b: simulate.sync_fit(mean_output_model(0.01), x, y, workers=4, backup=b, epochs=3,
                                 batch_size=8, seed=2, speed="pareto") for b in (0, 2)}
    (_, plain), (history, backed) = runs[0], runs[2]
    assert len(plain.times) == len(backed.times) == 3 * 12 // 4
    assert plain.batches_applied == backed.batches_applied == 36
    assert (plain.batches_consumed, backed.batches_consumed) == (36, 54)
    assert backed.epoch_ends.tolist() == [3, 6, 9] and len(history["loss"]) == 3
    np.testing.assert_array_equal(simulate.epoch_times(backed, 3), backed.times[[2, 5, 8]])
    # 16 batches per update, 12 per epoch: updates end in epochs 2 and 3 only.
    history, wide = simulate.sync_fit(mean_output_model(0.01), x, y, workers=16, epochs=3,
                                      batch_size=8, validation_data=(x, y))
    assert wide.epoch_ends.tolist() == [0, 1, 2]
    assert np.isnan(history["loss"][0]) and not np.isnan(history["loss"][1])
    assert simulate.epoch_times(wide, 3).tolist() == [0.0, wide.times[0], wide.times[1]]
    assert len(history["val_loss"]) == 3 and history["val_loss"][1] != history["val_loss"][0]


def test_epoch_times_of_an_asynchronous_run_are_its_last_updates_times():
    model = mean_output_model(0.01)
    x, y = np.ones((96, 3), "float32"), np.zeros((96, 1), "float32")
    history, sched = simulate.fit(model, x, y, workers=4, epochs=3, batch_size=8, seed=1)
    times = simulate.epoch_times(sched, 3)
    np.testing.assert_array_equal(times, sched.times[[11, 23, 35]])
    assert len(times) == len(history["loss"]) and np.all(np.diff(times) > 0)
    assert sched.epoch_ends.tolist() == [12, 24, 36]
    with pytest.raises(ValueError, match=r"This Schedule has 3 epochs \(fit set them\). "
                                         "Received: epochs=5"):
        simulate.epoch_times(sched, 5)
    bare = simulate.schedule(4, 36, seed=1)  # no epochs: equal ones, if they split
    np.testing.assert_array_equal(simulate.epoch_times(bare, 3), times)
    with pytest.raises(ValueError, match="36 updates do not split into equal epochs. "
                                         "Received: epochs=5"):
        simulate.epoch_times(bare, 5)
    with pytest.raises(ValueError, match="This SyncSchedule has no epochs"):
        simulate.epoch_times(simulate.sync_schedule(2, 4), 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(backup=-1), "`backup` must be an integer >= 0. Received: backup=-1"),
    (dict(lr_scaling="cubic"), r"`lr_scaling` must be one of .*Received: lr_scaling='cubic'"),
    (dict(warmup=1.5), r"`warmup` must be a fraction .*Received: warmup=1.5"),
    (dict(workers=8), r"One update takes workers=8 batches; 1 epoch\(s\) of 64 samples"),
    (dict(stragglers={3: 2.0}), r"`stragglers` maps a worker index in \[0, 3\)"),
    (dict(speed="pareto", alpha=0.5), "Received: alpha=0.5"),
])
def test_bad_sync_fit_arguments(kwargs, message):
    model = mean_output_model(0.01)
    x, y = np.ones((64, 3), "float32"), np.zeros((64, 1), "float32")
    kwargs = {"workers": 2, "backup": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate.sync_fit(model, x, y, **kwargs)


def test_sync_fit_will_not_overwrite_a_learning_rate_schedule():
    keras.utils.set_random_seed(1)
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model = _digits_mlp(keras.optimizers.SGD(decay))
    x, y = np.zeros((64, 64), "float32"), np.zeros((64,), "int64")
    with pytest.raises(ValueError, match="Use a float learning rate, or lr_scaling=\"none\""):
        simulate.sync_fit(model, x, y, workers=2)
    simulate.sync_fit(model, x, y, workers=2, lr_scaling="none", warmup=0)  # kept as it is


def test_simulated_fits_honour_keras_max_epochs_with_keras_warning():
    """`keras.config.set_max_epochs` (`KERAS_MAX_EPOCHS`) caps Keras' own fit
    and kd.fit; the simulated fits too, with the same warning."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
    keras.config.set_max_epochs(2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history, sched = simulate.fit(model, x, y, workers=2, epochs=5)
            sync_history, _ = simulate.sync_fit(model, x, y, workers=2, epochs=5)
            under, _ = simulate.fit(model, x, y, workers=2, epochs=1)
    finally:
        keras.config.set_max_epochs(None)
    assert len(history["loss"]) == 2 and len(sched.staleness) == 2 * 64 // 32
    assert len(sync_history["loss"]) == 2 and len(under["loss"]) == 1
    assert [str(w.message) for w in caught if "Limiting" in str(w.message)] == [
        "Limiting epochs to 2"] * 2
    assert len(simulate.fit(model, x, y, workers=2, epochs=3)[0]["loss"]) == 3
