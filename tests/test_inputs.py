"""What `kd.fit` reads, and when, against Keras' own `model.fit` (issue 37, items 3-5).

Each comparison trains `kd.fit` under MirroredStrategy over the two logical
CPUs of tests/conftest.py and Keras' `model.fit` on one device (no strategy)
from the same seeded model and data: the weights agree within 1e-6, the
History within 1e-6, and so do the steps of each epoch and the "ran out of
data" warnings. Keras' rule for passes over the data is its
`EpochIterator._enumerate_iterator` (keras/src/trainers/epoch_iterator.py);
`test_passes_follow_keras_epoch_iterator` pins `keras_dist.training.data.Passes` to
it directly.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.training import data as data_lib
from procs import CPUS

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def mirrored():
    return kd.resolve_strategy("mirrored", devices=CPUS)


def _data(n=80, features=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, x.sum(1, keepdims=True).astype("float32")


def _linear(features=4):
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01, momentum=0.5), "mse")
        return model
    return build


def _two_inputs(outputs=1):
    def build():
        keras.utils.set_random_seed(3)
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        hidden = keras.layers.Dense(4, name="hidden")(keras.layers.Concatenate()([a, b]))
        heads = [keras.layers.Dense(1, name="o1")(hidden),
                 keras.layers.Dense(2, name="o2")(hidden)][:outputs]
        model = keras.Model([a, b], heads if outputs > 1 else heads[0])
        model.compile(keras.optimizers.SGD(0.05), ["mse"] * outputs if outputs > 1 else "mse")
        return model
    return build


class _Steps(keras.callbacks.Callback):
    """The train steps of each epoch."""

    def on_train_begin(self, logs=None):
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


def _train(run, *args, **kwargs):
    """`(history, model, steps per epoch, 'ran out' warnings)` of one fit."""
    steps = _Steps()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, model = run(*args, callbacks=[steps], verbose=0, **kwargs)
    ran_out = sum("ran out of data" in str(w.message) for w in caught)
    return history.history, model, steps.per_epoch, ran_out


def _keras(build):
    def run(*args, **kwargs):
        model = build()
        return model.fit(*args, **kwargs), model
    return run


def _kd(build, strategy):
    def run(*args, **kwargs):
        history = kd.fit(build, *args, strategy=strategy, **kwargs)
        return history, history.model
    return run


def assert_same_training(ours, theirs, iterations=True, ran_out_warnings=True):
    """`ran_out_warnings=False` where Keras warns at the end of every pass of
    unknown length read without `steps_per_epoch` (no epoch is cut short
    there, and keras_dist stays quiet)."""
    history, model, steps, ran_out = ours
    ref_history, ref_model, ref_steps, ref_ran_out = theirs
    assert steps == ref_steps
    if ran_out_warnings:
        assert ran_out == ref_ran_out
    assert sorted(history) == sorted(ref_history)
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, rtol=0, atol=TOLERANCE, err_msg=key)
    for ours_w, ref_w in zip(model.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(ours_w, ref_w, rtol=0, atol=TOLERANCE)
    if iterations:
        assert (int(model.optimizer.iterations.numpy())
                == int(ref_model.optimizer.iterations.numpy()))


# ------------------------------------------------------------------ item 3
def test_arrays_with_steps_per_epoch_start_a_new_pass_each_epoch(mirrored):
    """Issue 37's case: 80 samples, batches of 8, steps_per_epoch=10 (one
    pass): Keras trains 4 epochs; kd.fit warned "ran out of data" and
    stopped after 2."""
    x, y = _data()
    args = dict(batch_size=8, epochs=4, steps_per_epoch=10, shuffle=False)
    ours = _train(_kd(_linear(), mirrored), x, y, **args)
    assert_same_training(ours, _train(_keras(_linear()), x, y, **args))
    assert ours[2] == [10, 10, 10, 10] and ours[3] == 0


def _batches(x, y, kind):
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if kind == "unknown_length":
        dataset = dataset.filter(lambda *_: True)
    return dataset.batch(8)


@pytest.mark.parametrize("kind,steps,epochs", [
    ("arrays", 4, 5),  # 4, 4, 2 (the pass ends: warning), 4, 4 -- the pass goes on
    ("arrays", 15, 3),  # more than a pass: a pass per epoch, a warning each
    ("dataset", 4, 4),  # known cardinality: as arrays
    ("dataset", 10, 3),
    ("unknown_length", 4, 4),  # read until dry, then a new pass
])
def test_steps_per_epoch_read_passes_as_keras(mirrored, kind, steps, epochs):
    x, y = _data()
    if kind == "arrays":
        inputs, args = (x, y), dict(batch_size=8, shuffle=False)
    else:
        inputs, args = (_batches(x, y, kind),), {}
    args.update(epochs=epochs, steps_per_epoch=steps)
    ours = _train(_kd(_linear(), mirrored), *inputs, **args)
    theirs = _train(_keras(_linear()), *inputs, **args)
    # Keras counts the step that found its iterator dry in `iterations`
    # (no update is applied: the weights agree); keras_dist does not.
    assert_same_training(ours, theirs, iterations=kind != "unknown_length")


def test_an_epoch_that_finds_its_input_dry_trains_nothing_and_training_goes_on(mirrored):
    """10 batches of unknown length, 5 steps an epoch: Keras trains 5, 5,
    then an empty epoch (its iterator was dry; loss 0.0, a warning), then a
    new pass."""
    x, y = _data()
    args = dict(epochs=4, steps_per_epoch=5)
    ours = _train(_kd(_linear(), mirrored), _batches(x, y, "unknown_length"), **args)
    theirs = _train(_keras(_linear()), _batches(x, y, "unknown_length"), **args)
    assert ours[2] == [5, 5, 0, 5]
    assert_same_training(ours, theirs, iterations=False)


def test_arrays_with_steps_per_epoch_and_no_batch_size_batch_as_keras(mirrored):
    """Keras' array adapter: batch_size = ceil(samples / steps_per_epoch)."""
    x, y = _data()
    args = dict(epochs=2, steps_per_epoch=5, shuffle=False)
    ours = _train(_kd(_linear(), mirrored), x, y, **args)
    assert_same_training(ours, _train(_keras(_linear()), x, y, **args))
    assert ours[2] == [5, 5]


