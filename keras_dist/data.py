"""Input pipelines for the training loop `keras_dist` owns.

Turns what a user hands to `fit` (arrays, a `tf.data.Dataset`, or a
`dataset_fn(input_context)`) into a distributed dataset sharded the TF way,
plus the number of steps in one pass over it. Only used where Keras' own
data handling cannot be (see `keras_dist.driver`).
"""

import atexit
import dataclasses
import math
import numbers
import queue
import threading
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

DEFAULT_BATCH_SIZE = 32
DEFAULT_SHUFFLE_SEED = 1337
"""Every worker shuffles with the same seed, so the data shards are disjoint."""


@dataclasses.dataclass
class DistributedInput:
    """A distributed dataset and how many steps one pass over it takes.

    Attributes:
        dataset: The `tf.distribute` distributed dataset.
        steps: Integer or `None` when the length is unknown.
        repeats: Boolean. Whether one iterator should be kept across epochs
            (`steps_per_epoch` given) rather than a new one per epoch.
        sample: A function returning a small local batch, to create the
            optimizer's and metrics' state before the first compiled step.
        at: A function `at(epoch, step)` returning the distributed dataset
            positioned where an uninterrupted run stands before that step
            of that 0-based epoch (resuming from a mid-epoch backup), or
            `None`. With `repeats` it serves every later epoch too; without,
            only the rest of that epoch.
    """

    dataset: Any
    steps: Optional[int]
    repeats: bool = False
    sample: Any = None
    at: Any = None


def is_dataset_fn(x):
    """Whether `x` is a `dataset_fn(input_context)` rather than data."""
    return callable(x) and not isinstance(x, (tf.data.Dataset, np.ndarray, tf.Tensor))


def split_validation(arrays, validation_split):
    """Splits off the last `validation_split` fraction, as Keras does.

    Args:
        arrays: Tuple of array-likes (or nests of them) with a common first
            dimension; `None` entries stay `None`.
        validation_split: Float in `[0, 1)`.

    Returns:
        `(train_arrays, validation_arrays)`.
    """
    if not 0.0 < validation_split < 1.0:
        raise ValueError(
            "`validation_split` must be in the range (0, 1). Received: "
            f"validation_split={validation_split}."
        )
    n = num_samples(arrays)
    split_at = int(n * (1.0 - validation_split))
    if split_at in (0, n):
        raise ValueError(
            f"validation_split={validation_split} of {n} samples leaves one side "
            "empty. Use more data or a different fraction."
        )
    head = tf.nest.map_structure(
        lambda a: None if a is None else a[:split_at], arrays)
    tail = tf.nest.map_structure(
        lambda a: None if a is None else a[split_at:], arrays)
    return head, tail


