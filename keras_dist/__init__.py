"""keras-dist: distributed and asynchronous training for Keras 3 on TensorFlow.

Example:

>>> import keras_dist as kd
>>> kd.choose_strategy("default", environ={}).kind.value
'default'
"""

import logging
import os

_backend = os.environ.get("KERAS_BACKEND", "").strip()
if _backend and _backend != "tensorflow":
    raise ImportError(
        f"keras_dist runs on TensorFlow's distributed runtime, but "
        f"KERAS_BACKEND={_backend!r}. Set KERAS_BACKEND=tensorflow (or unset "
        "it) before importing keras or keras_dist."
    )

import keras  # noqa: E402

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_dist runs on TensorFlow's distributed runtime, but Keras is "
        f"configured for the {keras.backend.backend()!r} backend (see "
        "~/.keras/keras.json). Set KERAS_BACKEND=tensorflow before importing "
        "keras or keras_dist."
    )

from keras_dist import versions  # noqa: E402

versions.warn_if_untested()

from keras_dist.cluster import ClusterConfig  # noqa: E402
from keras_dist.async_model import AsyncModel  # noqa: E402
from keras_dist.fit import evaluate, fit  # noqa: E402
from keras_dist.serve import serve  # noqa: E402
from keras_dist import callbacks, optimizers, sharded, testing  # noqa: E402
from keras_dist.strategy import (  # noqa: E402
    StrategyChoice,
    StrategyKind,
    build_strategy,
    choose_strategy,
    resolve_strategy,
)

__version__ = "0.2.0.dev0"

__all__ = [
    "AsyncModel",
    "ClusterConfig",
    "StrategyChoice",
    "StrategyKind",
    "build_strategy",
    "callbacks",
    "choose_strategy",
    "evaluate",
    "fit",
    "optimizers",
    "resolve_strategy",
    "serve",
    "sharded",
    "testing",
    "versions",
]

_logger = logging.getLogger("keras_dist")
if not _logger.handlers:
    # Like TensorFlow's own logger: one line per decision on stderr by default;
    # silence with logging.getLogger("keras_dist").setLevel(logging.WARNING).
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