@pytest.mark.parametrize("samples,batch,steps", [
    (80, 8, None), (80, 8, 10), (80, 8, 4), (80, 8, 3), (80, 8, 15), (75, 8, 7), (8, 8, 1)])
def test_passes_follow_keras_epoch_iterator(samples, batch, steps):
    """Steps per epoch and the batches each reads, from Keras' own epoch
    iterator, over 7 epochs."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    x = np.arange(samples, dtype="float32")
    theirs = EpochIterator(x=x, batch_size=batch, steps_per_epoch=steps, shuffle=False)
    theirs.reset()
    keras_epochs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(7):
            keras_epochs.append([float(data[0][0]) for _, _, data in theirs])

    dataset = tf.data.Dataset.from_tensor_slices(x).batch(batch)
    passes = data_lib.Passes(lambda index, skip: dataset.skip(skip),
                             num_batches=-(-samples // batch), steps_per_epoch=steps)
    ours, iterator = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(7):
            fresh, limit = passes.begin_epoch()
            iterator = iter(fresh) if fresh is not None else iterator
            firsts = [float(next(iterator)[0]) for _ in range(limit)]
            passes.end_epoch(ran_out=False)
            ours.append(firsts)
    assert ours == keras_epochs


def _read_epochs(passes, epochs, iterator=None):
    """The values each epoch reads, as an executor following `passes` does."""
    out = []
    for _ in range(epochs):
        fresh, limit = passes.begin_epoch()
        iterator = iter(fresh) if fresh is not None else iterator
        out.append([int(next(iterator)) for _ in range(limit)])
        passes.end_epoch(ran_out=False)
    return out, iterator


def test_a_resumed_run_reads_what_an_uninterrupted_one_reads():
    """`Passes.seek(epoch, step)`: where an uninterrupted run stands,
    also when epochs read on from one pass (10 batches, 4 an epoch)."""
    def plan():
        return data_lib.Passes(
            lambda index, skip: tf.data.Dataset.range(10).skip(skip).map(
                lambda v: v + 100 * index), num_batches=10, steps_per_epoch=4)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, _ = _read_epochs(plan(), 5)
        resumed = plan()
        iterator = iter(resumed.seek(2, 1))  # 0-based epoch 2, after its first step
        fresh, limit = resumed.begin_epoch(positioned=True)
        rest = [int(next(iterator)) for _ in range(limit - 1)]
        resumed.end_epoch(ran_out=False)
        later, _ = _read_epochs(resumed, 2, iterator)
    assert whole == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [100, 101, 102, 103],
                     [104, 105, 106, 107]]
    assert fresh is None and limit == 2 and rest == [9]
    assert later == whole[3:]


# ------------------------------------------------------------------ item 4
def _two_input_data(n=40):
    rng = np.random.default_rng(1)
    return ([rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")],
            [rng.normal(size=(n, 1)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")])


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_or_tuple_of_arrays_is_several_inputs(mirrored, container):
    """It was made one tensor: "Can't convert non-rectangular Python
    sequence to Tensor" / "Dimensions 40 and 2 are not compatible"."""
    xs, ys = _two_input_data()
    x = container(xs)
    args = dict(batch_size=8, epochs=2, shuffle=False,
                validation_data=(container(v[:16] for v in xs), ys[0][:16]))
    ours = _train(_kd(_two_inputs(), mirrored), x, ys[0], **args)
    assert_same_training(ours, _train(_keras(_two_inputs()), x, ys[0], **args))