def from_arrays(x, y=None, sample_weight=None, *, batch_size=None, shuffle=True,
                class_weight=None, seed=DEFAULT_SHUFFLE_SEED, repeat=False):
    """A batched `tf.data.Dataset` from arrays, with Keras' `fit` semantics.

    `batch_size` is the global batch size (as in `keras.Model.fit` under a
    strategy). Shuffling uses a fixed seed so every worker of a multi-worker
    job draws the same order and the data shards stay disjoint. With
    `repeat=True` the examples repeat forever before batching, so every batch
    is full (what asynchronous workers reading a stream want).
    """
    arrays = _training_arrays(x, y, sample_weight, class_weight)
    n = num_samples(arrays)
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle:
        dataset = dataset.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(batch_size or DEFAULT_BATCH_SIZE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    # Nothing here to tune (no parallel map, no prefetch of ours), and
    # tf.data's autotuning thread makes deleting an iterator of this dataset
    # wait for its next wake-up (the period doubles up to a minute): under
    # MultiWorkerMirroredStrategy each epoch's iterator then took up to
    # seconds to let go, and 17 short fits in a row spent most of their time
    # idle (benchmarks/iterator_release.py).
    options.autotune.enabled = False
    return dataset.with_options(options)


def _training_arrays(x, y, sample_weight, class_weight):
    """`(x[, y[, sample_weight]])`, the class weights folded into the sample weights."""
    if class_weight is not None:
        if y is None:
            raise ValueError("`class_weight` needs targets `y`; received y=None.")
        weights = class_weight_to_sample_weight(y, class_weight)
        sample_weight = weights if sample_weight is None else (
            np.asarray(sample_weight, "float32") * weights)
    return (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)


def epoch_stream(x, y=None, sample_weight=None, *, batch_size=None, shuffle=True,
                 class_weight=None, seed=DEFAULT_SHUFFLE_SEED, first_epoch=0, epochs=None,
                 skip=0):
    """Batches of arrays, epoch after epoch, each epoch's order a function of
    `(seed, epoch)` alone.

    The batches `fit` trains on, as `from_arrays` would give them one epoch
    at a time (the global batch size, the last batch of an epoch partial),
    but seekable: a run resumed at step `skip` of epoch `first_epoch` in a
    new process reads exactly the batches an uninterrupted run reads from
    there on. (`from_arrays` reshuffles on each new iterator: its n-th
    epoch's order depends on how many iterators came before.) Each epoch is
    a stateless permutation of the indices
    (`tf.random.experimental.stateless_shuffle`), and skipping is cheap: it
    skips index batches before the examples are gathered.

    Args:
        first_epoch: Integer. The 0-based epoch the stream starts at.
        epochs: Integer or `None` (forever). How many epochs it holds.
        skip: Integer. Batches of `first_epoch` skipped.

    Example:

    >>> import numpy as np
    >>> from keras_dist.data import epoch_stream
    >>> x = np.arange(5.0)
    >>> whole = [b.numpy().tolist() for (b,) in epoch_stream(x, batch_size=2, epochs=2)]
    >>> len(whole), sorted(sum(whole[:3], []))   # epoch 0: 3 batches, every example once
    (6, [0.0, 1.0, 2.0, 3.0, 4.0])
    >>> resumed = [b.numpy().tolist() for (b,) in epoch_stream(
    ...     x, batch_size=2, first_epoch=1, epochs=1, skip=1)]
    >>> resumed == whole[4:]
    True
    """
    arrays = _training_arrays(x, y, sample_weight, class_weight)
    n = num_samples(arrays)
    batch_size = batch_size or DEFAULT_BATCH_SIZE
    tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)

    def epoch_indices(epoch):
        indices = tf.range(n, dtype=tf.int64)
        if shuffle:
            indices = tf.random.experimental.stateless_shuffle(
                indices, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
        return tf.data.Dataset.from_tensor_slices(indices).batch(batch_size)

    last = -1 if epochs is None else first_epoch + epochs
    stream = tf.data.Dataset.range(first_epoch, last) if epochs is not None else \
        tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max)
    stream = stream.flat_map(epoch_indices).skip(skip)
    if epochs is not None:
        per_epoch = math.ceil(n / batch_size)
        stream = stream.apply(tf.data.experimental.assert_cardinality(
            max(0, per_epoch * epochs - skip)))
    stream = stream.map(lambda idx: tf.nest.map_structure(
        lambda a: tf.gather(a, idx), tensors))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    options.autotune.enabled = False  # see from_arrays
    return stream.with_options(options)


