"""Callbacks for distributed training: stragglers, per-replica metrics, backups.

They work in every strategy keras_dist drives (one device, Mirrored,
MultiWorkerMirrored, parameter servers) and drop into any `fit` call.

Example:

>>> import numpy as np, keras, keras_dist as kd
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
>>> model.compile(optimizer="sgd", loss="mse")
>>> history = model.fit(
...     np.ones((64, 4)), np.ones((64, 1)), batch_size=16, epochs=1, verbose=0,
...     callbacks=[kd.callbacks.StragglerDetector(),
...                kd.callbacks.PerReplicaMetrics(table=False)])
>>> history.history["replica0/updates"]
[4]
"""

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.callbacks.backup import PREEMPTED_EXIT_CODE, BackupAndRestore
from keras_dist.callbacks.base import ReplicaCallback, ReplicaStep
from keras_dist.callbacks.per_replica import PerReplicaMetrics
from keras_dist.callbacks.straggler import StragglerDetector, StragglerError

__all__ = ["BackupAndRestore", "PerReplicaMetrics", "ReplicaCallback", "ReplicaStep", "StragglerDetector",
           "StragglerError"]