def test_lists_of_targets_are_several_outputs(mirrored):
    xs, ys = _two_input_data()
    args = dict(batch_size=8, epochs=2, shuffle=False)
    ours = _train(_kd(_two_inputs(outputs=2), mirrored), xs, ys, **args)
    assert_same_training(ours, _train(_keras(_two_inputs(outputs=2)), xs, ys, **args))


def test_evaluate_reads_a_list_of_arrays_as_several_inputs(mirrored):
    xs, ys = _two_input_data()
    theirs = _two_inputs()()
    with mirrored.scope():
        ours = _two_inputs()()
    expected = theirs.evaluate(xs, ys[0], batch_size=8, verbose=0)
    assert kd.evaluate(ours, xs, ys[0], batch_size=8, strategy=mirrored, verbose=0) == \
        pytest.approx(expected, abs=TOLERANCE)


def test_validation_split_splits_each_array_of_a_list(mirrored):
    xs, ys = _two_input_data()
    args = dict(batch_size=8, epochs=2, shuffle=False, validation_split=0.25)
    ours = _train(_kd(_two_inputs(), mirrored), xs, ys[0], **args)
    assert_same_training(ours, _train(_keras(_two_inputs()), xs, ys[0], **args))


@pytest.mark.parametrize("x,kwargs,message", [
    ([[1.0, 2.0], [3.0, 4.0]], {}, "several inputs.*np.asarray"),
    ({1, 2}, {}, "type set is not an input keras_dist can train on"),
    (iter([np.ones((2, 4))]), {}, "type list_iterator is not an input"),
    (np.ones((8, 4)), dict(class_weight={0: 1.0}, sample_weight=np.ones(8)),
     "`class_weight` and `sample_weight` cannot both be given"),
], ids=["python_numbers", "set", "iterator", "class_and_sample_weight"])
def test_inputs_keras_refuses_are_refused_clearly(mirrored, x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kd.fit(_linear(), x, np.ones((2 if isinstance(x, list) else 8, 1), "float32"),
               strategy=mirrored, verbose=0, **kwargs)


def test_class_weight_with_several_outputs_is_refused_as_in_keras():
    with pytest.raises(ValueError, match="`class_weight` is only supported for models with "
                                         "a single output"):
        data_lib.from_arrays(np.ones((4, 2)), [np.zeros(4), np.zeros(4)], class_weight={0: 1.0})


def test_one_sample_weight_array_weights_every_output():
    """Keras' array adapter: one per-sample array is used for each output."""
    (batch,) = data_lib.from_arrays(np.ones((4, 2)), [np.zeros(4), np.zeros(4)],
                                    np.arange(4.0), batch_size=4, shuffle=False)
    _, y, weights = batch
    assert isinstance(y, tuple) and len(weights) == 2
    np.testing.assert_array_equal(weights[1], np.arange(4.0))


# ------------------------------------------------------------------ item 5
def _generator(x, y, batch=8, forever=False):
    while True:
        for start in range(0, len(x), batch):
            yield x[start:start + batch], y[start:start + batch]
        if not forever:
            return


@pytest.mark.parametrize("forever,steps", [(False, None), (True, 7)])
def test_python_generator_trains_as_keras(mirrored, forever, steps):
    """It failed with "IndexError: tuple index out of range". A finite
    generator is read once; Keras' adapter then yields again only the two
    batches it peeked at (epoch 2 is 2 steps), and so does keras_dist."""
    x, y = _data(40)
    x_before, y_before = x.copy(), y.copy()
    args = dict(epochs=3, steps_per_epoch=steps, shuffle=False)
    ours = _train(_kd(_linear(), mirrored), _generator(x, y, forever=forever), **args)
    theirs = _train(_keras(_linear()), _generator(x, y, forever=forever), **args)
    assert_same_training(ours, theirs, iterations=forever, ran_out_warnings=forever)
    assert ours[2] == ([5, 2, 2] if not forever else [7, 7, 7])
    # The generator's arrays reach tf.data without a copy; training under
    # the strategy once wrote into them (y changed, run to run).
    np.testing.assert_array_equal(x, x_before)
    np.testing.assert_array_equal(y, y_before)


class _Batches(keras.utils.PyDataset):
    """Batches of 8 by index; counts its epoch hooks."""

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y
        self.hooks = []

    def __len__(self):
        return len(self.x) // 8

    def __getitem__(self, index):
        return self.x[index * 8:(index + 1) * 8], self.y[index * 8:(index + 1) * 8]

    def on_epoch_begin(self):
        self.hooks.append("begin")

    def on_epoch_end(self):
        self.hooks.append("end")


@pytest.mark.parametrize("kwargs", [
    dict(epochs=2), dict(epochs=3, steps_per_epoch=3), dict(epochs=2, class_weight={0: 2.0})],
    ids=["passes", "steps_per_epoch", "class_weight"])
def test_py_dataset_trains_as_keras(mirrored, kwargs):
    """It failed ("setting an array element with a sequence")."""
    x, y = _data(40)
    if "class_weight" in kwargs:
        y = (y > 0).astype("float32")
    ours_data, theirs_data = _Batches(x, y), _Batches(x, y)
    ours = _train(_kd(_linear(), mirrored), ours_data, shuffle=False, **kwargs)
    theirs = _train(_keras(_linear()), theirs_data, shuffle=False, **kwargs)
    assert_same_training(ours, theirs)
    assert ours_data.hooks == theirs_data.hooks  # Keras' calls, in Keras' order


@pytest.mark.parametrize("make", ["experimental_distribute_dataset",
                                  "distribute_datasets_from_function"])
def test_distributed_dataset_trains_as_keras_on_its_dataset(mirrored, make):
    """It failed ("IndexError: tuple index out of range"); Keras' fit reads it."""
    x, y = _data(40)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    if make == "experimental_distribute_dataset":
        distributed = mirrored.experimental_distribute_dataset(dataset)
    else:
        distributed = mirrored.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(
                context.get_per_replica_batch_size(8)))
    ours = _train(_kd(_linear(), mirrored), distributed, epochs=2)
    assert_same_training(ours, _train(_keras(_linear()), dataset, epochs=2))


