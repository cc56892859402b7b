"""One cache of compiled functions per model, emptied when the model is compiled again.

Keras keeps its `train_function`, `test_function` and `predict_function` on
the model and drops them in `compile()`. keras_dist's executors keep theirs
the same way, in one place: `cached(model, key, build)` returns what
`build()` made for `key` under the model's current compilation, and a new
`compile()` (a new optimizer, new compiled metrics) starts an empty cache.
So a second `fit` or `evaluate` reuses what the first traced, and nothing
traced for an earlier compilation is ever called.

Example:

>>> import keras
>>> from keras_dist.training import compiled
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> model.compile("sgd", "mse")
>>> first = compiled.cached(model, "f", object)
>>> compiled.cached(model, "f", object) is first
True
>>> model.compile("sgd", "mse")
>>> compiled.cached(model, "f", object) is first
False
"""

_ATTRIBUTE = "_kd_compiled"


class _Entries:
    def __init__(self, token):
        self.token = token
        self.values = {}


def _token(model):
    """What every `compile()` replaces: the optimizer, and the loss tracker
    Keras creates anew in each `compile()` (the first of `model.metrics`
    whenever the model is compiled, by Keras' documented order). Kept as
    objects and compared by identity, so a freed object's reused `id`
    cannot match; the same optimizer passed to a second `compile()` still
    gets a new tracker."""
    tracker = None
    if getattr(model, "compiled", False):
        metrics = getattr(model, "metrics", ())
        tracker = metrics[0] if metrics else None
    return (getattr(model, "optimizer", None), tracker)


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def cached(model, key, build):
    """The value `build()` made for `key` under `model`'s current compilation.

    Args:
        model: A `keras.Model`.
        key: Any hashable: what the value depends on besides the compilation
            (a strategy, a mode, a number of steps...).
        build: Zero-argument function making the value when it is missing.
    """
    token = _token(model)
    entries = model.__dict__.get(_ATTRIBUTE)
    if entries is None or not _same(entries.token, token):
        entries = _Entries(token)
        model.__dict__[_ATTRIBUTE] = entries  # outside Keras' attribute tracking
    if key not in entries.values:
        entries.values[key] = build()
    return entries.values[key]


def entries(model):
    """The values cached under `model`'s current compilation, by key (a new
    dict; empty when nothing was cached since the last `compile()`)."""
    found = model.__dict__.get(_ATTRIBUTE)
    if found is None or not _same(found.token, _token(model)):
        return {}
    return dict(found.values)
