"""Feature-by-feature cases where `kd.fit` must give what `model.fit` gives.

Shared by tests/test_equivalence.py (MirroredStrategy, 2 logical CPUs, in
process: every case) and tests/scripts/mwms_equivalence.py (a real 2-process
MultiWorkerMirrored cluster: the `MWMS_CASES`). Each case builds the same
seeded model, data and arguments; the reference is Keras' own `model.fit` on
one device.
"""

import keras
import numpy as np

SAMPLES = 200


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int32")
    return x, y


class WeightedStep:
    """A user's `train_step` (the Keras customization guide's shape): the loss
    multiplied by `loss_weight`, plus a metric of its own, `counted`, that adds
    `count(x)` per call. Mixed into a `keras.Model` or `kd.AsyncModel`."""

    loss_weight = 2.0

    def setup(self, hidden=16, outputs=2, counter="examples_seen"):
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.out = keras.layers.Dense(outputs, activation="softmax")
        self.counted = keras.metrics.Sum(name=counter)

    def call(self, x):
        return self.out(self.hidden(x))

    def count(self, x):
        import tensorflow as tf

        return tf.cast(tf.shape(x)[0], "float32")

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_weight * self.compute_loss(x=x, y=y, y_pred=y_pred,
                                                        training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.counted.update_state(self.count(x))
        # As Keras' own train_step: the tracker gets the loss before the
        # 1 / replicas scaling, weighted by the batch size.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss * replicas, sample_weight=tf.shape(x)[0])
            elif metric.name == "compile_metrics":
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class WeightedStepModel(WeightedStep, keras.Model):
    def __init__(self, **kwargs):
        keras.Model.__init__(self, **kwargs)
        self.setup()


def _sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


CASES = {
    "sgd": dict(),
    "adamw": dict(optimizer=lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05)),
    "ema": dict(optimizer=lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)),
    "clipnorm": dict(optimizer=lambda: keras.optimizers.SGD(0.1, clipnorm=0.1)),
    "clipvalue": dict(optimizer=lambda: keras.optimizers.SGD(0.1, clipvalue=0.01)),
    "global_clipnorm": dict(optimizer=lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1)),
    "uneven_batch": dict(fit=dict(batch_size=33)),
    "steps_per_execution": dict(steps_per_execution=3, fit=dict(batch_size=16)),
    "sample_weight": dict(sample_weight=True),
    "class_weight": dict(fit=dict(class_weight={0: 1.0, 1: 3.0})),
    "validation_split": dict(fit=dict(validation_split=0.25)),
    "validation_freq": dict(validation_data=True,
                            fit=dict(validation_freq=2, validation_batch_size=24, epochs=4)),
    "initial_epoch": dict(fit=dict(initial_epoch=1, epochs=4)),
    "lr_callback": dict(callbacks=lambda: [keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: lr * 0.5)]),
    "lr_schedule": dict(optimizer=lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=5, decay_rate=0.8))),
    "early_stopping": dict(
        validation_data=True, fit=dict(epochs=8),
        callbacks=lambda: [keras.callbacks.EarlyStopping(
            "val_loss", min_delta=0.02, patience=1, restore_best_weights=True)]),
    "custom_train_step": dict(model="weighted_step"),
}
"""name -> settings: `optimizer` (factory), `fit` (extra fit arguments),
`callbacks` (factory), `sample_weight` / `validation_data` (use them),
`steps_per_execution`, `model` ("mlp" or "weighted_step")."""

MWMS_CASES = ("sgd", "uneven_batch", "steps_per_execution", "sample_weight",
              "global_clipnorm", "validation_freq", "early_stopping")
"""The cases run on a real 2-process MultiWorkerMirrored cluster too: those
whose path there differs from in-process Mirrored. Both strategies train
through the same `SyncExecutor` (keras_dist/training/sync_executor.py); what
differs between them is TensorFlow's, and these cases reach it:

- sgd: the input sharded over workers (auto-shard by DATA), the gradient and
  the non-finite all-reduce between processes, the metrics read (summed)
  over workers for the epoch logs;
- uneven_batch: batches of 33 (and the last, of 2) split over the workers,
  the examples all-reduced for the global-batch average;
- steps_per_execution: several steps (and their collectives) per call, in a
  `tf.while_loop`;
- sample_weight: the weights sharded with their samples (`class_weight`
  becomes sample weights in NumPy before any of this);
- global_clipnorm: the gradients all-reduced before the optimizer's
  clipping, with the thresholds divided by the replicas (every clipping
  argument takes this one path; see keras_dist/training/gradients.py);
- validation_freq: evaluation over the workers, with a batch size of its own
  (`validation_split` splits the arrays in NumPy, then takes this path);
- early_stopping: every worker stops at the same epoch and restores the best
  weights into its mirrored variables.

The other cases (optimizers, schedules, callbacks, `initial_epoch`, a custom
`train_step`) differ only in the model's own Python and Keras code, which
runs the same under both strategies: the in-process Mirrored tests cover
them."""


def build(case, steps_per_execution=None):
    """The seeded, compiled model of `case` (call inside a strategy scope)."""
    settings = CASES[case]
    keras.utils.set_random_seed(3)
    if settings.get("model") == "weighted_step":
        model = WeightedStepModel()
        model(np.zeros((1, 8), "float32"))  # creates the weights
    else:
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ])
    model.compile(settings.get("optimizer", _sgd)(), "sparse_categorical_crossentropy",
                  metrics=["accuracy"],
                  steps_per_execution=steps_per_execution or settings.get(
                      "steps_per_execution", 1))
    return model


def fit_arguments(case):
    """`(x, y, kwargs)` for `fit` in `case`, callbacks freshly made."""
    settings = CASES[case]
    x, y = data()
    kwargs = dict(epochs=3, batch_size=32, shuffle=False, verbose=0)
    kwargs.update(settings.get("fit", {}))
    if settings.get("sample_weight"):
        kwargs["sample_weight"] = np.linspace(0.5, 2.0, len(x)).astype("float32")
    if settings.get("validation_data"):
        kwargs["validation_data"] = (x[:40], y[:40])
    if "callbacks" in settings:
        kwargs["callbacks"] = settings["callbacks"]()
    return x, y, kwargs


def reference(case):
    """Keras' own `model.fit` on one device: `(weights, history dict)`."""
    model = build(case)
    x, y, kwargs = fit_arguments(case)
    history = model.fit(x, y, **kwargs)
    return model.get_weights(), history.history


def largest_difference(weights_a, weights_b):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(weights_a, weights_b))
