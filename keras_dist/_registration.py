"""Keras serialization names for keras_dist's classes, without importing Keras early.

A `.keras` file saved from an `AsyncModel`, or from a model compiled with a
staleness-aware optimizer, names those classes by their registered names
(`"keras_dist>AsyncModel"`, `"keras_dist>DynSGD"`, ...). Keras finds them only
if the modules that define them were imported first, and Keras imports modules
by name only for its own packages. `import keras_dist` does not import Keras
or TensorFlow (the launcher and `keras_dist.cluster.recipes` run without them), so it
cannot import those modules itself. Instead:

- if Keras is already imported, the modules are imported now;
- otherwise the first `import keras` of the process imports them, right after
  Keras itself has finished importing (an import hook, removed once it fired).

So `import keras_dist` before `keras.saving.load_model(...)`, in either order
with `import keras`, is enough, as with any Keras extension package.
"""

import importlib
import importlib.abc
import importlib.util
import logging
import sys

# The modules whose import registers keras_dist's serializable classes.
SERIALIZABLE_MODULES = ("keras_dist.training.async_model", "keras_dist.optimizers")


def register_serializables():
    """Imports the modules that register keras_dist's classes with Keras.

    Never raises: a failure here (for instance an unsupported Keras version,
    which `keras_dist._runtime` refuses) must not make the user's own
    `import keras` fail; the same error is raised, with its message, when
    keras_dist is used.

    Also guards Keras' own `model.fit` on a parameter-server cluster's tasks
    (`keras_dist.cluster.plain_fit`).
    """
    try:
        from keras_dist.cluster import plain_fit as _plain_fit

        _plain_fit.install()
    except Exception as exc:  # noqa: BLE001  (see docstring)
        logging.getLogger("keras_dist").debug("keras_dist: model.fit not guarded: %s", exc)
    for name in SERIALIZABLE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (see docstring)
            logging.getLogger("keras_dist").debug(
                "keras_dist: %s not registered with Keras: %s", name, exc)
            return


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps `keras`'s loader so that registration runs
    once `keras` has executed, then takes itself off `sys.meta_path`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras":
            return None
        self.remove()
        spec = importlib.util.find_spec("keras")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register_serializables()

        spec.loader.exec_module = exec_then_register
        return spec

    def remove(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install():
    """Registers now if Keras is imported, else on Keras' first import."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "saving"):
        register_serializables()
    elif keras is None and not any(isinstance(f, _AfterKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())
