"""Bundled datasets: real 8x8 digits, and a generated teacher-student task.

Neither downloads anything, so examples, tests and benchmarks run anywhere.

- `load_digits`: scikit-learn's 1,797 real 8x8 handwritten digits. Needs
  scikit-learn (`pip install scikit-learn`; the wheel's `examples` and
  `test` extras have it). The default dataset of the examples and tests;
  easy: a 64-64-10 MLP trained with SGD reaches 96-97% test accuracy.
- `load_teacher`: 64 Gaussian features labelled into 10 classes by a random
  deep ReLU network, generated with NumPy alone. Same shapes as the digits,
  so code written for them runs unchanged, but harder: the same MLP reaches
  about 80% in 40 epochs of SGD and a linear model about 52% (on the digits:
  97% and 96%), which leaves room to see how well a training method does.
"""

import numbers
import warnings

import numpy as np

# The teacher's output biases are balanced on this many probe examples, in
# at most this many rounds, until each class's share is 1 / classes to within
# this fraction of it; a warning comes past the second fraction (see `_balance`).
_PROBE_SIZE = 50_000
_BALANCE_ROUNDS = 300
_BALANCE_TOLERANCE = 0.01
_BALANCE_WARNING = 0.1


def load_digits(test_fraction=0.2, seed=0):
    """Loads the digits as flat float32 features in [0, 1] and int labels.

    Args:
        test_fraction: Float. Fraction held out for testing (stratified).
            Defaults to `0.2`.
        seed: Integer. Seed of the split. Defaults to `0`.

    Returns:
        `((x_train, y_train), (x_test, y_test))` with `x` of shape `(n, 64)`.

    Example:

    >>> from keras_dist.datasets import load_digits
    >>> (x_train, y_train), (x_test, y_test) = load_digits()
    >>> x_train.shape, x_test.shape
    ((1437, 64), (360, 64))
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise ImportError(
            "keras_dist.datasets.load_digits needs scikit-learn: "
            "pip install scikit-learn (the keras-dist wheel's 'examples' extra has it)"
        ) from error
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return (x_train, y_train), (x_test, y_test)


def load_teacher(features=64, classes=10, latent_dim=2, depth=2, width=64,
                 train_size=1500, test_size=1500, input_noise=0.1, label_noise=0.0,
                 seed=0):
    """Generates a teacher-student classification task: a harder digits.

    A random deep ReLU network (the teacher) labels Gaussian inputs; a model
    trained on the examples (the student) learns to imitate it. Everything
    is drawn with NumPy from `seed`, so one seed gives the same arrays, bit
    for bit, on every call.

    How an example is made:

    - **Inputs.** `z` is drawn from a standard normal in `latent_dim`
      dimensions and spread over all `features` along a random orthonormal
      basis, scaled so that a feature's variance is 1 on average; Gaussian
      noise of standard deviation `input_noise` is added to every feature.
      So `x` is Gaussian, with almost all of its variance in a random
      `latent_dim`-dimensional subspace that every feature takes part in.
    - **Teacher.** The teacher reads `x`'s coordinates in that subspace
      (`z` plus a little of the noise), passes them through `depth` hidden
      ReLU layers of `width` units (weights drawn from a normal of variance
      1 / fan-in, each unit standardized to mean 0 and variance 1 over a
      probe sample of 50,000 inputs, so that depth neither blows the
      activations up nor flattens them) and a linear output layer of
      `classes` units. The label is the argmax: a deterministic function of
      the returned float32 `x`, so a perfect student scores 100%.
    - **Balance.** The output layer's biases are set so that each class
      takes 1 / `classes` of the probe sample, to within 1% of that share
      (0.1 percentage points at 10 classes), as at the defaults; a warning
      says when a share stays more than 10% off. A split of `n` examples varies around it by
      sampling alone: a standard deviation of 0.8 points per class at
      n = 1,500 with 10 classes.
    - **Label noise.** With probability `label_noise`, a training label is
      replaced by a class drawn uniformly (possibly the same one). Test
      labels are always the teacher's.

    The teacher, the probe and each split draw from random streams of their
    own, so changing `train_size` leaves the teacher and the test split as
    they were, and the first `n` training examples are the same for every
    `train_size >= n` (likewise for `test_size`).

    Difficulty at the defaults (data seed 0; plain SGD, batch 32, 40 epochs,
    Keras defaults otherwise; the best learning rate among 0.01, 0.03, 0.1
    and 0.3; test accuracy, mean of 3 training seeds;
    `benchmarks/teacher_difficulty.py`):

    - 64-64-10 ReLU MLP (the digits model): 79.5% (lr 0.1; 77.4-81.3%).
      Its training accuracy is about as low (81-82%): 40 epochs do not
      finish the job (100 epochs reach 83-87% test accuracy), so how well a
      training method optimizes shows in its accuracy;
    - softmax regression (one `Dense(10)`): 52.1% (lr 0.03);
    - for comparison, on `load_digits`: MLP 96.9%, softmax regression 95.9%.
      Chance is 10%.

    A smaller `latent_dim` or `depth` makes the task easier, larger ones
    harder. `depth=0` makes the teacher linear, and the gap between the
    models closes to a few points (MLP 95%, softmax regression 91%; lr 0.1,
    one seed). `benchmarks/teacher_difficulty.py` measures other settings.

    Args:
        features: Integer. Input features. Defaults to `64`, as
            `load_digits`.
        classes: Integer, at least 2. Number of classes. Defaults to `10`.
        latent_dim: Integer, from 1 to `features`. Dimension of the
            subspace the teacher reads. Defaults to `2`.
        depth: Integer, at least 0. Hidden layers of the teacher; 0 makes
            the teacher linear. Defaults to `2`.
        width: Integer, at least 1. Units of each hidden layer of the
            teacher. Defaults to `64`.
        train_size: Integer, at least 1. Training examples. Defaults to
            `1500`.
        test_size: Integer, at least 1. Test examples. Defaults to `1500`.
        input_noise: Float, at least 0. Standard deviation of the noise
            added to each feature. Defaults to `0.1`.
        label_noise: Float in [0, 1]. Probability that a training label is
            redrawn uniformly. Defaults to `0.0`.
        seed: Integer, at least 0. Seed of the teacher and of both splits.
            Defaults to `0`.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: `x` float32 of shape
        `(n, features)`, `y` int32 of shape `(n,)` with values in
        `[0, classes)`.

    Raises:
        ValueError: If an argument is out of its range (the message names it
            and the value received).

    Example:

    >>> import numpy as np
    >>> from keras_dist.datasets import load_teacher
    >>> (x_train, y_train), (x_test, y_test) = load_teacher()
    >>> x_train.shape, y_train.shape, x_test.shape
    ((1500, 64), (1500,), (1500, 64))
    >>> x_train.dtype, y_train.dtype
    (dtype('float32'), dtype('int32'))
    >>> bool(np.array_equal(x_train, load_teacher()[0][0]))  # same seed, same arrays
    True
    >>> np.bincount(y_train).tolist()  # about 150 of each class
    [135, 149, 145, 156, 155, 159, 147, 160, 142, 152]
    """
    _check_int("features", features, 1)
    _check_int("classes", classes, 2)
    _check_int("latent_dim", latent_dim, 1)
    if latent_dim > features:
        raise ValueError(
            "`latent_dim` must be at most `features` (the subspace the teacher reads "
            f"lies in the input space). Received: latent_dim={latent_dim}, "
            f"features={features}")
    _check_int("depth", depth, 0)
    _check_int("width", width, 1)
    _check_int("train_size", train_size, 1)
    _check_int("test_size", test_size, 1)
    _check_int("seed", seed, 0)
    if not (isinstance(input_noise, numbers.Real) and np.isfinite(input_noise)
            and input_noise >= 0):
        raise ValueError("`input_noise` must be a finite number >= 0 (a standard "
                         f"deviation). Received: input_noise={input_noise!r}")
    if not (isinstance(label_noise, numbers.Real) and 0 <= label_noise <= 1):
        raise ValueError("`label_noise` must be a probability in [0, 1]. "
                         f"Received: label_noise={label_noise!r}")

    # A stream for each part, and, within a split, for each kind of draw: a
    # row of an array drawn from its own stream is the same whatever the
    # number of rows, so the first n examples do not depend on the split's size.
    teacher_seq, probe_seq, train_seq, test_seq, label_noise_seq = (
        np.random.SeedSequence(seed).spawn(5))
    teacher_rng = np.random.default_rng(teacher_seq)

    # The subspace: an orthonormal basis, columns scaled so that x's features
    # have variance 1 on average (latent_dim columns of squared norm
    # features / latent_dim spread over features).
    basis, _ = np.linalg.qr(teacher_rng.standard_normal((features, latent_dim)))
    spread = basis.T * np.sqrt(features / latent_dim)  # (latent_dim, features)
    reader = basis * np.sqrt(latent_dim / features)  # x @ reader = z + noise

    def inputs(seq, n):
        signal_rng, noise_rng = (np.random.default_rng(s) for s in seq.spawn(2))
        x = signal_rng.standard_normal((n, latent_dim)) @ spread
        x += input_noise * noise_rng.standard_normal((n, features))
        return x.astype("float32")

    probe = inputs(probe_seq, _PROBE_SIZE).astype("float64") @ reader
    layers = []
    fan_in = latent_dim
    for _ in range(depth):
        kernel = teacher_rng.standard_normal((fan_in, width)) / np.sqrt(fan_in)
        hidden = np.maximum(probe @ kernel, 0.0)
        mean, std = hidden.mean(axis=0), hidden.std(axis=0)
        std[std == 0] = 1.0  # a unit dead on the whole probe stays 0
        layers.append((kernel, mean, std))
        probe = (hidden - mean) / std
        fan_in = width
    output = teacher_rng.standard_normal((fan_in, classes)) / np.sqrt(fan_in)
    bias = _balance(probe @ output)

    def label(x):
        h = x.astype("float64") @ reader
        for kernel, mean, std in layers:
            h = (np.maximum(h @ kernel, 0.0) - mean) / std
        return np.argmax(h @ output + bias, axis=1).astype("int32")

    x_train, x_test = inputs(train_seq, train_size), inputs(test_seq, test_size)
    y_train, y_test = label(x_train), label(x_test)
    if label_noise > 0:
        flip_rng, redraw_rng = (np.random.default_rng(s) for s in label_noise_seq.spawn(2))
        flip = flip_rng.random(train_size) < label_noise
        redrawn = redraw_rng.integers(0, classes, size=train_size, dtype="int32")
        y_train[flip] = redrawn[flip]
    return (x_train, y_train), (x_test, y_test)


def _balance(logits):
    """Biases that give each class 1 / classes of `argmax(logits + b)`, to
    within `_BALANCE_TOLERANCE` of that share.

    Each round moves every bias against its class's excess share, by a step
    that starts at half the logits' spread (times `classes`) and shrinks
    geometrically, so the shares settle instead of oscillating (at most a
    few dozen rounds at the defaults).
    """
    classes = logits.shape[1]
    bias = np.zeros(classes)
    step = 0.5 * logits.std() * classes
    for _ in range(_BALANCE_ROUNDS):
        share = np.bincount(np.argmax(logits + bias, axis=1),
                            minlength=classes) / len(logits)
        excess = share - 1 / classes
        if np.abs(excess).max() <= _BALANCE_TOLERANCE / classes:
            return bias
        bias -= step * excess
        step *= 0.95
    if np.abs(excess).max() > _BALANCE_WARNING / classes:
        warnings.warn(
            f"load_teacher could not balance the classes: their shares of the "
            f"probe sample range from {share.min():.4f} to {share.max():.4f} "
            f"(target {1 / classes:.4f}). Try another `seed`, fewer `classes` or "
            "a larger `latent_dim`.", stacklevel=3)
    return bias


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}. "
                         f"Received: {name}={value!r}")