class _Releaser:
    """Drops the last reference to finished input iterators on its own thread.

    Deleting a `tf.data` iterator waits for its autotuning thread to notice,
    and that thread can be asleep for up to a minute. Under MirroredStrategy
    every distributed iterator has autotuned per-device pipelines, whatever
    the options of the dataset it came from, so letting go of one epoch's
    iterator now and then left the training thread idle for 2 to 85 seconds
    (seen with `kd.fit` on 2 CPU replicas: one epoch boundary in ~20 fits).
    TensorFlow deletes a tensor with the GIL released, so here the wait
    happens beside training instead of in it.
    """

    _STOP = object()

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._stopped = False
        self._lock = threading.Lock()

    def release(self, obj):
        with self._lock:
            if self._stopped:  # the interpreter is exiting: delete it here
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keras_dist-iterator-release", daemon=True)
                self._thread.start()
                atexit.register(self._drain)
            self._queue.put(obj)

    def _run(self):
        while True:
            obj = self._queue.get()
            if obj is self._STOP:
                return
            del obj  # the last reference: the iterator's destructor runs here

    def _drain(self):
        """At exit, before the interpreter stops its daemon threads: one
        stopped in the middle of TensorFlow's destructor could abort the
        process (a training script would then exit non-zero)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._queue.put(self._STOP)
        thread.join()


_releaser = _Releaser()


def release_iterator(iterator):
    """Lets go of `iterator` on keras_dist's release thread (see `_Releaser`).

    The caller must drop its own references right after, e.g.
    `release_iterator(self._it); self._it = None`. `None` is ignored.
    """
    if iterator is not None:
        _releaser.release(iterator)


def class_weight_to_sample_weight(y, class_weight):
    """Per-example weights from a `{class_index: weight}` dict."""
    y = np.asarray(y)
    labels = np.argmax(y, axis=-1) if y.ndim > 1 and y.shape[-1] > 1 else y.reshape(-1)
    labels = labels.astype("int64")
    missing = sorted(set(np.unique(labels)) - set(class_weight))
    if missing:
        raise ValueError(
            f"`class_weight` has no entry for class(es) {missing[:10]}. Received "
            f"class_weight keys: {sorted(class_weight)}. Give every class a weight."
        )
    lookup = np.zeros(int(max(max(class_weight), labels.max())) + 1, "float32")
    for label, weight in class_weight.items():
        lookup[int(label)] = weight
    return lookup[labels]


def distribute(strategy, x, y=None, sample_weight=None, *, batch_size=None,
               shuffle=True, class_weight=None, steps=None, what="x", stream=False):
    """Builds the `DistributedInput` for `x` (and `y`, `sample_weight`).

    Args:
        strategy: `tf.distribute.Strategy` to shard for.
        x: Arrays (or a dict / tuple of them), a `tf.data.Dataset` yielding
            `(x, y[, sample_weight])` batches of the global batch size, or a
            `dataset_fn(input_context)` returning per-replica batches.
        steps: Integer or `None`. `steps_per_epoch` / `validation_steps`.
        what: String. Argument name used in errors.
        stream: Boolean. Training input: arrays become an `epoch_stream`
            (one iterator for every epoch, each epoch's order fixed by its
            number), and the result can be positioned (`at`) for a run
            resumed mid-epoch.
    """
    check_steps(steps)
    if is_dataset_fn(x):
        check_nothing_beside_dataset(y, sample_weight, class_weight, what)
        if steps is None:
            raise ValueError(
                f"`{what}` is a dataset_fn, whose length keras_dist cannot know "
                "in advance; pass `steps_per_epoch` (and `validation_steps` for "
                "validation) and make the dataset repeat."
            )
        dataset = strategy.distribute_datasets_from_function(x)

        def at(epoch, step):
            def skipped(context):  # each pipeline feeds its replicas one batch a step
                per_step = max(1, context.num_replicas_in_sync // context.num_input_pipelines)
                return x(context).skip((epoch * steps + step) * per_step)
            return strategy.distribute_datasets_from_function(skipped)

        return DistributedInput(dataset, steps, repeats=True,
                                sample=lambda: next(iter(x(tf.distribute.InputContext()))),
                                at=at)
    if isinstance(x, tf.data.Dataset):
        check_nothing_beside_dataset(y, sample_weight, class_weight, what)
        if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
            x = readable_here(x)  # the parameter-server chief evaluating
        dataset = x
        sample = lambda: first_batch(x)  # noqa: E731
    else:
        if y is not None and num_samples((x,)) != num_samples((y,)):
            raise ValueError(
                f"`{what}` and `y` have different numbers of samples: "
                f"{num_samples((x,))} and {num_samples((y,))}. Pass one target "
                "per input."
            )
        if stream:
            return _array_stream(strategy, x, y, sample_weight, batch_size=batch_size,
                                 shuffle=shuffle, class_weight=class_weight, steps=steps)
        dataset = from_arrays(x, y, sample_weight, batch_size=batch_size,
                              shuffle=shuffle, class_weight=class_weight)
        sample = lambda: next(iter(dataset.take(1)))  # noqa: E731
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY and steps is None:
        raise ValueError(
            f"`{what}` is a dataset that repeats forever; pass `steps_per_epoch` "
            "(or `validation_steps`) so keras_dist knows where an epoch ends."
        )
    known = cardinality if cardinality >= 0 else None
    distributed = strategy.experimental_distribute_dataset(dataset)

    def at(epoch, step):
        # One iterator for every epoch (`steps` given): the batches before;
        # one pass per epoch: that epoch's first `step`. Exact when the
        # dataset's order does not depend on how often it was iterated
        # before (docs/fault-tolerance.md).
        skip = epoch * steps + step if steps is not None else step
        return strategy.experimental_distribute_dataset(dataset.skip(skip))

    if steps is not None:
        return DistributedInput(distributed, steps, repeats=True, sample=sample, at=at)
    return DistributedInput(distributed, known, repeats=False, sample=sample, at=at)


def _array_stream(strategy, x, y, sample_weight, *, batch_size, shuffle, class_weight, steps):
    """Training arrays as an `epoch_stream`: every epoch (or, with `steps`,
    one pass read across epochs, Keras' rule), positioned at will."""
    epochs = None if steps is None else 1

    def stream(epoch=0, step=0):
        if steps is None:
            first, skip = epoch, step
        else:
            first, skip = 0, epoch * steps + step
        return epoch_stream(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                            class_weight=class_weight, first_epoch=first, epochs=epochs,
                            skip=skip)

    dataset = stream()
    per_epoch = math.ceil(num_samples((x,)) / (batch_size or DEFAULT_BATCH_SIZE))
    return DistributedInput(
        strategy.experimental_distribute_dataset(dataset),
        steps if steps is not None else per_epoch, repeats=True,
        sample=lambda: next(iter(dataset.take(1))),
        at=lambda epoch, step: strategy.experimental_distribute_dataset(stream(epoch, step)))


def check_nothing_beside_dataset(y, sample_weight, class_weight, what="x"):
    """A dataset (or dataset_fn) yields targets and weights itself."""
    for name, value in (("y", y), ("sample_weight", sample_weight),
                        ("class_weight", class_weight)):
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `{what}` is a tf.data.Dataset or a "
                "dataset_fn (the dataset yields targets and weights). Received "
                "a value for it.")


