"""One non-finite rule for one replica and many (issue 32, item 3).

`nonfinite_updates` means the same on one device (Keras' own loop, guarded
at the optimizer: keras_dist/training/nonfinite.py) as under Mirrored over two logical
CPUs (keras_dist's loop): "skip" leaves the weights, the optimizer's slots
and `iterations` as they were and counts the update, "raise" stops with
`NonFiniteUpdateError`, and the default is "skip" everywhere. A run whose
NaN batches are skipped keeps a finite `loss` (the loss averages the
batches whose loss was finite), but Keras' `TerminateOnNaN` sees the NaN
batch and stops or raises as in Keras (issue 47).
With finite data `kd.fit` on one device still equals `model.fit` bit for
bit (tests/test_equivalence.py covers the feature cases).
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from equivalence_cases import largest_difference
from procs import CPUS
STRATEGIES = ["default", "one_device", "mirrored"]


def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def data(poison=(5, 40)):
    """64 rows, batches of 16: rows 5 and 40 are NaN (batches 0 and 2)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, size=64).astype("int32")
    for row in poison:
        x[row, 0] = np.nan
    return x, y


def clean_steps(x, y, steps_to_drop, epochs):
    """Keras' own `model.fit` over the same batches less the poisoned ones:
    what skipping them must give (weights and `iterations`)."""
    model = build()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
    for _ in range(epochs):
        for index, (bx, by) in enumerate(batches):
            if index not in steps_to_drop:
                model.train_on_batch(bx, by)
    return model


@pytest.fixture(scope="module")
def mirrored():
    return kd.resolve_strategy("mirrored", devices=CPUS)


