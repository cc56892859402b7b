"""Process-wide checks and settings of keras_dist's TensorFlow side.

`import keras_dist` itself is cheap: it does not import TensorFlow or Keras
(so `keras-dist-run --help` answers at once, and the launcher does not load
TensorFlow only to start other processes). Every keras_dist module that needs
Keras imports this one first; its import checks, once per process, that Keras
runs on TensorFlow and warns if the versions are outside the tested range.
`quiet_tf_logger` silences TensorFlow's Python logger around calls that log
at INFO what no user needs (a session-config dump, per-call join notes).
"""

import contextlib
import logging

import keras
import tensorflow as tf

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_dist runs on TensorFlow's distributed runtime, but Keras is "
        f"configured for the {keras.backend.backend()!r} backend (see "
        "~/.keras/keras.json). Set KERAS_BACKEND=tensorflow before importing "
        "keras or keras_dist."
    )

from keras_dist import versions  # noqa: E402

versions.warn_if_untested()


@contextlib.contextmanager
def quiet_tf_logger(level="ERROR"):
    """Raises the level of TensorFlow's Python loggers for a block, then
    restores it: `tensorflow`, and `absl`, which parts of TensorFlow log
    through (e.g. the session-config dump when connecting to a cluster)."""
    loggers = [tf.get_logger(), logging.getLogger("absl")]
    previous = [one.level for one in loggers]
    for one in loggers:
        one.setLevel(level)
    try:
        yield
    finally:
        for one, was in zip(loggers, previous):
            one.setLevel(was)
