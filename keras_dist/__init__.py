"""keras-dist: distributed and asynchronous training for Keras 3 on TensorFlow.

Example:

>>> import keras_dist as kd
>>> kd.choose_strategy("default", environ={}).kind.value
'default'
"""

import importlib
import logging
import os
from typing import TYPE_CHECKING

_backend = os.environ.get("KERAS_BACKEND", "").strip()
if _backend and _backend != "tensorflow":
    raise ImportError(
        f"keras_dist runs on TensorFlow's distributed runtime, but "
        f"KERAS_BACKEND={_backend!r}. Set KERAS_BACKEND=tensorflow (or unset "
        "it) before importing keras or keras_dist."
    )

__version__ = "0.2.0.dev0"

# Public name -> the module that defines it. Loaded on first use (PEP 562), so
# that `import keras_dist` does not import TensorFlow: the launcher and
# `keras_dist.cluster.recipes` run without it.
_EXPORTS = {
    "AsyncModel": "keras_dist.training.async_model",
    "ClusterConfig": "keras_dist.cluster.config",
    "NonFiniteUpdateError": "keras_dist.training.nonfinite",
    "StrategyChoice": "keras_dist.cluster.strategy",
    "StrategyKind": "keras_dist.cluster.strategy",
    "build_strategy": "keras_dist.cluster.strategy",
    "choose_strategy": "keras_dist.cluster.strategy",
    "evaluate": "keras_dist.training.api",
    "fit": "keras_dist.training.api",
    "local_fit": "keras_dist.cluster.plain_fit",
    "predict": "keras_dist.training.api",
    "resolve_strategy": "keras_dist.cluster.strategy",
    "serve": "keras_dist.cluster.serving",
}
_SUBMODULES = ("callbacks", "flags", "optimizers", "recipes", "sharded", "testing",
               "versions")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see __getattr__
    from keras_dist import (  # noqa: F401
        callbacks, flags, optimizers, recipes, sharded, testing, versions)
    from keras_dist.cluster.plain_fit import local_fit  # noqa: F401
    from keras_dist.training.async_model import AsyncModel  # noqa: F401
    from keras_dist.cluster.config import ClusterConfig  # noqa: F401
    from keras_dist.cluster.serving import serve  # noqa: F401
    from keras_dist.training.nonfinite import NonFiniteUpdateError  # noqa: F401
    from keras_dist.cluster.strategy import (  # noqa: F401
        StrategyChoice, StrategyKind, build_strategy, choose_strategy, resolve_strategy)
    from keras_dist.training.api import evaluate, fit, predict  # noqa: F401


def __getattr__(name):
    if name in _EXPORTS:
        from keras_dist import _runtime  # noqa: F401  (backend and version checks)

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"keras_dist.{name}")
    else:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# `keras.saving.load_model` finds AsyncModel and the optimizer wrappers by their
# registered names once `import keras_dist` ran, whichever of keras / keras_dist
# is imported first (see _registration).
from keras_dist import _registration  # noqa: E402

_registration.install()

# gRPC keepalive for cluster channels: a cut-off or stopped peer becomes an
# error instead of an endless wait. Set here, once, before keras_dist opens
# any channel; nothing below writes the environment (see cluster.keepalive).
from keras_dist.cluster import keepalive as _keepalive  # noqa: E402

_keepalive.configure_grpc()


_logger = logging.getLogger("keras_dist")
if not _logger.handlers:
    # Like TensorFlow's own logger: one line per decision on stderr by default;
    # silence with logging.getLogger("keras_dist").setLevel(logging.WARNING).
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