def num_samples(arrays):
    sizes = {int(np.shape(a)[0]) for a in tf.nest.flatten(arrays) if a is not None}
    if len(sizes) != 1:
        raise ValueError(
            "All inputs must have the same number of samples (first dimension). "
            f"Received sizes: {sorted(sizes)}."
        )
    return sizes.pop()


@dataclasses.dataclass
class PerWorkerInput:
    """What asynchronous workers read: a per-worker dataset (or its function).

    Attributes:
        dataset: A `tf.data.Dataset`, a `dataset_fn()` building one on each
            worker, or a distributed dataset from a `dataset_fn(context)`;
            for `ClusterCoordinator.create_per_worker_dataset`.
        steps: Integer. Updates per epoch, all workers together.
        sample: A small batch, to create optimizer and metric state.
    """

    dataset: Any
    steps: int
    sample: Any


def readable_here(dataset):
    """`dataset`, or a copy this process can iterate when it cannot.

    A `tf.data.Dataset` created before this process connected to a
    parameter-server cluster lives on `/job:localhost`, which no longer exists
    once connected (TensorFlow: `unknown device`). Workers still read it (the
    coordinator sends them its graph) and so does any transformation applied
    after connecting: the chief reads it through `take(-1)`, which passes
    every element on unchanged.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.data import readable_here
    >>> ds = tf.data.Dataset.range(3)
    >>> readable_here(ds) is ds   # readable: returned as it is
    True
    """
    try:
        iter(dataset)
    except tf.errors.InvalidArgumentError as error:
        if "unknown device" not in str(error):
            raise
        return dataset.take(-1)
    return dataset


def first_batch(dataset):
    """The first element of `dataset`, read in this process.

    Read through `take(1)`, a transformation made here and now: that also
    reads a dataset created before this process connected to a
    parameter-server cluster (see `readable_here`).

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.data import first_batch
    >>> first_batch(tf.data.Dataset.range(3).batch(2)).numpy()
    array([0, 1])
    """
    return next(iter(dataset.take(1)))


