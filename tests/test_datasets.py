"""The bundled datasets: shapes, determinism, balance, argument checks, and
that the teacher task is learnable, by an MLP better than by a linear model."""

import keras
import numpy as np
import pytest

from keras_dist.datasets import load_digits
from keras_dist.datasets import load_teacher

# ------------------------------------------------------------------ digits


def test_digits_shapes_dtypes_and_ranges():
    (x_train, y_train), (x_test, y_test) = load_digits()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0
    assert set(np.unique(y_train)) == set(range(10))


def test_digits_split_is_stratified_and_seeded():
    (_, y_train), (x_test, y_test) = load_digits()
    # Stratified: every digit is about a fifth held out (each has ~180 images).
    assert np.bincount(y_test, minlength=10).min() >= 34
    assert np.bincount(y_test, minlength=10).max() <= 38
    (_, _), (x_again, _) = load_digits()
    (_, _), (x_other, _) = load_digits(seed=1)
    assert np.array_equal(x_test, x_again)
    assert not np.array_equal(x_test, x_other)
    (x_small, _), (x_big, _) = load_digits(test_fraction=0.5)
    assert len(x_small) + len(x_big) == 1797 and abs(len(x_big) - 898) <= 1


# ------------------------------------------------------------------ teacher


def test_teacher_shapes_and_dtypes():
    (x_train, y_train), (x_test, y_test) = load_teacher()
    assert x_train.shape == (1500, 64) and x_test.shape == (1500, 64)
    assert y_train.shape == (1500,) and y_test.shape == (1500,)
    assert x_train.dtype == np.float32 and x_test.dtype == np.float32
    assert y_train.dtype == np.int32 and y_test.dtype == np.int32
    (x_train, y_train), (x_test, y_test) = load_teacher(
        features=16, classes=3, latent_dim=16, depth=3, width=8, train_size=100,
        test_size=7)
    assert x_train.shape == (100, 16) and x_test.shape == (7, 16)
    assert set(np.unique(y_train)) == {0, 1, 2}
    # Features have variance about 1 + input_noise**2.
    x = load_teacher(train_size=5000)[0][0]
    assert 0.9 < x.var(axis=0).mean() < 1.15


def test_teacher_is_the_same_bit_for_bit_for_a_seed():
    first, again = load_teacher(seed=3), load_teacher(seed=3)
    for a, b in zip(first, again):
        for array, array_again in zip(a, b):
            assert array.tobytes() == array_again.tobytes()


def test_teacher_seeds_differ():
    (x0, y0), (t0, _) = load_teacher(seed=0)
    (x1, y1), (t1, _) = load_teacher(seed=1)
    assert not np.array_equal(x0, x1) and not np.array_equal(t0, t1)
    assert np.mean(y0 == y1) < 0.5  # another teacher, other inputs


def test_teacher_train_size_leaves_the_teacher_and_test_split_alone():
    (x_small, y_small), test_small = load_teacher(train_size=200)
    (x_big, y_big), test_big = load_teacher(train_size=1000)
    assert np.array_equal(x_small, x_big[:200]) and np.array_equal(y_small, y_big[:200])
    assert all(np.array_equal(a, b) for a, b in zip(test_small, test_big))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_teacher_classes_are_balanced(seed):
    (_, y_train), (_, y_test) = load_teacher(seed=seed)
    for y in (y_train, y_test):
        share = np.bincount(y, minlength=10) / len(y)
        # 1/10 on the probe; a split of 1,500 adds a standard deviation of
        # 0.8 points per class, so 3 points is almost 4 of them.
        assert share.min() >= 0.07 and share.max() <= 0.13, share
    (_, y_train), _ = load_teacher(classes=3, seed=seed, train_size=3000)
    share = np.bincount(y_train, minlength=3) / len(y_train)
    assert share.min() >= 0.30 and share.max() <= 0.37, share


def test_teacher_warns_when_the_classes_cannot_be_balanced():
    from keras_dist import datasets

    with pytest.warns(UserWarning, match="could not balance the classes"):
        datasets._balance(np.zeros((1000, 2)))  # every example a tie: all class 0


def test_teacher_label_noise_redraws_training_labels_only():
    (x_clean, y_clean), test_clean = load_teacher()
    (x_noisy, y_noisy), test_noisy = load_teacher(label_noise=0.5)
    assert np.array_equal(x_clean, x_noisy)
    assert all(np.array_equal(a, b) for a, b in zip(test_clean, test_noisy))
    changed = np.mean(y_clean != y_noisy)
    assert 0.40 < changed < 0.50  # 0.5 redrawn, 1 in 10 of them to the same class
    assert load_teacher(label_noise=1.0)[0][1].max() <= 9


@pytest.mark.parametrize("kwargs, match", [
    ({"features": 0}, "`features` must be an integer >= 1. Received: features=0"),
    ({"features": 64.0}, "Received: features=64.0"),
    ({"features": True}, "Received: features=True"),
    ({"classes": 1}, "`classes` must be an integer >= 2. Received: classes=1"),
    ({"latent_dim": 0}, "Received: latent_dim=0"),
    ({"latent_dim": 65}, "`latent_dim` must be at most `features`.*"
                         "Received: latent_dim=65, features=64"),
    ({"depth": -1}, "`depth` must be an integer >= 0. Received: depth=-1"),
    ({"width": 0}, "Received: width=0"),
    ({"train_size": 0}, "Received: train_size=0"),
    ({"test_size": 1.5}, "Received: test_size=1.5"),
    ({"seed": -1}, "`seed` must be an integer >= 0. Received: seed=-1"),
    ({"input_noise": -0.1}, "`input_noise` must be a finite number >= 0.*"
                            "Received: input_noise=-0.1"),
    ({"input_noise": float("nan")}, "Received: input_noise=nan"),
    ({"label_noise": 1.5}, r"`label_noise` must be a probability in \[0, 1\]. "
                           "Received: label_noise=1.5"),
    ({"label_noise": "0.1"}, "Received: label_noise='0.1'"),
])
def test_teacher_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_teacher(**kwargs)


def _test_accuracy(data, hidden, epochs, learning_rate=0.1):
    """Test accuracy of a softmax model (with a 64-unit ReLU layer if `hidden`)
    trained with plain SGD, batch 32."""
    (x_train, y_train), (x_test, y_test) = data
    keras.utils.set_random_seed(0)
    layers = [keras.Input((x_train.shape[1],))]
    if hidden:
        layers.append(keras.layers.Dense(64, activation="relu"))
    layers.append(keras.layers.Dense(10, activation="softmax"))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(learning_rate), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x_train, y_train, epochs=epochs, batch_size=32, verbose=0)
    return model.evaluate(x_test, y_test, verbose=0)[1]


def test_teacher_is_learnable_and_an_mlp_beats_a_linear_model():
    data = load_teacher()
    mlp = _test_accuracy(data, hidden=True, epochs=10)
    linear = _test_accuracy(data, hidden=False, epochs=10)
    # Measured: MLP ~0.71, linear ~0.46 (80% and 52% after 40 epochs).
    assert mlp >= 0.60, (mlp, linear)
    assert linear >= 0.30, (mlp, linear)  # well above chance (0.10) too
    assert mlp - linear >= 0.15, (mlp, linear)


def test_a_linear_teacher_is_learnt_by_a_linear_model():
    # The control: with depth=0 the gap above closes, so it comes from the
    # teacher's hidden layers, and labels are a learnable function of x.
    linear = _test_accuracy(load_teacher(depth=0), hidden=False, epochs=10)
    assert linear >= 0.75, linear  # measured ~0.84
