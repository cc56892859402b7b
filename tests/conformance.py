"""The conformance matrix: model kinds x strategy shapes x what a user does
after `fit`, each cell held to Keras' own `fit` on one device (issue 47).

`record(kind, train)` builds a model of `kind`, trains it with `train`
(Keras' own `model.fit`, or `kd.fit` under some strategy), then does each
thing of `AFTER` to the trained model, and returns what a test compares:
the model's class, how many steps the user's `train_step` ran, History's
keys in order, what the callbacks saw (each hook, in order, with the keys
of its logs), the weights, and each `AFTER` outcome. `compare(cell,
reference, shape)` lists every difference from the reference (Keras on
one device) that `EXPECTED` does not document, as sentences.

Where it runs:

- one device and Mirrored (2 logical CPUs): in the test process,
  tests/test_conformance.py;
- MultiWorkerMirrored: both workers of tests/test_fit_multiworker.py's run
  (tests/scripts/mwms_worker.py's `conformance` input);
- parameter servers: tests/scripts/ps_conformance.py, a scenario of the
  shared cluster (tests/conftest.py).

`make conformance-table` writes docs/compatibility.md's matrix from
`EXPECTED` (`python tests/conformance.py --write`); a test holds the page
to it. Keras is imported inside the functions: scripts resolve their
strategy first.
"""

import os
import re
import sys

KINDS = ("sequential", "functional", "custom_step", "lazy_subclass", "trainer_mixin")
SHAPES = ("one_device", "mirrored", "multi_worker", "parameter_server")
AFTER = ("model.evaluate", "model.predict", "kd.evaluate", "save_and_load", "second_fit",
         "keras_fit")
EPOCHS, BATCH, EXAMPLES = 2, 16, 64  # 4 steps an epoch

# What a shape does differently from Keras on one device, on purpose or by
# a limitation it shares with Keras' own fit there, and says so: (kind or
# "*", shape, what) -> the text of the error raised, or of the addition.
# Anything else that differs fails the cell.
# Keras' own Sequential and functional classes come back as kd.AsyncModel
# under parameter servers (a class of the user's keeps its class).
_REWRAPPED = {
    "class": ("comes back as `kd.AsyncModel`, a `keras.Model` subclass (Keras' own "
              "classes cannot train asynchronously); a class of the user's keeps its class"),
}
EXPECTED = {
    **{(kind, "parameter_server", what): text
       for kind in ("sequential", "functional") for what, text in _REWRAPPED.items()},
    ("*", "parameter_server", "keras_fit"): (
        "is keras_dist's (`kd.AsyncModel.fit`; for a class of the user's, `kd.fit` under "
        "the same strategy): it trains asynchronously again (History adds the staleness "
        "keys)"),
    ("*", "parameter_server", "callbacks"): (
        "calls `on_train_batch_begin` as it schedules each step and "
        "`on_train_batch_end` as each finishes, so a few begins come before the "
        "first end; each batch still gets one of each, with Keras' logs"),
    ("*", "parameter_server", "history"): (
        "adds `staleness_mean` and `staleness_max` (the updates' staleness; "
        "docs/asynchronous-training.md)"),
}
ADDED_KEYS = ("staleness_mean", "staleness_max")  # what EXPECTED's "history" adds
# Shapes whose weights are those of one device to rounding (synchronous).
DETERMINISTIC = ("one_device", "mirrored", "multi_worker")
ATOL = 1e-5


def expected(kind, shape, what):
    """EXPECTED's entry for a cell's `what`, or None."""
    for key in ((kind, shape, what), ("*", shape, what), (kind, "*", what)):
        if key in EXPECTED:
            return EXPECTED[key]
    return None


