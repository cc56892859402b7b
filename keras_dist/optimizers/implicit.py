"""The momentum that asynchrony adds by itself (Mitliagkas et al. 2016)."""

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


def implicit_momentum(workers):
    """The momentum N asynchronous workers add without being asked: `1 - 1/N`.

    From Mitliagkas, Zhang, Hadjis and Ré, "Asynchrony begets Momentum, with
    an Application to Deep Learning" (2016): under their model of N workers
    whose updates land in random order, asynchronous SGD behaves in
    expectation like momentum SGD with momentum about `1 - 1/N` on top of
    any explicit momentum. So explicit momentum that suits one worker is
    too much at N workers; `compensated_momentum` takes it off.

    Args:
        workers: Integer >= 1. Number of asynchronous workers N.

    Returns:
        Float in [0, 1).

    Example:

    >>> from keras_dist.optimizers import implicit_momentum
    >>> implicit_momentum(1), implicit_momentum(4)
    (0.0, 0.75)

    Raises:
        ValueError: if `workers` is not an integer >= 1.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be an integer >= 1. Received: workers={workers!r}.")
    return 1.0 - 1.0 / workers


def compensated_momentum(target, workers, floor=0.0):
    """Explicit momentum for N workers so that the total is about `target`.

    `max(floor, target - implicit_momentum(workers))`: the momentum to give
    the optimizer (e.g. `keras.optimizers.SGD(lr, momentum=...)`) so that,
    with what asynchrony adds, the effective momentum stays near the
    `target` tuned for one worker. Keras' optimizers take momentum >= 0,
    hence the floor; the paper notes the best explicit momentum can even be
    negative at large N. Beyond `N = 1 / (1 - target)` workers (10 for 0.9)
    it is the floor: asynchrony alone already supplies the momentum.

    Args:
        target: Float in [0, 1). The momentum that suits one worker.
        workers: Integer >= 1. Number of asynchronous workers N.
        floor: Float. The smallest momentum returned. Defaults to `0.0`.

    Returns:
        Float.

    Example:

    >>> import keras
    >>> from keras_dist.optimizers import compensated_momentum
    >>> round(compensated_momentum(0.9, 4), 4), compensated_momentum(0.9, 16)
    (0.15, 0.0)
    >>> opt = keras.optimizers.SGD(0.01, momentum=compensated_momentum(0.9, 4))

    Raises:
        ValueError: if `target` is outside [0, 1) or `workers` is bad.
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 <= target < 1:
        raise ValueError(f"`target` must be a float in [0, 1). Received: target={target!r}.")
    return max(float(floor), float(target) - implicit_momentum(workers))
