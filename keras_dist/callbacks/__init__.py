"""Callbacks that see each replica and worker: stragglers and per-replica metrics.

They work in every strategy keras_dist drives (one device, Mirrored,
MultiWorkerMirrored, parameter servers) and drop into any `fit` call.
"""

from keras_dist.callbacks.base import ReplicaCallback, ReplicaStep
from keras_dist.callbacks.per_replica import PerReplicaMetrics
from keras_dist.callbacks.straggler import StragglerDetector, StragglerError

__all__ = ["PerReplicaMetrics", "ReplicaCallback", "ReplicaStep", "StragglerDetector",
           "StragglerError"]
