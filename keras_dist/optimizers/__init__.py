"""Staleness-aware optimizer wrappers for asynchronous training.

Each wraps any Keras optimizer and corrects the gradient of an update for its
staleness (see docs/staleness-aware-optimizers.md):

- `StalenessScaled` (Zhang et al. 2016): `g / max(tau, 1)`
- `DynSGD` (Jiang et al. 2017): `g / (tau + 1)`
- `DCASGD` (Zheng et al. 2017): delay compensation with the pulled weights
- `GapAware` (Barkai et al. 2020): elementwise penalty by the weight gap
- `DANA` (Hakimi et al. 2019): per-worker momentum with look-ahead weights
- `StalenessLimit`: drop updates with `tau > max_staleness`
- `DelayAdaptive` (Koloskova et al. 2022, Mishchenko et al. 2022):
  `g * N / max(N, tau)`
- `Ringmaster` (Maranjyan et al. 2025): ignore updates with `tau >= R`

`DelayedNesterov` (Liu et al. 2024) is an outer optimizer for local steps:
Nesterov momentum updated once every N pushes.

`implicit_momentum` / `compensated_momentum` (Mitliagkas et al. 2016) give
the momentum asynchrony adds by itself, and what to set instead.

Example:

>>> import keras, keras_dist as kd
>>> opt = kd.optimizers.StalenessLimit(
...     kd.optimizers.DynSGD(keras.optimizers.SGD(0.1)), max_staleness=8)
>>> type(opt.inner_optimizer).__name__
'DynSGD'
"""

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer
from keras_dist.optimizers.dana import DANA
from keras_dist.optimizers.dcasgd import DCASGD
from keras_dist.optimizers.delay_adaptive import DelayAdaptive
from keras_dist.optimizers.delayed_nesterov import DelayedNesterov
from keras_dist.optimizers.dynsgd import DynSGD
from keras_dist.optimizers.gap_aware import GapAware
from keras_dist.optimizers.implicit import compensated_momentum, implicit_momentum
from keras_dist.optimizers.ringmaster import Ringmaster
from keras_dist.optimizers.staleness_limit import StalenessLimit
from keras_dist.optimizers.staleness_scaled import StalenessScaled

__all__ = ["DANA", "DCASGD", "DelayAdaptive", "DelayedNesterov", "DynSGD", "GapAware",
           "Ringmaster", "StalenessAwareOptimizer", "StalenessLimit", "StalenessScaled",
           "compensated_momentum", "implicit_momentum"]