def test_distributed_dataset_for_other_replicas_is_refused(mirrored):
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    x, y = _data(16)
    distributed = one.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    with pytest.raises(ValueError, match="DistributedDataset for 1 replica.*trains 2"):
        kd.fit(_linear(), distributed, strategy=mirrored, verbose=0)


def test_generator_and_py_dataset_validate_and_evaluate_as_keras(mirrored):
    x, y = _data(40)
    ours = _train(_kd(_linear(), mirrored), x, y, batch_size=8, epochs=2, shuffle=False,
                  validation_data=_Batches(x[:16], y[:16]))
    theirs = _train(_keras(_linear()), x, y, batch_size=8, epochs=2, shuffle=False,
                    validation_data=_Batches(x[:16], y[:16]))
    assert_same_training(ours, theirs)
    expected = theirs[1].evaluate(_generator(x, y), verbose=0)
    assert kd.evaluate(ours[1], _generator(x, y), strategy=mirrored, verbose=0) == \
        pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("module,name", [("torch.utils.data.dataloader", "DataLoader"),
                                         ("grain._src.python.dataset", "MapDataset")])
def test_torch_and_grain_inputs_are_refused_clearly(mirrored, module, name):
    """Neither package is installed here; Keras detects them by class name,
    and so does keras_dist, which names the type and what to pass instead."""
    loader = type(name, (), {"__module__": module})()
    with pytest.raises(ValueError, match=f"is a (torch|grain) {name}.*Pass arrays.*"
                                         "tf.data.Dataset"):
        kd.fit(_linear(), loader, strategy=mirrored, verbose=0)


