"""Local steps on a real parameter-server cluster; run by keras-dist-run.

The chief writes out_dir/result.json with three checks:

- "one_round": for SGD, SGD with momentum and Adam, one scheduled round of
  K local steps (one worker) against Keras' own `model.fit` on one device
  for the same K batches from the same weights: the largest weight and
  optimizer-state difference.
- "sum": a linear model whose gradient does not depend on its weights
  (loss = mean(x @ w)), two workers racing: every round's change is then
  known from the batches alone, so the parameter servers must end at
  w0 - lr * (sum of the batch gradients of every round each worker ran).
- "one_round_chained", "sum_chained": the same two checks with two rounds
  chained in each execution (steps_per_execution = 2 K).
- "train": the digits MLP with local steps and with an outer optimizer
  (Nesterov, DiLoCo style): test accuracy, version (= pushes), staleness.
- "elastic_sum": the same racing linear model with EASGD (`elastic`): the
  exchange conserves centre + every worker's copy, so that sum must end at
  (workers + 1) * w0 - lr * (sum of the batch gradients of every round).
- "train_elastic": the digits MLP with EASGD.
- "errors": the messages of what local steps refuse on a parameter-server
  chief (steps_per_execution > 1, a custom train_step, a LossScaleOptimizer
  as the model's optimizer).

argv: out_dir.
"""

import json
import os
import sys

import numpy as np

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model, one_local_round  # noqa: E402

K = 4
(X, Y), (X_TEST, Y_TEST) = load_digits()


def one_round(make_optimizer, rounds=1):
    keras.utils.set_random_seed(1)
    local = digits_model(make_optimizer())
    with strategy.scope():
        remote = kd.AsyncModel.from_model(digits_model(
            make_optimizer(), steps_per_execution=K * rounds if rounds > 1 else 1))
    weights = one_local_round(strategy, local, remote, X, Y, K, rounds=rounds)
    slots = max([float(np.abs(np.asarray(a.numpy(), np.float64) - b.numpy()).max())
                 for a, b in zip(local.optimizer.variables, remote.optimizer.variables)])
    return {"weights": weights, "optimizer_state": slots,
            "iterations": int(remote.optimizer.iterations.numpy()), "version": remote.version}


def racing_sum(elastic=None, chained=False):
    lr, rounds = 0.01, 24
    x = np.abs(np.random.default_rng(0).normal(size=(32 * K * rounds, 8))).astype("float32")

    def mean_output(y_true, y_pred):
        return keras.ops.mean(y_pred)

    with strategy.scope():
        inputs = keras.Input((8,))
        model = kd.AsyncModel(inputs, keras.layers.Dense(1, use_bias=False)(inputs))
        # chained: two rounds per execution, with no chief between them.
        model.compile(keras.optimizers.SGD(lr), mean_output,
                      steps_per_execution=2 * K if chained else 1)
    w0 = model.weights[0].numpy().copy()
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=32, epochs=1,
              steps_per_epoch=K * rounds, shuffle=False, verbose=0, local_steps=K,
              elastic=elastic)
    per_worker = model.staleness_stats.updates_per_worker()
    # Each worker reads the data from its start: its r rounds took batches 0 .. r*K-1.
    batch_grads = x.reshape(-1, 32, 8).mean(axis=1)
    change = lr * sum(batch_grads[:r * K].sum(axis=0) for r in per_worker.values())
    got = model.weights[0].numpy()[:, 0]
    expected = w0[:, 0] - change
    result = {"rounds_per_worker": {str(k): v for k, v in per_worker.items()},
              "total_change": float(np.abs(change).max()), "version": model.version}
    if elastic is not None:  # centre + copies: conserved by the exchange
        copies = model.elastic_copies.variables[0].numpy()[:, :, 0]
        got = got + copies.sum(axis=0)
        expected = (1 + len(copies)) * w0[:, 0] - change
        result["centre_moved"] = float(np.abs(model.weights[0].numpy()[:, 0] - w0[:, 0]).max())
        result["copies_differ"] = float(np.abs(copies[0] - copies[1]).max())
    result["max_difference"] = float(np.abs(got - expected).max())
    return result


def train(outer, elastic=None):
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = kd.AsyncModel.from_model(digits_model(keras.optimizers.SGD(0.05, momentum=0.9)))
    history = model.fit(X, Y, batch_size=32, epochs=3, steps_per_epoch=40 * K, verbose=0,
                        local_steps=K, outer_optimizer=outer, elastic=elastic)
    outer_state = {}
    if isinstance(outer, kd.optimizers.DelayedNesterov):
        outer = model.outer_optimizer  # the one trained (made again in the strategy's scope)
        outer_state = {"workers": outer.workers, "iterations": int(outer.iterations.numpy()),
                       "buffer": max(float(np.abs(b.numpy()).max()) for b in outer.buffers),
                       "momentum": max(float(np.abs(m.numpy()).max()) for m in outer.momentums)}
    return {"test_accuracy": model.evaluate(X_TEST, Y_TEST, verbose=0, return_dict=True)[
                "accuracy"], "outer": outer_state,
            "version": model.version, "history": history.history,
            # The last epoch's executions: each worker's pull, steps, push, total.
            "phases": [[r.pull, r.compute, r.push, r.seconds]
                       for r in model.staleness_stats.records],
            "updates_per_worker": {str(k): v for k, v in
                                   model.staleness_stats.updates_per_worker().items()}}


def errors():
    class Custom(kd.AsyncModel):
        def train_step(self, data):
            return super().train_step(data)

    messages = {}
    with strategy.scope():
        spe = kd.AsyncModel.from_model(digits_model("sgd"))
        spe.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=2)
        inputs = keras.Input((64,))
        custom = Custom(inputs, keras.layers.Dense(10, activation="softmax")(inputs))
        custom.compile("sgd", "sparse_categorical_crossentropy")
        scaled = kd.AsyncModel.from_model(digits_model(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD())))
    for name, model in {"steps_per_execution": spe, "train_step": custom,
                        "loss_scale": scaled}.items():
        try:
            model.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0, local_steps=K)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def main(out_dir):
    result = {"one_round": {name: one_round(make) for name, make in {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01)}.items()},
        "sum": racing_sum(),
        # Rounds chained (steps_per_execution 2 * K): one worker's two rounds
        # are Keras' 2 * K steps; racing workers lose no round's change.
        "one_round_chained": {name: one_round(make, rounds=2) for name, make in {
            "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01)}.items()},
        "sum_chained": racing_sum(chained=True),
        "train": train(None),
        # Outer momentum amplifies stale pushes: lr / (1 - momentum) near 1.
        "train_outer": train(keras.optimizers.SGD(0.7, momentum=0.3, nesterov=True)),
        # Delayed Nesterov (Liu et al. 2024): N = 2 from the cluster.
        "train_delayed_nesterov": train(kd.optimizers.DelayedNesterov(0.7, momentum=0.3)),
        "elastic_sum": racing_sum(elastic=0.3),
        "train_elastic": train(None, elastic=0.45),  # 0.9 / workers, as the paper suggests
        "errors": errors()}
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, default=float)


if __name__ == "__main__":
    main(sys.argv[1])
