"""Staleness-aware optimizer wrappers, checked against NumPy.

Each rule is re-implemented below in NumPy from its formula (ALGORITHMS.md /
the papers), independently of the library code, and both are run for several
steps with chosen staleness, current and pulled weights.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.training.update import UpdateInfo
from keras_dist.optimizers import (DCASGD, DelayAdaptive, DynSGD, GapAware, Ringmaster,
                                   StalenessLimit, StalenessScaled)
from procs import digits_model

LR = 0.1
SHAPES = [(3, 2), (2,)]


def make_state(seed=0):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype("float32") for s in SHAPES]
    steps = []
    for t in range(5):
        grads = [rng.normal(size=s).astype("float32") for s in SHAPES]
        drift = [0.05 * rng.normal(size=s).astype("float32") for s in SHAPES]
        steps.append((grads, drift, [0, 3, 1, 7, 2][t]))
    return weights, steps


def run_wrapper(optimizer, weights, steps):
    """Applies the steps through `optimizer`; pulled = current - drift."""
    variables = [keras.Variable(w) for w in weights]
    for grads, drift, tau in steps:
        pulled = [v.numpy() - d for v, d in zip(variables, drift)]
        info = UpdateInfo(staleness=tau,
                          pulled=[keras.ops.convert_to_tensor(p) for p in pulled])
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], variables,
                        update=info)
    return [v.numpy() for v in variables]


def numpy_sgd(rule, weights, steps, **state):
    w = [x.astype("float64").copy() for x in weights]
    for grads, drift, tau in steps:
        pulled = [x - d for x, d in zip(w, drift)]
        new = rule([g.astype("float64") for g in grads], w, pulled, tau, state)
        if new is None:
            continue  # dropped
        w = [x - LR * g for x, g in zip(w, new)]
    return w


def dynsgd(grads, w, pulled, tau, state):
    return [g / (tau + 1) for g in grads]


def staleness_scaled(grads, w, pulled, tau, state):
    return [g / max(tau, 1) for g in grads]


def limit(max_tau):
    def rule(grads, w, pulled, tau, state):
        return None if tau > max_tau else grads
    return rule


def delay_adaptive(workers):
    def rule(grads, w, pulled, tau, state):
        return [g * workers / max(workers, tau) for g in grads]
    return rule


def ringmaster(threshold):
    """Ignores tau >= R; R = max(1, floor(sqrt(k))) at the k-th update (from 1)
    when adaptive."""
    def rule(grads, w, pulled, tau, state):
        state["k"] = state.get("k", 0) + 1
        limit = max(1, int(np.floor(np.sqrt(state["k"])))) if threshold == "adaptive" else (
            threshold)
        return None if tau >= limit else grads
    return rule


def dc_constant(lam):
    def rule(grads, w, pulled, tau, state):
        return [g + lam * g * g * (wn - wp) for g, wn, wp in zip(grads, w, pulled)]
    return rule


def dc_adaptive(lam0, m, eps):
    def rule(grads, w, pulled, tau, state):
        ms = state.setdefault("ms", [np.zeros_like(g) for g in grads])
        out = []
        for i, (g, wn, wp) in enumerate(zip(grads, w, pulled)):
            ms[i] = m * ms[i] + (1 - m) * g * g
            out.append(g + lam0 / np.sqrt(ms[i] + eps) * g * g * (wn - wp))
        return out
    return rule


def gap_aware(beta, eps):
    def rule(grads, w, pulled, tau, state):
        v = state.setdefault("v", [np.zeros_like(g) for g in grads])
        state["t"] = state.get("t", 0) + 1
        eta_max = state["eta_max"] = max(state.get("eta_max", 0.0), LR)
        out = []
        for i, (g, wn, wp) in enumerate(zip(grads, w, pulled)):
            v[i] = beta * v[i] + (1 - beta) * g * g
            v_hat = v[i] / (1 - beta ** state["t"])
            penalty = 1 + np.abs(wn - wp) / (eta_max * (np.sqrt(v_hat) + eps))
            out.append(g / penalty)
        return out
    return rule


def gap_penalty_on_momentum(beta, eps, gamma):
    """Gap-Aware's penalty G with the typical step measured on the momentum
    buffer u <- gamma u + g (instead of g): v averages u * u."""
    def penalty(grads, w, pulled, state):
        u = state.setdefault("u", [np.zeros_like(g) for g in grads])
        v = state.setdefault("v", [np.zeros_like(g) for g in grads])
        state["t"] = state.get("t", 0) + 1
        out = []
        for i, (g, wn, wp) in enumerate(zip(grads, w, pulled)):
            u[i] = gamma * u[i] + g
            v[i] = beta * v[i] + (1 - beta) * u[i] * u[i]
            v_hat = v[i] / (1 - beta ** state["t"])
            out.append(1 + np.abs(wn - wp) / (LR * (np.sqrt(v_hat) + eps)))
        return out
    return penalty


def momentum_sgd(gamma, penalty_rule, weight_decay=0.0, scale_decay=False):
    """Keras' SGD with momentum (m <- gamma m - lr g; w <- w + m) and decoupled
    weight decay (w <- w - lr wd w first), given g / G; G also divides the
    decay when `scale_decay`."""
    def run(weights, steps):
        w = [x.astype("float64").copy() for x in weights]
        m = [np.zeros_like(x) for x in w]
        state = {}
        for grads, drift, tau in steps:
            pulled = [x - d for x, d in zip(w, drift)]
            grads = [g.astype("float64") for g in grads]
            penalty = penalty_rule(grads, w, pulled, state)
            w = [x - LR * weight_decay * x / (p if scale_decay else 1.0)
                 for x, p in zip(w, penalty)]
            for i, (g, p) in enumerate(zip(grads, penalty)):
                m[i] = gamma * m[i] - LR * g / p
                w[i] = w[i] + m[i]
        return w
    return run


@pytest.mark.compat("wrappers")
@pytest.mark.parametrize("weight_decay, scale_decay", [(0.0, False), (0.1, False), (0.1, True)])
def test_gap_aware_on_the_momentum_buffer_matches_numpy(weight_decay, scale_decay):
    weights, steps = make_state()
    gamma = 0.9
    optimizer = GapAware(keras.optimizers.SGD(LR, momentum=gamma, weight_decay=weight_decay or None),
                         beta=0.9, measure="momentum", scale_weight_decay=scale_decay)
    assert optimizer.momentum == gamma  # taken from the inner SGD
    got = run_wrapper(optimizer, weights, steps)

    expected = momentum_sgd(gamma, gap_penalty_on_momentum(0.9, 1e-8, gamma), weight_decay,
                            scale_decay)(weights, steps)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # Measured on gradients instead, the result differs; so does unscaled decay.
    other = run_wrapper(GapAware(keras.optimizers.SGD(LR, momentum=gamma,
                                                      weight_decay=weight_decay or None),
                                 beta=0.9, scale_weight_decay=not scale_decay),
                        weights, steps)
    assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(got, other))


@pytest.mark.compat("wrappers")
@pytest.mark.parametrize("make, rule", [
    (lambda: DynSGD(keras.optimizers.SGD(LR)), dynsgd),
    (lambda: StalenessScaled(keras.optimizers.SGD(LR)), staleness_scaled),
    (lambda: StalenessLimit(keras.optimizers.SGD(LR), max_staleness=2), limit(2)),
    (lambda: DCASGD(keras.optimizers.SGD(LR), lambda_=0.5), dc_constant(0.5)),
    (lambda: DCASGD(keras.optimizers.SGD(LR), mode="adaptive"), dc_adaptive(2.0, 0.95, 1e-7)),
    (lambda: GapAware(keras.optimizers.SGD(LR), beta=0.9), gap_aware(0.9, 1e-8)),
    (lambda: DelayAdaptive(keras.optimizers.SGD(LR), workers=2), delay_adaptive(2)),
    (lambda: Ringmaster(keras.optimizers.SGD(LR), threshold=3), ringmaster(3)),
], ids=["dynsgd", "staleness_scaled", "limit", "dcasgd_constant", "dcasgd_adaptive",
        "gap_aware", "delay_adaptive", "ringmaster"])
def test_rule_matches_numpy(make, rule):
    weights, steps = make_state()
    got = run_wrapper(make(), weights, steps)
    expected = numpy_sgd(rule, weights, steps)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # And the rule did something: plain SGD ends elsewhere (except where no
    # correction applies by construction).
    plain = numpy_sgd(lambda grads, *a: grads, weights, steps)
    assert any(not np.allclose(g, p, atol=1e-6) for g, p in zip(got, plain))


def test_adaptive_ringmaster_matches_numpy_and_counts_its_updates():
    """R_k = max(1, floor(sqrt(k))): over 12 updates of tau 1, the first
    three (R = 1) are ignored and the rest (R >= 2) applied."""
    rng = np.random.default_rng(5)
    weights = [rng.normal(size=s).astype("float32") for s in SHAPES]
    steps = [([rng.normal(size=s).astype("float32") for s in SHAPES],
              [np.zeros(s, "float32") for s in SHAPES], tau)
             for tau in [1] * 12 + [3, 4, 2]]
    opt = Ringmaster(keras.optimizers.SGD(LR), threshold="adaptive")
    got = run_wrapper(opt, weights, steps)
    for g, e in zip(got, numpy_sgd(ringmaster("adaptive"), weights, steps)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # k = 13, 14, 15: R = 3; taus 3 and 4 ignored, 2 applied.
    assert opt.staleness_logs()["dropped_updates"] == 3 + 2
    assert int(opt.updates_seen.numpy()) == 15
    assert int(opt.iterations.numpy()) == 15 - 5  # the inner SGD saw the applied ones


def test_limit_counts_dropped_updates():
    weights, steps = make_state()
    opt = StalenessLimit(keras.optimizers.SGD(LR), max_staleness=2)
    run_wrapper(opt, weights, steps)
    assert opt.staleness_logs()["dropped_updates"] == 2  # taus 3 and 7


def test_composition_limit_then_dynsgd_matches_numpy():
    weights, steps = make_state(1)
    opt = StalenessLimit(DynSGD(keras.optimizers.SGD(LR)), max_staleness=2)
    got = run_wrapper(opt, weights, steps)

    def rule(grads, w, pulled, tau, state):
        return None if tau > 2 else [g / (tau + 1) for g in grads]

    for g, e in zip(got, numpy_sgd(rule, weights, steps)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


INNERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
WRAPPERS = {
    "dynsgd": DynSGD, "staleness_scaled": StalenessScaled, "dcasgd": DCASGD,
    "dcasgd_adaptive": lambda inner, **kw: DCASGD(inner, mode="adaptive", **kw),
    "gap_aware": GapAware,
    "limit": lambda inner, **kw: StalenessLimit(inner, max_staleness=0, **kw),
    "delay_adaptive": lambda inner, **kw: DelayAdaptive(inner, workers=2, **kw),
    "ringmaster": lambda inner, **kw: Ringmaster(inner, threshold=1, **kw),
    "ringmaster_adaptive": lambda inner, **kw: Ringmaster(inner, threshold="adaptive", **kw),
}


@pytest.mark.compat("wrappers")
@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_zero_staleness_is_exactly_the_inner_optimizer(wrapper, inner):
    rng = np.random.default_rng(3)
    weights = [rng.normal(size=s).astype("float32") for s in SHAPES]
    wrapped = WRAPPERS[wrapper](INNERS[inner]())
    bare = INNERS[inner]()
    a = [keras.Variable(w) for w in weights]
    b = [keras.Variable(w) for w in weights]
    for _ in range(4):
        grads = [keras.ops.convert_to_tensor(rng.normal(size=s).astype("float32"))
                 for s in SHAPES]
        wrapped.apply(grads, a, update=UpdateInfo(
            0, [keras.ops.convert_to_tensor(v.numpy()) for v in a]))
        bare.apply(grads, b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_config_round_trip(wrapper):
    original = WRAPPERS[wrapper](keras.optimizers.Adam(0.003))
    config = keras.saving.serialize_keras_object(original)
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is type(original)
    assert restored.get_config() == original.get_config()
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert float(restored.learning_rate) == pytest.approx(0.003)


def test_plain_fit_warns_once_and_trains_like_the_inner_optimizer():
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    wrapped = digits_model(DynSGD(keras.optimizers.SGD(0.05)), hidden=32, cls=kd.AsyncModel,
                           seed=0)
    bare = digits_model(keras.optimizers.SGD(0.05), hidden=32, cls=kd.AsyncModel, seed=0)
    with pytest.warns(UserWarning, match="staleness of this update is unknown") as record:
        h_wrapped = wrapped.fit(x, y, epochs=2, batch_size=64, shuffle=False, verbose=0)
    assert len([w for w in record if "staleness" in str(w.message)]) == 1
    h_bare = bare.fit(x, y, epochs=2, batch_size=64, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_wrapped.history["loss"], h_bare.history["loss"], rtol=1e-6)


@pytest.mark.compat("wrappers")
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_keras_save_load_then_training_continues(tmp_path, wrapper):
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    model = digits_model(WRAPPERS[wrapper](keras.optimizers.SGD(0.05)), hidden=32,
                         cls=kd.AsyncModel)
    with pytest.warns(UserWarning):
        model.fit(x[:256], y[:256], epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    before = loaded.evaluate(x, y, verbose=0)[0]
    with pytest.warns(UserWarning):
        loaded.fit(x, y, epochs=2, verbose=0)
    assert loaded.evaluate(x, y, verbose=0)[0] < before


@pytest.mark.parametrize("make, error, message", [
    (lambda: DynSGD("sgd"), TypeError, "wraps a Keras optimizer.*Received: inner_optimizer='sgd'"),
    (lambda: DCASGD(keras.optimizers.SGD(), lambda_=-0.1), ValueError,
     r"`lambda_` must be >= 0. Received: lambda_=-0.1"),
    (lambda: DCASGD(keras.optimizers.SGD(), mode="fast"), ValueError, "`mode` must be one of"),
    (lambda: DCASGD(keras.optimizers.SGD(), mode="adaptive", momentum=1.0), ValueError,
     r"`momentum` must be in the range \[0, 1\)"),
    (lambda: GapAware(keras.optimizers.SGD(), beta=1.5), ValueError, "`beta` must be in"),
    (lambda: GapAware(keras.optimizers.SGD(), measure="update"), ValueError,
     r"`measure` must be one of \('gradient', 'momentum'\). Received: measure='update'"),
    (lambda: GapAware(keras.optimizers.Adam(), measure="momentum"), ValueError,
     "has no momentum. Pass momentum="),
    (lambda: GapAware(keras.optimizers.SGD(), momentum=1.2), ValueError,
     r"`momentum` must be in the range \[0, 1\) or None"),
    (lambda: StalenessLimit(keras.optimizers.SGD(), max_staleness=-1), ValueError,
     r"`max_staleness` must be an integer >= 0 .*Received: max_staleness=-1"),
    (lambda: StalenessLimit(keras.optimizers.SGD(), max_staleness=2.5), ValueError,
     "`max_staleness` must be an integer"),
    (lambda: DynSGD(StalenessScaled(keras.optimizers.SGD())), ValueError,
     "DynSGD cannot wrap StalenessScaled.*twice"),
    (lambda: GapAware(DynSGD(keras.optimizers.SGD())), ValueError, "GapAware cannot wrap DynSGD"),
    (lambda: StalenessLimit(StalenessLimit(keras.optimizers.SGD(), 2), 3), ValueError,
     "StalenessLimit cannot wrap StalenessLimit"),
    (lambda: DCASGD(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())), ValueError,
     r"wraps a LossScaleOptimizer. Wrap the other way round: LossScaleOptimizer\(DCASGD"),
    (lambda: StalenessLimit(DynSGD(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD())), 2), ValueError, "DynSGD wraps a LossScaleOptimizer"),
    (lambda: DelayAdaptive(keras.optimizers.SGD(), workers=0), ValueError,
     "`workers` must be an integer >= 1 or None. Received: workers=0"),
    (lambda: DelayAdaptive(DynSGD(keras.optimizers.SGD())), ValueError,
     "DelayAdaptive cannot wrap DynSGD"),
    (lambda: Ringmaster(keras.optimizers.SGD(), threshold=0), ValueError,
     r"`threshold` must be an integer >= 1 .*or 'adaptive'.*Received: threshold=0"),
    (lambda: Ringmaster(keras.optimizers.SGD(), threshold="sqrt"), ValueError,
     "Received: threshold='sqrt'"),
    (lambda: Ringmaster(StalenessLimit(keras.optimizers.SGD(), 2), 3), ValueError,
     "Ringmaster cannot wrap StalenessLimit"),
], ids=["not_optimizer", "negative_lambda", "mode", "momentum", "beta", "gap_measure",
        "gap_no_momentum", "gap_momentum_range", "negative_limit",
        "float_limit", "double_scaling", "gap_in_dynsgd", "double_limit", "dc_inside_lso",
        "lso_deep_inside", "delay_adaptive_workers", "delay_adaptive_in_scaling",
        "ringmaster_zero", "ringmaster_word", "ringmaster_in_limit"])
def test_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("argument", ["clipnorm", "clipvalue", "global_clipnorm", "use_ema",
                                      "weight_decay", "gradient_accumulation_steps"])
def test_base_optimizer_arguments_are_refused_not_dropped(wrapper, argument):
    """They belong to the inner optimizer, which applies the update."""
    with pytest.raises(ValueError, match=f"does not take base-optimizer arguments.*{argument}="):
        WRAPPERS[wrapper](keras.optimizers.SGD(0.1), **{argument: 1})


def test_inner_clipping_is_applied_through_a_wrapper():
    """clipnorm on the inner optimizer clips what the wrapper hands it."""
    weights = [np.zeros((3,), "float32")]
    grads = [keras.ops.convert_to_tensor(np.array([3.0, 4.0, 0.0], "float32"))]
    clipped = kd.optimizers.DynSGD(keras.optimizers.SGD(1.0, clipnorm=1.0))
    variables = [keras.Variable(w) for w in weights]
    clipped.apply(grads, variables, update=UpdateInfo(staleness=1))
    # DynSGD halves the gradient (tau=1): norm 2.5, clipped to 1.
    np.testing.assert_allclose(variables[0].numpy(), [-0.6, -0.8, 0.0], rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: GapAware(keras.optimizers.SGD(0.1)),
    lambda: DCASGD(keras.optimizers.SGD(0.1), mode="adaptive"),
    lambda: StalenessLimit(GapAware(keras.optimizers.SGD(0.1)), 8),   # handed on inside
], ids=["gap_aware", "dcasgd", "nested"])
@pytest.mark.parametrize("pulled, received", [
    (None, "pulled=None for 2 variables"),
    ([np.zeros((3, 2), "float32")], "1 pulled weights for 2 variables"),
], ids=["none", "too_few"])
def test_an_update_without_pulled_weights_is_refused(make, pulled, received):
    """DCASGD and GapAware need the weights the gradients were computed on;
    without them (a hand-made `UpdateInfo(staleness=3)`) the error says so,
    instead of `TypeError: 'NoneType' object is not iterable`."""
    opt = make()
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    grads = [keras.ops.ones(s) for s in SHAPES]
    with pytest.raises(ValueError, match=r"needs the weights its gradients were computed "
                       r"on.*UpdateInfo\(staleness=\.\.\., pulled=\[\.\.\.\]\).*Received: "
                       + received):
        opt.apply(grads, variables, update=UpdateInfo(staleness=3, pulled=pulled))
    np.testing.assert_array_equal(variables[0].numpy(), np.zeros((3, 2)))   # nothing applied


def test_explicit_update_wins_over_the_provided_one():
    from keras_dist.training.update import providing

    opt = kd.optimizers.DynSGD(keras.optimizers.SGD(1.0))
    variables = [keras.Variable(np.zeros((1,), "float32"))]
    grad = [keras.ops.convert_to_tensor(np.ones((1,), "float32"))]
    with providing(UpdateInfo(staleness=9)):
        opt.apply(grad, variables)                                 # 1 / (9 + 1)
        opt.apply(grad, variables, update=UpdateInfo(staleness=0))  # 1 / (0 + 1)
    np.testing.assert_allclose(variables[0].numpy(), [-1.1], rtol=1e-6)


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "rmsprop", "ftrl", "adadelta"])
def test_gated_writes_skip_everything_or_nothing(name):
    """Gated updates (parameter servers' non-finite skips without a
    conditional): keep=False leaves weights, slots and the step count as they
    were; keep=True is the plain update. Ftrl assigns its variable itself
    (a tf.Variable inside Keras' TF optimizer)."""
    import tensorflow as tf

    from keras_dist.training import update

    make = {"sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.1),
            "rmsprop": lambda: keras.optimizers.RMSprop(0.1),
            "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
            "adadelta": lambda: keras.optimizers.Adadelta(1.0)}[name]
    grads = [np.array([[0.5, -1.0], [2.0, 0.25]], "float32"), np.array([1.0, -2.0], "float32")]
    results = {}
    for keep in (None, True, False):
        weights = [keras.Variable(np.ones((2, 2), "float32")), keras.Variable(np.zeros(2, "float32"))]
        optimizer = make()
        optimizer.build(weights)
        assert update.gateable(optimizer)
        optimizer.apply(grads, weights)  # some state to keep
        before = [v.numpy().copy() for v in weights + optimizer.variables]
        if keep is None:
            optimizer.apply(grads, weights)
        else:
            with update.gated_writes(optimizer, tf.constant(keep)):
                optimizer.apply(grads, weights)
        results[keep] = (before, [v.numpy() for v in weights + optimizer.variables])
    before, after = results[False]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    for plain, gated in zip(results[None][1], results[True][1]):
        np.testing.assert_allclose(gated, plain, rtol=1e-6)


@pytest.mark.parametrize("workers, implicit, compensated", [
    (1, 0.0, 0.9), (2, 0.5, 0.4), (4, 0.75, 0.15), (10, 0.9, 0.0), (64, 63 / 64, 0.0)])
def test_implicit_momentum_and_what_to_set_instead(workers, implicit, compensated):
    assert kd.optimizers.implicit_momentum(workers) == pytest.approx(implicit)
    assert kd.optimizers.compensated_momentum(0.9, workers) == pytest.approx(compensated)
    assert kd.optimizers.compensated_momentum(0.9, workers, floor=-1.0) == pytest.approx(
        0.9 - implicit)


@pytest.mark.parametrize("call, message", [
    (lambda: kd.optimizers.implicit_momentum(0), "`workers` must be an integer >= 1. "
                                                  "Received: workers=0"),
    (lambda: kd.optimizers.implicit_momentum(2.0), "Received: workers=2.0"),
    (lambda: kd.optimizers.compensated_momentum(1.0, 4),
     r"`target` must be a float in \[0, 1\). Received: target=1.0"),
])
def test_implicit_momentum_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
