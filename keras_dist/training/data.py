"""Input pipelines for the training loop `keras_dist` owns.

Turns what a user hands to `fit` (arrays or a list / tuple / dict of them, a
`tf.data.Dataset`, a `dataset_fn(input_context)`, a Python generator, a
`keras.utils.PyDataset`, or a `tf.distribute.DistributedDataset`) into a
distributed dataset sharded the TF way, plus the number of steps in one pass
over it and `Passes`, Keras' rule for which pass each epoch reads. Only used
where Keras' own data handling cannot be (see `keras_dist.training.driver`).
"""

import atexit
import dataclasses
import logging
import math
import numbers
import queue
import threading
import time
import types
import warnings
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat
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
            only the rest of that epoch. With `passes`, it is `passes.seek`.
        passes: `Passes` or `None`. Training: which pass over the input
            each epoch reads and how many steps it takes (Keras' rule); an
            executor that follows it takes its iterators from it and ignores
            `dataset` and `repeats`.
    """

    dataset: Any
    steps: Optional[int]
    repeats: bool = False
    sample: Any = None
    at: Any = None
    passes: Any = None


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
    unsplittable = sorted({type(a).__name__ for a in tf.nest.flatten(arrays)
                           if not _is_array_like(a)})
    if unsplittable:
        raise ValueError(
            "`validation_split` is only supported for arrays (NumPy arrays, tensors, "
            f"or lists / tuples / dicts of them). Received: {', '.join(unsplittable)}. "
            "Pass `validation_data` instead.")
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
    return _shardable(dataset.batch(batch_size or DEFAULT_BATCH_SIZE))


def _training_arrays(x, y, sample_weight, class_weight):
    """`(x[, y[, sample_weight]])` as Keras' array adapter packs them
    (`keras/src/trainers/data_adapters/array_data_adapter.py`): a list is a
    structure (several inputs or outputs, made a tuple), never one tensor; one
    `sample_weight` array weights every output of a nested `y`; the class
    weights become the sample weights."""
    x, y, sample_weight = keras.tree.lists_to_tuples((x, y, sample_weight))
    if sample_weight is not None and class_weight is not None:
        raise ValueError(
            "`class_weight` and `sample_weight` cannot both be given (Keras' fit refuses "
            "them together too). Multiply the class weights into `sample_weight`.")
    if sample_weight is not None and keras.tree.is_nested(y):
        if keras.tree.is_nested(sample_weight):
            try:
                keras.tree.assert_same_structure(y, sample_weight)
            except (ValueError, TypeError):
                raise ValueError(
                    "Pass one `sample_weight` array per output in `y`: their structures "
                    f"differ. Received: y with {len(tf.nest.flatten(y))} arrays and "
                    f"sample_weight with {len(tf.nest.flatten(sample_weight))}.") from None
        else:
            shape = np.shape(sample_weight)
            if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
                raise ValueError(
                    "With several outputs, a single `sample_weight` array must hold one "
                    f"weight per sample (shape `(samples,)`). Received shape {shape}; pass "
                    "one array per output for other weights.")
            sample_weight = keras.tree.map_structure(lambda _: sample_weight, y)
    if class_weight is not None:
        if y is None:
            raise ValueError("`class_weight` needs targets `y`; received y=None.")
        if keras.tree.is_nested(y):
            raise ValueError(
                "`class_weight` is only supported for models with a single output "
                f"(as in Keras). Received y with {len(tf.nest.flatten(y))} outputs; pass "
                "`sample_weight` (one array per output) instead.")
        sample_weight = class_weight_to_sample_weight(y, class_weight)
    return (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)


def _is_array_like(value):
    """Keras' `can_slice_array`: `None`, a tensor, or anything with `__array__`."""
    return value is None or tf.is_tensor(value) or hasattr(value, "__array__")


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
    >>> from keras_dist.training.data import epoch_stream
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
    return _shardable(stream.map(lambda idx: tf.nest.map_structure(
        lambda a: tf.gather(a, idx), tensors)))


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

    A destructor may also never return (an iterator over a Python generator
    that waits forever). One such iterator must not hold up every later one
    of the process (their memory is freed only here): when each release
    thread has been inside one destructor for `STUCK` seconds, the next
    release starts another thread, up to `MAX_THREADS`.
    """

    _STOP = object()
    STUCK = 5.0
    MAX_THREADS = 8
    NAME = "keras_dist-iterator-release"

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._threads = []
        self._busy_since = {}  # thread -> when it entered the destructor it is in
        self._stopped = False
        self._lock = threading.Lock()

    def release(self, obj):
        with self._lock:
            if self._stopped:  # the interpreter is exiting: delete it here
                return
            if not self._threads:
                atexit.register(self._drain)
            self._threads = [t for t in self._threads if t.is_alive()]
            now = time.monotonic()
            stuck = [t for t in self._threads
                     if now - self._busy_since.get(t, now) >= self.STUCK]
            if len(stuck) == len(self._threads) < self.MAX_THREADS:
                thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)
                self._threads.append(thread)
                thread.start()
            self._queue.put(obj)

    def _run(self):
        me = threading.current_thread()
        while True:
            obj = self._queue.get()
            if obj is self._STOP:
                return
            self._busy_since[me] = time.monotonic()
            del obj  # the last reference: the iterator's destructor runs here
            self._busy_since.pop(me, None)

    def _drain(self, timeout=10.0):
        """At exit, before the interpreter stops its daemon threads: one
        stopped in the middle of TensorFlow's destructor could abort the
        process (a training script would then exit non-zero). At most
        `timeout` seconds in all: an iterator whose destructor never returns
        (one over a Python generator that waits forever) kept a process from
        exiting at all."""
        with self._lock:
            self._stopped = True
            threads = [t for t in self._threads if t.is_alive()]
        for _ in threads:
            self._queue.put(self._STOP)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            logging.getLogger("keras_dist").warning(
                "keras_dist: an input iterator was still being released %.0f s after the "
                "program ended; exiting without waiting for it", timeout)


_releaser = _Releaser()


def release_iterator(iterator):
    """Lets go of `iterator` on keras_dist's release thread (see `_Releaser`).

    The caller must drop its own references right after, e.g.
    `release_iterator(self._it); self._it = None`. `None` is ignored.
    """
    if iterator is not None:
        _releaser.release(iterator)


_RAN_OUT = (
    "Your input ran out of data: an epoch read fewer than its steps_per_epoch={steps} "
    "batches, and the next epoch starts a new pass over the input (Keras' rule). Make "
    "sure that your dataset or generator can generate at least `steps_per_epoch * "
    "epochs` batches. You may need to use the `.repeat()` function when building your "
    "dataset.")


class Passes:
    """Which pass over the input each epoch of `fit` reads: Keras 3's rule.

    Keras' epoch iterator (`keras/src/trainers/epoch_iterator.py`,
    `EpochIterator._enumerate_iterator`) reads the input one pass (one
    iterator) at a time, and running out of data never ends training:

    - Without `steps_per_epoch`, every epoch starts a new pass and reads it
      to its end.
    - With `steps_per_epoch` and a known pass length (arrays, a dataset of
      known cardinality, a `keras.utils.PyDataset` with a length), an epoch
      reads at most `steps_per_epoch` batches and goes on with the pass the
      epoch before left; a pass that ends inside an epoch ends that epoch
      early (with Keras' "ran out of data" warning), and the next epoch
      starts a new pass. 10 batches a pass and `steps_per_epoch=4` train
      epochs of 4, 4, 2, 4, ...; `steps_per_epoch=10`: a whole pass each
      epoch; 15: 10 each epoch, with the warning.
    - With `steps_per_epoch` and an unknown length (a Python generator, a
      filtered dataset), epochs read on from one iterator until it runs
      dry; that epoch ends there (with the warning) and the next starts a
      new pass.

    An executor calls `begin_epoch` before and `end_epoch` after each epoch;
    `seek` positions a resumed run where an uninterrupted one would stand.

    Args:
        make_pass: Function `make_pass(index, skip)` returning an iterable
            (a distributed dataset) over pass `index` (0-based) from its
            batch `skip` on; with `continuous`, going on into the passes
            after it.
        num_batches: Integer or `None` (unknown). Batches in one pass.
        steps_per_epoch: Integer or `None`. `fit`'s `steps_per_epoch`.
        continuous: Boolean. Whether one iterator of `make_pass` reads every
            later pass too (a stream of passes); otherwise each pass needs
            a new one. Defaults to `False`.
        adapter: `None`, or an object with `on_epoch_begin()` and
            `on_epoch_end()` (Keras' data adapter of a `PyDataset`), called
            at each epoch's begin and end as Keras calls them.

    Example:

    >>> from keras_dist.training.data import Passes
    >>> passes = Passes(lambda index, skip: f"pass {index}", num_batches=10,
    ...                 steps_per_epoch=4)
    >>> passes.begin_epoch()            # a new pass: an iterator from it
    ('pass 0', 4)
    >>> passes.end_epoch(ran_out=False)
    >>> passes.begin_epoch()            # read on from the same iterator
    (None, 4)
    >>> passes.end_epoch(ran_out=False)
    >>> passes.begin_epoch()            # the 2 batches left of the pass
    (None, 2)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     passes.end_epoch(ran_out=False)
    >>> "ran out of data" in str(caught[0].message)
    True
    >>> passes.begin_epoch()
    ('pass 1', 4)
    """

    def __init__(self, make_pass, num_batches, steps_per_epoch, continuous=False,
                 adapter=None):
        self._make = make_pass
        self.num_batches = num_batches
        self.steps_per_epoch = steps_per_epoch
        self.continuous = continuous
        self._adapter = adapter
        self._restart()

    def _restart(self):
        self._pass = -1  # the pass being read
        self._seen = 0  # its batches read by the end of the current epoch
        self._open = False  # an iterator over it is being read (and not dry)
        self._pass_done = False  # every batch of it is read (known length)
        self._steps = None  # the current epoch's steps
        self._short = False  # the current epoch ends with its pass, early

    def _advance(self):
        """Keras' bookkeeping at an epoch's start. Returns `(new_pass,
        offset)`: whether the epoch starts a new pass, and the batches of
        its pass read before it."""
        new_pass = not self._open or self.steps_per_epoch is None or self._pass_done
        if new_pass:
            self._pass, self._seen, self._pass_done = self._pass + 1, 0, False
        offset = self._seen
        steps = self.steps_per_epoch or self.num_batches  # None: until the data ends
        if self.num_batches is not None and steps is not None:
            steps = min(steps, self.num_batches - offset)
        self._short = self.steps_per_epoch is not None and steps < self.steps_per_epoch
        self._steps = steps
        self._seen = offset + (steps or 0)
        return new_pass, offset

    def begin_epoch(self, positioned=False):
        """Returns `(fresh, steps)` for the epoch about to run.

        Args:
            positioned: Boolean. `seek` has given this epoch's iterator.

        Returns:
            `fresh`: an iterable to take a new iterator from, or `None` to
            read on from the current one; `steps`: at most this many steps
            (`None`: until the data ends).
        """
        if self._adapter is not None:
            self._adapter.on_epoch_begin()
        if positioned:
            return None, self._steps
        reopen = not self._open
        new_pass, _ = self._advance()
        self._open = True
        fresh = None
        if new_pass and (reopen or not self.continuous):
            fresh = self._make(self._pass, 0)
        return fresh, self._steps

    def end_epoch(self, ran_out):
        """Records the end of the epoch: `ran_out` when its iterator ran dry
        before the epoch's steps (the next epoch then starts a new pass)."""
        if ran_out:
            self._open = False
        if self.steps_per_epoch is not None and (ran_out or self._short):
            warnings.warn(_RAN_OUT.format(steps=self.steps_per_epoch), stacklevel=3)
        self._pass_done = self.num_batches is not None and self._seen >= self.num_batches
        if self._adapter is not None:
            self._adapter.on_epoch_end()

    def seek(self, epoch, step):
        """An iterable over what an uninterrupted run reads from `step` of
        0-based `epoch` on (its data running dry nowhere before); the next
        `begin_epoch(positioned=True)` is that epoch."""
        self._restart()
        for done in range(epoch + 1):
            new_pass, offset = self._advance()
            self._open = True
            if done < epoch:
                self._pass_done = (self.num_batches is not None
                                   and self._seen >= self.num_batches)
        return self._make(self._pass, offset + step)


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

    Each input is read as Keras' `fit` reads it (its data adapters): a list
    or tuple of arrays is several inputs (or outputs), a generator's or
    `PyDataset`'s batches are global batches split over the replicas like a
    dataset's, and `Passes` says which pass each epoch reads.

    Args:
        strategy: `tf.distribute.Strategy` to shard for.
        x: Arrays (or a list / tuple / dict of them), a `tf.data.Dataset`
            yielding `(x, y[, sample_weight])` batches of the global batch
            size, a `dataset_fn(input_context)` returning per-replica
            batches, a Python generator or a `keras.utils.PyDataset` of
            global batches, or a `tf.distribute.DistributedDataset` made by
            `strategy`.
        steps: Integer or `None`. `steps_per_epoch` / `validation_steps`.
            For arrays without `batch_size`, the batch size is then
            `ceil(samples / steps)` (Keras' rule).
        what: String. Argument name used in errors.
        stream: Boolean. Training input: arrays become an `epoch_stream`
            (one iterator for every epoch, each pass's order fixed by its
            number), and the result can be positioned (`at`) for a run
            resumed mid-epoch.

    Raises:
        ValueError: for an input keras_dist cannot read (a torch
            `DataLoader`, a grain dataset, any other type), naming its type
            and what to pass instead.
    """
    check_steps(steps)
    kind = _input_kind(x, what)
    if kind == "arrays":
        return _distribute_arrays(strategy, x, y, sample_weight, batch_size=batch_size,
                                  shuffle=shuffle, class_weight=class_weight, steps=steps,
                                  what=what, stream=stream)
    check_nothing_beside_dataset(y, sample_weight,
                                 None if kind == "py_dataset" else class_weight, what,
                                 kind=_KIND_NAMES[kind])
    adapter = None
    if kind == "dataset_fn":
        if steps is None:
            raise ValueError(
                f"`{what}` is a dataset_fn, whose length keras_dist cannot know "
                "in advance; pass `steps_per_epoch` (and `validation_steps` for "
                "validation) and make the dataset repeat."
            )
        distributed = strategy.distribute_datasets_from_function(x)

        def make_pass(index, skip):
            if not skip:
                return distributed

            def skipped(context):  # each pipeline feeds its replicas one batch a step
                per_step = max(1, context.num_replicas_in_sync // context.num_input_pipelines)
                return x(context).skip(skip * per_step)
            return strategy.distribute_datasets_from_function(skipped)

        sample = lambda: next(iter(x(tf.distribute.InputContext())))  # noqa: E731
        cardinality = _cardinality(distributed)
    elif kind == "distributed":
        distributed = x
        sample = _local_sample(strategy, x, what)
        sample()  # refuses a dataset made for other replicas now, not mid-build
        cardinality = _cardinality(x)
        make_pass = lambda index, skip: x if not skip else _Advanced(x, skip)  # noqa: E731
    else:
        if kind == "dataset":
            if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
                x = readable_here(x)  # the parameter-server chief evaluating
            local = x
            sample = lambda: first_batch(x)  # noqa: E731
        else:  # a generator or a PyDataset, read by Keras' own data adapter
            adapter = _compat.keras_data_adapter(x, class_weight=class_weight, shuffle=shuffle)
            if kind == "py_dataset" and adapter.num_batches is None and steps is None:
                raise ValueError(
                    f"`{what}` is a PyDataset without an end (`num_batches` is None); "
                    "pass `steps_per_epoch` (or `validation_steps`) so keras_dist knows "
                    "where an epoch ends.")
            adapter.on_epoch_end()  # Keras resets its epoch iterator before training
            local = _shardable(_owned(adapter.get_tf_dataset()))
            sample = _adapter_sample(x, adapter, kind)
        distributed = strategy.experimental_distribute_dataset(local)
        cardinality = _cardinality(local) if adapter is None else adapter.num_batches

        def make_pass(index, skip):
            return distributed if not skip else strategy.experimental_distribute_dataset(
                local.skip(skip))

    if cardinality == tf.data.INFINITE_CARDINALITY and steps is None:
        raise ValueError(
            f"`{what}` is a dataset that repeats forever; pass `steps_per_epoch` "
            "(or `validation_steps`) so keras_dist knows where an epoch ends."
        )
    known = cardinality if cardinality is not None and cardinality >= 0 else None
    passes = Passes(make_pass, known, steps, adapter=adapter if kind == "py_dataset" else None)
    return DistributedInput(distributed, steps if steps is not None else known, sample=sample,
                            at=passes.seek, passes=passes)


def _distribute_arrays(strategy, x, y, sample_weight, *, batch_size, shuffle, class_weight,
                       steps, what, stream):
    if y is not None and num_samples((x,)) != num_samples((y,)):
        raise ValueError(
            f"`{what}` and `y` have different numbers of samples: "
            f"{num_samples((x,))} and {num_samples((y,))}. Pass one target "
            "per input."
        )
    samples = num_samples((x,))
    if not batch_size:  # Keras' ArrayDataAdapter: the steps set the batch size
        batch_size = math.ceil(samples / steps) if steps else DEFAULT_BATCH_SIZE
    if stream:
        return _array_stream(strategy, x, y, sample_weight, batch_size=batch_size,
                             shuffle=shuffle, class_weight=class_weight, steps=steps)
    dataset = from_arrays(x, y, sample_weight, batch_size=batch_size,
                          shuffle=shuffle, class_weight=class_weight)
    distributed = strategy.experimental_distribute_dataset(dataset)
    per_pass = math.ceil(samples / batch_size)

    def make_pass(index, skip):  # a new iterator: a new pass, reshuffled
        return distributed if not skip else strategy.experimental_distribute_dataset(
            dataset.skip(skip))

    passes = Passes(make_pass, per_pass, steps)
    return DistributedInput(distributed, steps if steps is not None else per_pass,
                            sample=lambda: next(iter(dataset.take(1))), at=passes.seek,
                            passes=passes)


def _array_stream(strategy, x, y, sample_weight, *, batch_size, shuffle, class_weight, steps):
    """Training arrays as an `epoch_stream`: one iterator reads pass after
    pass (`Passes` says where each epoch ends), positioned at will."""
    def stream(first_pass=0, skip=0):
        return epoch_stream(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                            class_weight=class_weight, first_epoch=first_pass, skip=skip)

    dataset = stream()
    distributed = strategy.experimental_distribute_dataset(dataset)

    def make_pass(index, skip):
        if not index and not skip:
            return distributed
        return strategy.experimental_distribute_dataset(stream(index, skip))

    per_pass = math.ceil(num_samples((x,)) / batch_size)
    passes = Passes(make_pass, per_pass, steps, continuous=True)
    return DistributedInput(
        distributed, steps if steps is not None else per_pass,
        sample=lambda: next(iter(dataset.take(1))), at=passes.seek, passes=passes)


_KIND_NAMES = {
    "dataset": "a tf.data.Dataset", "dataset_fn": "a dataset_fn",
    "distributed": "a tf.distribute.DistributedDataset", "generator": "a Python generator",
    "py_dataset": "a keras.utils.PyDataset",
}

_INPUTS = (
    "arrays (or a list / tuple / dict of them), a tf.data.Dataset, a "
    "dataset_fn(input_context), a Python generator, a keras.utils.PyDataset, or a "
    "tf.distribute.DistributedDataset")


def _class_from(x, names, module):
    """Whether a class of `x`'s is one of `names` from a module under
    `module` (Keras' test for torch and grain types, which are not imported)."""
    return any(c.__name__ in names and c.__module__.startswith(module)
               for c in type(x).__mro__)


def _input_kind(x, what="x"):
    """`"arrays"`, `"dataset"`, `"dataset_fn"`, `"distributed"`,
    `"generator"` or `"py_dataset"`; raises for anything else."""
    if isinstance(x, tf.data.Dataset):
        return "dataset"
    if isinstance(x, tf.distribute.DistributedDataset):
        return "distributed"
    if isinstance(x, keras.utils.PyDataset):
        return "py_dataset"
    if isinstance(x, types.GeneratorType):
        return "generator"
    for library, names, module in (("torch", ("DataLoader",), "torch.utils.data"),
                                   ("grain", ("MapDataset", "IterDataset", "DataLoader"),
                                    "grain")):
        if _class_from(x, names, module):
            raise ValueError(
                f"`{what}` is a {library} {type(x).__name__}, which keras_dist does not "
                "read across replicas (Keras' own loop does on one device). Pass "
                f"{_INPUTS} instead: e.g. a tf.data.Dataset or keras.utils.PyDataset "
                "yielding the same batches.")
    if is_dataset_fn(x):
        return "dataset_fn"
    leaves = tf.nest.flatten(keras.tree.lists_to_tuples(x))
    odd = sorted({type(a).__name__ for a in leaves if not _is_array_like(a)})
    if odd:
        hint = ""
        if all(isinstance(a, (numbers.Number, str, bytes)) for a in leaves):
            hint = (" A list is several inputs (one array each), as in Keras; for one "
                    "input from nested Python lists, pass `np.asarray(...)`.")
        raise ValueError(
            f"`{what}` of type {type(x).__name__} is not an input keras_dist can train on "
            f"(it holds {', '.join(odd)}). Pass {_INPUTS}.{hint}")
    return "arrays"


def _cardinality(dataset):
    """The number of batches of a (distributed) dataset: an integer, or
    `tf.data.INFINITE_CARDINALITY` / `UNKNOWN_CARDINALITY`, or `None`."""
    value = getattr(dataset, "cardinality", None)
    if callable(value):
        value = value()
    return None if value is None else int(value)


def _shardable(dataset):
    """`dataset` with the options of keras_dist's own pipelines: sharded by
    data across workers, and no autotuning.

    Nothing in them to tune (no parallel map, no prefetch of ours), and
    tf.data's autotuning thread makes deleting an iterator of such a dataset
    wait for its next wake-up (the period doubles up to a minute): under
    MultiWorkerMirroredStrategy each epoch's iterator then took up to
    seconds to let go, and 17 short fits in a row spent most of their time
    idle (benchmarks/iterator_release.py).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    options.autotune.enabled = False
    return dataset.with_options(options)


def _owned(dataset):
    """`dataset` with every dense tensor copied into memory of its own.

    A generator's or `PyDataset`'s NumPy batches enter `tf.data` without a
    copy, and TensorFlow may then reuse that memory in place for a later
    op's result: training under MirroredStrategy wrote into the user's own
    `y` array (and into the batches Keras keeps to yield again), changing
    what later epochs trained on from run to run.
    """
    def copy(value):
        return tf.raw_ops.DeepCopy(x=value) if isinstance(value, tf.Tensor) else value

    if isinstance(dataset.element_spec, tuple):
        return dataset.map(lambda *batch: tuple(tf.nest.map_structure(copy, batch)))
    return dataset.map(lambda batch: tf.nest.map_structure(copy, batch))


def _adapter_sample(x, adapter, kind):
    """A function returning a first batch of a generator or `PyDataset`
    without taking anything from what training reads: a generator's first
    batch is kept by its adapter, a `PyDataset` is indexed."""
    def sample():
        if kind == "generator":
            batch = next(iter(adapter.get_numpy_iterator()))
        else:
            batch = x[0]
            batch = (batch,) if isinstance(batch, np.ndarray) else (
                tuple(batch) if isinstance(batch, list) else batch)
        # Copies (see `_owned`): the build must not write into the user's arrays.
        return tf.nest.map_structure(lambda a: a if a is None else np.array(a), batch)
    return sample


def _local_sample(strategy, dataset, what):
    """A function returning this process's first replica's share of
    `dataset`'s first batch (read once, then kept), refusing a distributed
    dataset made for another number of replicas."""
    kept = []

    def sample():
        if not kept:
            batch = next(iter(dataset))
            counts = {len(strategy.experimental_local_results(v))
                      for v in tf.nest.flatten(batch)} or {1}
            replicas = len(strategy.extended.worker_devices)
            if counts != {replicas}:
                raise ValueError(
                    f"`{what}` is a tf.distribute.DistributedDataset for "
                    f"{sorted(counts)[0]} replica(s) in this process, but the strategy "
                    f"trains {replicas} here. Make it with the strategy passed to "
                    "keras_dist (`strategy.experimental_distribute_dataset(...)`), or pass "
                    "the tf.data.Dataset itself.")
            kept.append(tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0], batch))
        return kept[0]
    return sample


class _Advanced:
    """A distributed dataset read from its batch `skip` on (it has no
    `skip`): each iterator of it is advanced that far."""

    def __init__(self, dataset, skip):
        self._dataset, self._skip = dataset, skip

    def __iter__(self):
        iterator = iter(self._dataset)
        for _ in range(self._skip):
            try:
                next(iterator)
            except StopIteration:
                break
        return iterator


def check_nothing_beside_dataset(y, sample_weight, class_weight, what="x",
                                 kind="a tf.data.Dataset or a dataset_fn"):
    """A dataset (or dataset_fn, generator, ...) yields targets and weights itself."""
    for name, value in (("y", y), ("sample_weight", sample_weight),
                        ("class_weight", class_weight)):
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `{what}` is {kind} (it yields the targets "
                "and weights itself). Received a value for it.")


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
    >>> from keras_dist.training.data import readable_here
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
    >>> from keras_dist.training.data import first_batch
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
    kind = _input_kind(x)
    if kind in ("generator", "py_dataset", "distributed"):
        raise ValueError(
            f"`x` is {_KIND_NAMES[kind]} ({type(x).__name__}), which parameter-server "
            "workers cannot read: each worker builds its own input from what the chief "
            "sends it (a dataset's graph or arrays), and a Python object of this process "
            "cannot be sent. Pass arrays, a tf.data.Dataset, or a "
            "dataset_fn(input_context) that builds the input on each worker.")
    if kind in ("dataset", "dataset_fn"):
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

    sample = tf.nest.map_structure(lambda a: a[:2], _training_arrays(x, y, None, None))
    return PerWorkerInput(dataset_fn, steps, sample)


def check_steps(steps, what="steps_per_epoch"):
    """`steps_per_epoch` / `validation_steps` / `steps`: `None` or an integer >= 1
    (the rule of `check_fit_counts`)."""
    check_fit_counts(**{what: steps})


def unpack_validation(validation_data):
    """`(x, y, sample_weight)` of `validation_data`, checked."""
    if isinstance(validation_data, (tf.data.Dataset, tf.distribute.DistributedDataset,
                                    keras.utils.PyDataset, types.GeneratorType)) or (
            is_dataset_fn(validation_data)):
        return validation_data, None, None
    if not isinstance(validation_data, (tuple, list)) or not 2 <= len(validation_data) <= 3:
        length = len(validation_data) if hasattr(validation_data, "__len__") else "?"
        raise ValueError(
            "`validation_data` must be a tf.data.Dataset, a dataset_fn, a Python "
            "generator, a keras.utils.PyDataset, a tf.distribute.DistributedDataset, or a "
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