def test_a_py_dataset_without_end_needs_steps_per_epoch(mirrored):
    """Keras would read it forever in the first epoch."""
    class Endless(_Batches):
        num_batches = None

    x, y = _data(16)
    with pytest.raises(ValueError, match="PyDataset without an end.*steps_per_epoch"):
        kd.fit(_linear(), Endless(x, y), strategy=mirrored, verbose=0)


@pytest.mark.parametrize("kind", ["generator", "py_dataset", "distributed"])
def test_parameter_server_workers_cannot_read_python_inputs(mirrored, kind):
    x, y = _data(16)
    value = {"generator": lambda: _generator(x, y), "py_dataset": lambda: _Batches(x, y),
             "distributed": lambda: mirrored.experimental_distribute_dataset(
                 tf.data.Dataset.from_tensor_slices((x, y)).batch(8))}[kind]()
    with pytest.raises(ValueError, match="parameter-server workers cannot read.*dataset_fn"):
        data_lib.per_worker_input(None, value)


class _Hooks(keras.callbacks.Callback):
    """Every batch and epoch hook, with its index."""

    def on_train_begin(self, logs=None):
        self.calls = []

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch))


@pytest.mark.parametrize("batches", [7, 8], ids=["cut-short", "at-a-boundary"])
@pytest.mark.parametrize("where", ["one_device", "mirrored"])
def test_unknown_length_input_in_executions_shows_callbacks_what_keras_does(
        mirrored, batches, where, tmp_path):
    """Input of unknown length, steps_per_execution=2: Keras calls the hooks
    once per execution (begin 0, end 1, begin 2, ...), the last execution
    cut short by the data's end, then a begin with no end. keras_dist ran
    one step per execution and called them per step (begin 0 end 1, begin 1
    end 2, ...: overlapping), 7 times an epoch where Keras makes 4."""
    x, y = _data(n=8 * batches)

    def build():
        model = _linear()()
        model.compile(keras.optimizers.SGD(0.01, momentum=0.5), "mse", steps_per_execution=2)
        return model

    runs = {}
    for who in ("keras", "keras_dist"):
        hooks = _Hooks()
        if who == "keras":
            model = build()
            history = model.fit(_batches(x, y, "unknown_length"), epochs=2, verbose=0,
                                callbacks=[hooks])
        else:
            history = kd.fit(build, _batches(x, y, "unknown_length"), epochs=2, verbose=0,
                             strategy=mirrored if where == "mirrored" else "auto",
                             callbacks=[hooks, kd.callbacks.BackupAndRestore(
                                 str(tmp_path), save_freq=3)])  # keras_dist's loop
            model = history.model
        runs[who] = (hooks.calls, history.history, model)
    calls, history, model = runs["keras_dist"]
    ref_calls, ref_history, ref_model = runs["keras"]
    assert calls == ref_calls
    ends = [b for kind, b in ref_calls if kind == "end"]
    assert ends == [1, 3, 5, 7] * 2
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=0, atol=TOLERANCE)
    for ours_w, ref_w in zip(model.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(ours_w, ref_w, rtol=0, atol=TOLERANCE)