def data():
    """64 examples of 8 features, 3 classes: (x, y), the same everywhere."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    return x, (x[:, :3].argmax(axis=1)).astype("int32")


def _classes():
    """The user classes, defined once per process (keras imported late)."""
    global _CLASSES
    if "_CLASSES" in globals():
        return _CLASSES
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    @keras.saving.register_keras_serializable("conformance")
    class CustomStep(keras.Model):
        """A functional-style subclass with its own train_step and test_step,
        which count their steps and add a log of their own."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps_run = keras.Variable(0, dtype="int64", trainable=False,
                                            aggregation="only_first_replica", name="steps_run")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            self.steps_run.assign_add(1)
            logs = self.compute_metrics(x, y, y_pred)
            logs["custom_marker"] = tf.constant(1.0)
            return logs

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
            logs = self.compute_metrics(x, y, y_pred)
            logs["custom_test_marker"] = tf.constant(1.0)
            return logs

    @keras.saving.register_keras_serializable("conformance")
    class Lazy(keras.Model):
        """A subclassed model whose layers are built on its first call."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(6, activation="relu")
            self.top = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.top(self.hidden(x))

    class Trainable(TensorFlowTrainer, keras.layers.Dense):
        """A layer that mixes in Keras' trainer, as Keras' own tests train."""

        def __init__(self):
            keras.layers.Dense.__init__(self, 3, activation="softmax")
            TensorFlowTrainer.__init__(self)

    _CLASSES = {"custom_step": CustomStep, "lazy_subclass": Lazy, "trainer_mixin": Trainable}
    return _CLASSES


def build(kind):
    """A compiled model of `kind`, from seed 1 (the same weights everywhere)."""
    import keras

    classes = _classes()
    keras.utils.set_random_seed(1)
    if kind == "sequential":
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
    elif kind in ("functional", "custom_step"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(6, activation="relu")(inputs)
        outputs = keras.layers.Dense(3, activation="softmax")(hidden)
        cls = keras.Model if kind == "functional" else classes["custom_step"]
        model = cls(inputs, outputs)
    else:
        model = classes[kind]()
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end",
         "on_test_begin", "on_test_batch_begin", "on_test_batch_end", "on_test_end",
         "on_epoch_end", "on_train_end")


def _recorder(seen):
    """A callback that appends (hook, batch or epoch index, its logs' keys)."""
    import keras

    class Recorder(keras.callbacks.Callback):
        pass

    def hook(name):
        indexed = "batch" in name or "epoch" in name

        def call(self, *args, **kwargs):
            index = args[0] if indexed else None
            logs = kwargs.get("logs", args[1 if indexed else 0] if len(args) > indexed else None)
            seen.append([name, index, sorted(logs or {})])
        return call

    for name in HOOKS:
        setattr(Recorder, name, hook(name))
    return Recorder()


def in_batch_order(hooks):
    """`hooks` with each run of train-batch hooks put in Keras' order (begin
    b, end b, begin b + 1, ...): the parameter-server shape's callbacks
    see a step begin when it is scheduled and end when it finishes."""
    out, run = [], []
    for entry in list(hooks) + [None]:
        if entry is not None and entry[0] in ("on_train_batch_begin", "on_train_batch_end"):
            run.append(entry)
            continue
        out += sorted(run, key=lambda e: (e[1], e[0] == "on_train_batch_end"))
        run = []
        if entry is not None:
            out.append(entry)
    return out


def _outcome(do):
    try:
        return {"ok": do()}
    except Exception as error:  # noqa: BLE001  (what the cell did is the result)
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def _steps_run(model):
    variable = getattr(model, "steps_run", None)
    return None if variable is None else int(variable.numpy())


def record(kind, train, work_dir):
    """Builds a `kind` model, trains it with `train(build_fn, x, y, callbacks,
    validation_data)` (returns a History), then does each of `AFTER`.
    `work_dir`: where `save_and_load` writes. Returns a JSON-able dict."""
    import keras
    import numpy as np

    import keras_dist as kd

    x, y = data()
    seen = []
    history = train(lambda: build(kind), x, y, [_recorder(seen)], (x[:32], y[:32]))
    model = history.model
    cell = {"class": type(model).__name__, "history_keys": list(history.history),
            "epochs": len(history.history.get("loss", [])), "hooks": seen,
            "steps_run": _steps_run(model),
            "weights": [np.asarray(w).tolist() for w in model.get_weights()]}
    after = {}
    after["model.evaluate"] = _outcome(
        lambda: np.asarray(model.evaluate(x, y, batch_size=BATCH, verbose=0)).tolist())
    after["model.predict"] = _outcome(
        lambda: np.asarray(model.predict(x, batch_size=BATCH, verbose=0)).tolist())
    after["kd.evaluate"] = _outcome(
        lambda: np.asarray(kd.evaluate(model, x, y, batch_size=BATCH, verbose=0)).tolist())

    def save_and_load():
        path = os.path.join(work_dir, f"{kind}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        return {"class": type(loaded).__name__,
                "same_predictions": bool(np.allclose(
                    loaded.predict(x, verbose=0), kd.predict(model, x, verbose=0), atol=1e-6))}

    after["save_and_load"] = _outcome(save_and_load)
    before = _steps_run(model)

    def second_fit():
        again = train(model, x, y, [], None)
        steps = _steps_run(again.model)
        return {"history_keys": list(again.history), "same_model": again.model is model,
                "steps_run": None if steps is None else steps - before}

    after["second_fit"] = _outcome(second_fit)
    after["keras_fit"] = _outcome(lambda: list(model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history))
    cell["after"] = after
    return cell


def keras_train(build_fn, x, y, callbacks, validation_data):
    """The reference: Keras' own fit on one device (a model is fit again)."""
    model = build_fn() if callable(build_fn) and not hasattr(build_fn, "fit") else build_fn
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks,
                     validation_data=validation_data, shuffle=False, verbose=0)


