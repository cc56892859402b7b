"""The gradient step both simulated trainings compute on a worker's weights."""

import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


def loss_and_grads(model, optimizer):
    """A compiled `(weights, state, x, y) -> (loss, grads, new state)`: one
    batch's loss and gradients at `weights` (the weights a worker read),
    through `Model.stateless_call`, with the loss scaled as `optimizer`
    scales it (a `LossScaleOptimizer` unscales in `apply`)."""

    @tf.function(reduce_retracing=True)
    def step(weights, state, xb, yb):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y_pred, new_state = model.stateless_call(weights, state, xb, training=True)
            loss = model.compute_loss(x=xb, y=yb, y_pred=y_pred, training=True)
            scaled = optimizer.scale_loss(loss)
        return loss, tape.gradient(scaled, weights), new_state

    return step
