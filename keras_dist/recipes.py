"""`keras_dist.recipes`: the public path of `keras_dist.cluster.recipes` (the same module object)."""

import sys

from keras_dist.cluster import recipes as _implementation

sys.modules[__name__] = _implementation