def kd_train(strategy):
    """`train` for `record`: kd.fit under `strategy`."""
    import keras_dist as kd

    def train(build_fn, x, y, callbacks, validation_data):
        return kd.fit(build_fn, x, y, strategy=strategy, batch_size=BATCH, epochs=EPOCHS,
                      callbacks=callbacks, validation_data=validation_data, shuffle=False,
                      verbose=0)
    return train


def _same_outcome(kind, shape, op, got, want):
    """Sentences for how `got` (an AFTER outcome) departs from `want`."""
    allowed = expected(kind, shape, op)
    if "error" in got and "error" in want:
        return [] if got["error"].split(":")[0] == want["error"].split(":")[0] else [
            f"{op} raised {got['error']!r} where Keras raised {want['error']!r}"]
    if "error" in got:
        if allowed and got["error"].startswith(allowed.split(":")[0]) and \
                allowed.split(": ", 1)[-1][:30] in got["error"]:
            return []
        return [f"{op} raised {got['error']!r} where Keras' gave a result"]
    if "error" in want:
        return [f"{op} gave a result where Keras raised {want['error']!r}"]
    if allowed and re.match(r"\w+(Error|Exception): ", allowed):
        return [f"{op} gave a result where EXPECTED (and the docs) say {allowed!r}"]
    return []