def per_worker_input(strategy, x, y=None, sample_weight=None, *, batch_size=None,
                     shuffle=True, class_weight=None, steps=None):
    """Builds the `PerWorkerInput` for asynchronous training.

    Arrays are read by each worker whole, in its own random order (in
    asynchronous training no step boundary needs agreeing on), repeating so
    every batch is full; `steps` defaults to one pass over them
    (`ceil(samples / batch_size)`). A dataset or `dataset_fn` needs
    `steps` unless its length is known.
    """
    check_steps(steps)
    if isinstance(x, tf.data.Dataset) or is_dataset_fn(x):
        check_nothing_beside_dataset(y, sample_weight, class_weight)
    if is_dataset_fn(x):
        if steps is None:
            raise ValueError(
                "`x` is a dataset_fn, whose length keras_dist cannot know; pass "
                "`steps_per_epoch` (updates per epoch, all workers together).")
        distributed = strategy.distribute_datasets_from_function(x)
        sample = next(iter(x(tf.distribute.InputContext())))
        return PerWorkerInput(distributed, steps, sample)
    if isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        if steps is None:
            if cardinality < 0:
                raise ValueError(
                    "`x` is a tf.data.Dataset of unknown or infinite length; pass "
                    "`steps_per_epoch` (updates per epoch, all workers together).")
            steps = cardinality
        # A dataset object is serialized to every worker by the coordinator.
        repeated = x.repeat() if cardinality != tf.data.INFINITE_CARDINALITY else x
        return PerWorkerInput(repeated, steps, first_batch(x))
    if y is not None and num_samples((x,)) != num_samples((y,)):
        raise ValueError(
            f"`x` and `y` have different numbers of samples: {num_samples((x,))} and "
            f"{num_samples((y,))}. Pass one target per input.")
    batch_size = batch_size or DEFAULT_BATCH_SIZE
    steps = steps or math.ceil(num_samples((x,)) / batch_size)

    @tf.autograph.experimental.do_not_convert  # plain tf.data calls: nothing to convert
    def dataset_fn():  # built on the worker: the arrays travel as constants
        return from_arrays(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                           class_weight=class_weight, seed=None, repeat=True)

    sample = (x[:2],) if y is None else (x[:2], y[:2])
    return PerWorkerInput(dataset_fn, steps, sample)


def check_steps(steps, what="steps_per_epoch"):
    """`steps_per_epoch` / `validation_steps` / `steps`: `None` or an integer >= 1
    (the rule of `check_fit_counts`)."""
    check_fit_counts(**{what: steps})


def unpack_validation(validation_data):
    """`(x, y, sample_weight)` of `validation_data`, checked."""
    if isinstance(validation_data, tf.data.Dataset) or is_dataset_fn(validation_data):
        return validation_data, None, None
    if not isinstance(validation_data, (tuple, list)) or not 2 <= len(validation_data) <= 3:
        length = len(validation_data) if hasattr(validation_data, "__len__") else "?"
        raise ValueError(
            "`validation_data` must be a tf.data.Dataset, a dataset_fn, or a "
            "tuple (x_val, y_val) or (x_val, y_val, val_sample_weight). "
            f"Received: {type(validation_data).__name__} of length {length}.")
    return (tuple(validation_data) + (None,))[:3]


def check_validation_freq(validation_freq):
    """An integer >= 1 or a collection of epoch numbers (1-based), as in Keras."""
    if isinstance(validation_freq, bool) or (
            isinstance(validation_freq, int) and validation_freq < 1):
        raise ValueError(
            f"`validation_freq` must be an integer >= 1 or a list of epochs. "
            f"Received: validation_freq={validation_freq!r}.")


# fit()'s counting arguments: (name, smallest allowed, whether None is allowed).
_COUNTS = (("batch_size", 1, True), ("epochs", 0, False), ("initial_epoch", 0, False),
           ("steps_per_epoch", 1, True), ("validation_steps", 1, True),
           ("validation_batch_size", 1, True), ("steps", 1, True))


def check_fit_counts(**kwargs):
    """Rejects a non-integer or too small `batch_size`, `epochs`, ... early.

    Keras' `fit` accepts `batch_size=0` or `epochs=-3` and then trains
    nothing or fails deep inside; keras_dist says which value is wrong
    before any strategy or cluster is touched. Arguments not passed are not
    checked; integer-valued NumPy scalars are integers.

    Example:

    >>> check_fit_counts(batch_size=32, epochs=0, steps_per_epoch=None)
    >>> check_fit_counts(batch_size=0)
    Traceback (most recent call last):
    ...
    ValueError: `batch_size` must be an integer >= 1 or None. Received: batch_size=0.
    """
    for name, smallest, none_ok in _COUNTS:
        if name not in kwargs:
            continue
        value = kwargs[name]
        if value is None and none_ok:
            continue
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                or value < smallest):
            allowed = f"an integer >= {smallest}" + (" or None" if none_ok else "")
            hint = ""
            if isinstance(value, float) and value.is_integer():
                hint = f" Pass int({value!r})."
            raise ValueError(f"`{name}` must be {allowed}. Received: {name}={value!r}.{hint}")
    if "validation_freq" in kwargs:
        check_validation_freq(kwargs["validation_freq"])


def should_eval(epoch, validation_freq):
    """Whether validation runs after 0-based `epoch` (Keras' rule)."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
