"""Started by `keras-dist-run` in every task of a cluster with `ps` tasks.

The launcher puts this folder first on `PYTHONPATH`, so Python imports this
module at start-up. It imports keras_dist (which imports neither Keras nor
TensorFlow), whose import hook guards Keras' own `model.fit` once Keras is
imported (`keras_dist.cluster.plain_fit`): a script that never hands its training
to keras_dist gets keras_dist's error on every task instead of training a
separate model on each. Then the `sitecustomize` this one shadows, if there
is one further along the path, runs as it would have.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    import keras_dist  # noqa: F401  (installs the import hook)
except Exception:  # noqa: BLE001  (never break the interpreter's start)
    pass
_chain()