def compare(cell, reference, kind, shape):
    """Every undocumented difference of `cell` from `reference` (Keras' own
    fit on one device), as sentences; [] when the cell conforms."""
    import numpy as np

    problems = []
    if (cell["class"] != reference["class"]) != bool(expected(kind, shape, "class")):
        problems.append(f"the model came back as {cell['class']} (Keras' {reference['class']}); "
                        f"EXPECTED says {expected(kind, shape, 'class')!r}")
    if cell["steps_run"] != reference["steps_run"]:
        problems.append(f"the user's train_step ran {cell['steps_run']} steps, "
                        f"Keras' {reference['steps_run']}")
    adds = bool(expected(kind, shape, "history"))

    def kept(keys):
        """`keys` less what EXPECTED says this shape adds."""
        return [k for k in keys if not (adds and k in ADDED_KEYS)]

    keys = kept(cell["history_keys"])
    if adds and not set(ADDED_KEYS) <= set(cell["history_keys"]):
        problems.append(f"History's keys {cell['history_keys']} lack what EXPECTED says "
                        "is added")
    if keys != reference["history_keys"]:
        problems.append(f"History's keys are {cell['history_keys']}, "
                        f"Keras' {reference['history_keys']}")
    if cell["epochs"] != reference["epochs"]:
        problems.append(f"History has {cell['epochs']} epochs, Keras' {reference['epochs']}")
    hooks = [[h, i, kept(logs)] for h, i, logs in cell["hooks"]]
    if expected(kind, shape, "callbacks"):
        hooks = in_batch_order(hooks)
    if hooks != reference["hooks"]:
        first = next(i for i, (a, b) in enumerate(zip(hooks + [None], reference["hooks"] + [None]))
                     if a != b)
        problems.append(f"the callbacks saw {hooks[first:first + 3]} at call {first}, "
                        f"under Keras {reference['hooks'][first:first + 3]}")
    if shape in DETERMINISTIC:
        for i, (a, b) in enumerate(zip(cell["weights"], reference["weights"])):
            if not np.allclose(a, b, atol=ATOL):
                problems.append(f"weight {i} differs from Keras' by "
                                f"{np.max(np.abs(np.subtract(a, b))):.2e}")
    for op in AFTER:
        got, want = cell["after"][op], reference["after"][op]
        problems += _same_outcome(kind, shape, op, got, want)
        if "ok" not in got or "ok" not in want:
            continue
        if op in ("model.evaluate", "kd.evaluate", "model.predict"):
            if np.shape(got["ok"]) != np.shape(want["ok"]):
                problems.append(f"{op} gave shape {np.shape(got['ok'])}, Keras' "
                                f"{np.shape(want['ok'])}")
            elif shape in DETERMINISTIC and not np.allclose(got["ok"], want["ok"], atol=1e-4):
                problems.append(f"{op} gave {got['ok']!r:.80}, Keras' {want['ok']!r:.80}")
        elif op == "save_and_load" and got["ok"] != {**want["ok"], "class": cell["class"]}:
            problems.append(f"save and load gave {got['ok']}, Keras' {want['ok']}")
        elif op == "second_fit":
            g, w = {**got["ok"], "history_keys": kept(got["ok"]["history_keys"])}, want["ok"]
            if g != w:
                problems.append(f"a second fit gave {g}, Keras' {w}")
        elif op == "keras_fit":
            if kept(got["ok"]) != want["ok"]:
                problems.append(f"Keras' own fit after it logged {got['ok']}, on one device "
                                f"{want['ok']}")
    return problems


# ------------------------------------------------------------ the docs' table
TABLE_BEGIN = "<!-- conformance matrix: written by `make conformance-table`; do not edit -->"
TABLE_END = "<!-- end of the conformance matrix -->"


def table():
    """docs/compatibility.md's matrix (Markdown), from `EXPECTED`."""
    lines = [TABLE_BEGIN, "",
             "| model kind | " + " | ".join(s.replace("_", " ") for s in SHAPES) + " |",
             "|---|" + "---|" * len(SHAPES)]
    notes = []
    for kind in KINDS:
        cells = []
        for shape in SHAPES:
            marks = []
            for what in ("class", "history", "callbacks") + AFTER:
                text = expected(kind, shape, what)
                if text is None:
                    continue
                if text not in notes:
                    notes.append(text)
                marks.append(f"{what} [{notes.index(text) + 1}]")
            cells.append("as Keras" + (" except " + ", ".join(marks) if marks else ""))
        lines.append(f"| {kind.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i}. {text}" for i, text in enumerate(notes, 1)]
    lines += ["", TABLE_END]
    return "\n".join(lines)


def write_table(path):
    """Replaces the matrix between its markers in `path`; False if unchanged."""
    with open(path) as f:
        text = f.read()
    pattern = re.escape(TABLE_BEGIN) + r".*?" + re.escape(TABLE_END)
    if not re.search(pattern, text, flags=re.S):
        raise SystemExit(f"conformance: no matrix markers in {path}")
    new = re.sub(pattern, lambda _: table(), text, flags=re.S)
    with open(path, "w") as f:
        f.write(new)
    return new != text


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/conformance.py --write")
    page = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                        "compatibility.md")
    print("conformance: docs/compatibility.md", "rewritten" if write_table(page) else "unchanged")
