"""`keras_dist.sharded`: the public path of `keras_dist.training.sharded` (the same module object)."""

import sys

from keras_dist.training import sharded as _implementation

sys.modules[__name__] = _implementation