def _strategy(name, mirrored):
    return mirrored if name == "mirrored" else name


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("mode", [None, "skip"])
def test_skip_is_the_default_and_the_same_on_one_device_and_two(name, mode, mirrored):
    x, y = data()
    history = kd.fit(build, x, y, strategy=_strategy(name, mirrored), nonfinite_updates=mode,
                     epochs=2, batch_size=16, shuffle=False, verbose=0)
    model = history.model
    assert history.history["skipped_nonfinite"] == [2, 2]
    # Skipped means untouched: the weights and the step count are what
    # Keras gives on the clean batches alone.
    reference = clean_steps(x, y, {0, 2}, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert largest_difference(model.get_weights(), reference.get_weights()) <= 1e-6
    # The epochs' losses average the finite batches.
    assert len(history.history["loss"]) == 2 and not model.stop_training
    assert all(np.isfinite(history.history["loss"]))
    assert model.version == 4 and model.staleness_stats.logs()["staleness_max"] == 0


@pytest.mark.parametrize("name", STRATEGIES)
def test_raise_raises_on_one_device_and_on_two(name, mirrored):
    x, y = data()
    model = build()
    before = model.get_weights()
    with pytest.raises(kd.NonFiniteUpdateError, match="In epoch 1, an update's gradients "
                       "are not finite"):
        kd.fit(model, x, y, strategy=_strategy(name, mirrored), nonfinite_updates="raise",
               epochs=2, batch_size=16, shuffle=False, verbose=0)
    if name == "default":  # the model itself trained (not a copy in another scope)
        assert largest_difference(model.get_weights(), before) == 0  # batch 0 is poisoned


def test_one_device_loss_counts_the_finite_batches_only():
    """The epoch's loss is the mean over the two clean batches: what Keras
    reports for a fit over those batches alone."""
    x, y = data()
    history = kd.fit(build, x, y, strategy="default", epochs=1, batch_size=16, shuffle=False,
                     verbose=0)
    model = build()
    keep = np.r_[16:32, 48:64]
    # Keras' loss over the clean batches, each evaluated on the weights the
    # skipping run had when it reached it (batch 1 on the initial weights,
    # batch 3 after batch 1's update).
    first = float(model.train_on_batch(x[16:32], y[16:32])[0])
    second = float(model.test_on_batch(x[48:64], y[48:64])[0])
    assert history.history["loss"][0] == pytest.approx((first + second) / 2, rel=1e-5)
    assert np.isfinite(x[keep]).all()


def test_a_clean_run_on_one_device_is_keras_bit_for_bit():
    x, y = data(poison=())
    ours = kd.fit(build, x, y, strategy="default", epochs=2, batch_size=16, verbose=0)
    theirs = build()
    keras_history = theirs.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert largest_difference(ours.model.get_weights(), theirs.get_weights()) == 0
    assert ours.history == keras_history.history  # no skipped_nonfinite key either


def test_async_model_fit_on_one_device_follows_its_policy():
    x, y = data()
    inputs = keras.Input((8,))
    model = kd.AsyncModel(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    model.compile("sgd", "sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    assert history.history["skipped_nonfinite"] == [2]
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert model.version == 2
    model.nonfinite_updates = "raise"
    with pytest.raises(kd.NonFiniteUpdateError):
        model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)


def test_keras_own_fit_after_kd_fit_is_keras_again():
    """The guard lives only inside `kd.fit`: Keras' own `fit` afterwards
    applies a NaN update as Keras does."""
    x, y = data()
    history = kd.fit(build, x, y, strategy="default", epochs=1, batch_size=16, shuffle=False,
                     verbose=0)
    model = history.model
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    assert not all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("name", STRATEGIES)
def test_an_epoch_with_no_finite_loss_reports_nan_and_terminate_on_nan_stops(name, mirrored):
    """Every batch skipped: nothing trained, and the loss of nothing is NaN
    (Keras' mean of nothing is 0). TerminateOnNaN stops training at the
    first NaN batch, as in Keras' own fit (Keras' test_TerminateOnNaN checks
    one epoch in the History)."""
    x, y = data(poison=range(64))
    history = kd.fit(build, x, y, strategy=_strategy(name, mirrored), epochs=5, batch_size=16,
                     verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])
    assert history.history["skipped_nonfinite"] == [1]  # the first batch, then it stops
    assert all(np.isfinite(w).all() for w in history.model.get_weights())


class _Batches(keras.callbacks.Callback):
    """The (epoch, batch, loss is NaN) of every training batch end."""

    def __init__(self):
        super().__init__()
        self.seen, self.epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch, bool(np.isnan(logs["loss"]))))


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("raise_error", [True, False])
def test_terminate_on_nan_sees_a_skipped_batch_as_keras_shows_it(name, raise_error, mirrored):
    """Issue 47: under "skip" a user's TerminateOnNaN(raise_error=True) never
    raised (the NaN batch's loss was left out of the mean it reads). It
    raises at the same batch, or stops training after it, as under Keras'
    own fit on one device; the skipped update leaves the weights finite."""
    x, y = data(poison=(40,))  # batch 2 of each epoch

    def run(fit):
        batches = _Batches()
        callbacks = [batches, keras.callbacks.TerminateOnNaN(raise_error=raise_error)]
        try:
            history = fit(callbacks)
        except RuntimeError as error:
            return str(error), batches.seen, None
        return None, batches.seen, history

    keras_error, keras_seen, keras_history = run(lambda callbacks: build().fit(
        x, y, epochs=3, batch_size=16, shuffle=False, verbose=0, callbacks=callbacks))
    error, seen, history = run(lambda callbacks: kd.fit(
        build, x, y, strategy=_strategy(name, mirrored), epochs=3, batch_size=16,
        shuffle=False, verbose=0, callbacks=callbacks))
    assert (keras_error is not None) == raise_error
    assert error == keras_error and seen == keras_seen == [
        (0, 0, False), (0, 1, False), (0, 2, True)]
    if not raise_error:
        assert len(history.history["loss"]) == len(keras_history.history["loss"]) == 1
        assert all(np.isfinite(w).all() for w in history.model.get_weights())
