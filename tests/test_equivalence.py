"""`kd.fit` equals Keras' own `model.fit` on one device, feature by feature.

Under MirroredStrategy with 2 logical CPUs (here), for every case of
tests/equivalence_cases.py, and on a real 2-process MultiWorkerMirrored
cluster (`test_multiworker_equals_one_device`), for its `MWMS_CASES` (the
cases whose path there differs from Mirrored's; see there): the weights
agree within 1e-5 and every History entry within 1e-5. The two replicas
sum their gradients in another order than one device sums one batch's, so
agreement is to float32 rounding (seen: up to about 2e-7), not bit for bit.
"""

import json

import keras
import numpy as np
import pytest

import keras_dist as kd
import conformance
from equivalence_cases import (CASES, MWMS_CASES, build, fit_arguments, largest_difference,
                               reference)
from procs import CPUS, run_workers

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def strategy():
    return kd.resolve_strategy("mirrored", devices=CPUS)


def assert_equivalent(case, weights, history):
    ref_weights, ref_history = reference(case)
    assert largest_difference(ref_weights, weights) <= TOLERANCE, case
    assert sorted(history) == sorted(ref_history), case
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{case}: {key}")


@pytest.mark.compat("mirrored")
@pytest.mark.parametrize("case", sorted(CASES))
def test_mirrored_equals_one_device(strategy, case):
    x, y, kwargs = fit_arguments(case)
    history = kd.fit(lambda: build(case), x, y, strategy=strategy, **kwargs)
    assert_equivalent(case, history.model.get_weights(), history.history)


def test_the_cases_are_not_trivially_equal(strategy):
    """The suite can fail: without global clipping the replicas' update differs."""
    ref_weights, _ = reference("clipnorm")
    plain, _ = reference("sgd")
    assert largest_difference(ref_weights, plain) > 1e-2


@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # ~30 s here; a few minutes with a CPU hog on one of the 2 cores
def test_multiworker_equals_one_device(tmp_path, conformance_references):
    """Worker 0 equals Keras on one device; worker 1 equals worker 0 exactly
    (the same all-reduced update, the same metrics read over both). In the
    same run, the conformance matrix's MultiWorkerMirrored cells
    (tests/conformance.py): every model kind, on both workers, conforms to
    Keras' own fit on one device."""
    assert set(MWMS_CASES) < set(CASES)
    run_workers(tmp_path, "mwms_equivalence.py", timeout=840)
    results = []
    for index in range(2):
        with open(tmp_path / f"worker{index}.json") as f:
            results.append(json.load(f))
        assert sorted(results[index]) == sorted(MWMS_CASES)
    first, second = results
    for case, result in first.items():
        weights = [np.asarray(w) for w in result["weights"]]
        assert_equivalent(case, weights, result["history"])
        assert second[case]["history"] == result["history"], case
        assert largest_difference(weights, second[case]["weights"]) == 0, case
    for index in range(2):
        with open(tmp_path / f"worker{index}-conformance.json") as f:
            cells = json.load(f)
        problems = {kind: conformance.compare(cell, conformance_references[kind], kind,
                                              "multi_worker")
                    for kind, cell in cells.items()}
        assert problems == {kind: [] for kind in conformance.KINDS}, (index, problems)


def test_gradient_accumulation_over_replicas_is_a_clear_error(strategy):
    """Keras' own fit fails here too (its all-reduce sits inside a cond)."""
    def build_accumulating():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
        return model

    x, y = np.ones((16, 8), "float32"), np.ones((16, 2), "float32")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*not supported with 2 "
                                         "synchronous replicas.*global batch"):
        kd.fit(build_accumulating, x, y, strategy=strategy, verbose=0)


def test_gradient_accumulation_on_one_device_is_keras(strategy):
    def build_accumulating():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
        return model

    x, y = np.ones((16, 8), "float32"), np.ones((16, 2), "float32")
    ours = kd.fit(build_accumulating, x, y, strategy="default", batch_size=4, verbose=0)
    theirs = build_accumulating()
    theirs.fit(x, y, batch_size=4, verbose=0)
    assert largest_difference(ours.model.get_weights(), theirs.get_weights()) == 0


def _poisoned():
    x, y = np.random.default_rng(1).normal(size=(64, 8)).astype("float32"), np.zeros(64, "int32")
    x[5, 0] = np.nan  # in the first batch of every epoch (the first step runs eagerly)
    return x, y


def test_nonfinite_updates_are_skipped_and_counted_under_mirrored(strategy):
    x, y = _poisoned()
    history = kd.fit(lambda: build("sgd"), x, y, strategy=strategy, epochs=2, batch_size=16,
                     shuffle=False, verbose=0)
    assert history.history["skipped_nonfinite"] == [1, 1]
    assert all(np.isfinite(w).all() for w in history.model.get_weights())
    # The other updates were applied: the weights moved.
    assert largest_difference(history.model.get_weights(), build("sgd").get_weights()) > 0


def test_nonfinite_updates_can_raise_under_mirrored(strategy):
    x, y = _poisoned()
    with pytest.raises(kd.NonFiniteUpdateError, match="In epoch 1, an update's gradients "
                       "are not finite .*nonfinite_updates='skip'"):
        kd.fit(lambda: build("sgd"), x, y, strategy=strategy, epochs=1, batch_size=16,
               shuffle=False, verbose=0, nonfinite_updates="raise")


def test_a_clean_run_reports_no_skips(strategy):
    x, y, kwargs = fit_arguments("sgd")
    history = kd.fit(lambda: build("sgd"), x, y, strategy=strategy, **kwargs)
    assert "skipped_nonfinite" not in history.history
