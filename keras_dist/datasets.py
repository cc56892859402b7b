"""The bundled default dataset: scikit-learn's 8x8 handwritten digits.

1,797 real images shipped inside scikit-learn (no download), so examples,
tests and benchmarks run anywhere. Needs scikit-learn (`pip install
scikit-learn`; the wheel's `examples` and `test` extras have it).
"""


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
