"""How hard `load_teacher` is: the digits MLP and a linear model, each tuned.

    python benchmarks/teacher_difficulty.py                  # ~8 min on 2 cores
    python benchmarks/teacher_difficulty.py --datasets=teacher --depth=3 --seeds=1

Trains two models with plain SGD (batch 32, `--epochs` epochs, Keras
defaults otherwise) on each dataset in `--datasets`, at every learning rate
of `--learning_rates`, with `--seeds` training seeds each (the seed sets the
initial weights and the batch order). The teacher task is `load_teacher`'s
defaults, or what `--latent_dim`, `--depth` and `--data_seed` say:

- **MLP**: 64-64-10, ReLU, softmax: the model of the examples and of
  `benchmarks/staleness_convergence.py`;
- **linear**: softmax regression, one `Dense(classes)`.

Prints, per dataset and model, the test accuracy at each learning rate (mean
of the seeds) and at the best one (mean, min-max), and the wall seconds of
one training. The best rate is chosen on the test split itself, so the
number is what a well-tuned run reaches, not an unbiased estimate of it.
Writes every accuracy and timing to `--output` as JSON.
"""

import json
import os
import platform
import statistics
import time

from absl import app
from absl import flags

_DATASETS = flags.DEFINE_list("datasets", ["teacher", "digits"],
                              "Datasets to measure: teacher (load_teacher's defaults), "
                              "digits (load_digits).")
_LATENT_DIM = flags.DEFINE_integer("latent_dim", None, "load_teacher's latent_dim "
                                   "(default: load_teacher's).")
_DEPTH = flags.DEFINE_integer("depth", None, "load_teacher's depth (default: load_teacher's).")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "load_teacher's seed.")
_LEARNING_RATES = flags.DEFINE_list("learning_rates", ["0.01", "0.03", "0.1", "0.3"],
                                    "SGD learning rates tried for each model.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Training seeds at each learning rate.")
_EPOCHS = flags.DEFINE_integer("epochs", 40, "Passes over the training split.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Batch size.")
_OUTPUT = flags.DEFINE_string(
    "output",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                 "teacher_difficulty.json"),
    "Where to write the raw accuracies and timings (JSON).")

MODELS = ("MLP 64-64-10", "linear")


def load(name):
    from keras_dist import datasets

    if name == "digits":
        return datasets.load_digits()
    if name == "teacher":
        chosen = {"latent_dim": _LATENT_DIM.value, "depth": _DEPTH.value}
        return datasets.load_teacher(
            seed=_DATA_SEED.value, **{k: v for k, v in chosen.items() if v is not None})
    raise app.UsageError(f"--datasets: unknown dataset {name!r}; choose among "
                         "teacher, digits")


def train(model_name, data, learning_rate, seed):
    """Test accuracy and wall seconds of one training from scratch."""
    import keras

    (x_train, y_train), (x_test, y_test) = data
    classes = int(max(y_train.max(), y_test.max())) + 1
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((x_train.shape[1],))
    hidden = inputs
    if model_name == "MLP 64-64-10":
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
    outputs = keras.layers.Dense(classes, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(learning_rate), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(x_train, y_train, epochs=_EPOCHS.value, batch_size=_BATCH_SIZE.value,
              verbose=0)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return float(accuracy), seconds


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import keras
    import rich.console
    import rich.table
    import tensorflow as tf

    import keras_dist as kd

    rates = [float(rate) for rate in _LEARNING_RATES.value]
    seeds = range(_SEEDS.value)
    console = rich.console.Console()
    results = {}
    for dataset in _DATASETS.value:
        data = load(dataset)
        for model_name in MODELS:
            runs = {rate: [train(model_name, data, rate, seed) for seed in seeds]
                    for rate in rates}
            results[(dataset, model_name)] = runs
            mean = {rate: statistics.mean(a for a, _ in r) for rate, r in runs.items()}
            best = max(rates, key=mean.get)
            console.print(f"{dataset}, {model_name}: "
                          + ", ".join(f"lr {rate:g}: {mean[rate]:.1%}" for rate in rates)
                          + f"; best lr {best:g}")

    table = rich.table.Table(
        title=f"Test accuracy at the best learning rate: plain SGD, batch "
              f"{_BATCH_SIZE.value}, {_EPOCHS.value} epochs, {_SEEDS.value} seeds")
    for column in ("dataset", "model", "best lr", "accuracy", "min-max",
                   "s per training"):
        table.add_column(column, justify="left" if column in ("dataset", "model")
                         else "right")
    summary = []
    for (dataset, model_name), runs in results.items():
        mean = {rate: statistics.mean(a for a, _ in r) for rate, r in runs.items()}
        best = max(rates, key=mean.get)
        accuracies = [a for a, _ in runs[best]]
        seconds = statistics.median(s for r in runs.values() for _, s in r)
        table.add_row(dataset, model_name, f"{best:g}", f"{mean[best]:.1%}",
                      f"{min(accuracies):.1%}-{max(accuracies):.1%}", f"{seconds:.1f}")
        summary.append({"dataset": dataset, "model": model_name, "best_lr": best,
                        "mean_accuracy": mean[best], "accuracies": accuracies,
                        "median_seconds": seconds})
    console.print(table)

    os.makedirs(os.path.dirname(_OUTPUT.value) or ".", exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({
            "benchmark": "teacher_difficulty",
            "config": {"datasets": _DATASETS.value, "learning_rates": rates,
                       "latent_dim": _LATENT_DIM.value, "depth": _DEPTH.value,
                       "data_seed": _DATA_SEED.value,
                       "seeds": _SEEDS.value, "epochs": _EPOCHS.value,
                       "batch_size": _BATCH_SIZE.value},
            "versions": {"python": platform.python_version(),
                         "tensorflow": tf.__version__, "keras": keras.__version__,
                         "keras_dist": kd.__version__},
            "summary": summary,
            "runs": [{"dataset": dataset, "model": model_name, "lr": rate,
                      "seed": seed, "accuracy": accuracy, "seconds": seconds}
                     for (dataset, model_name), runs in results.items()
                     for rate, r in runs.items()
                     for seed, (accuracy, seconds) in zip(seeds, r)],
        }, f, indent=2)
    console.print(f"raw results: {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
