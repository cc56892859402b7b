"""Variables split into shards by `ParameterServerStrategy`'s partitioner.

`tf.distribute.ParameterServerStrategy(..., variable_partitioner=...)`
creates a large variable as a `ShardedVariable`: several `tf.Variable`s,
one slice of the first axis each, placed round-robin over the parameter
servers. Keras 3 wraps it like any other (`keras.Variable` on the
TensorFlow backend), and three things then fail:

- **gradients**: `tf.GradientTape.gradient` asks a source variable for its
  `handle`; a `ShardedVariable` has one per shard and no `handle`;
- **optimizer state**: Keras' TF optimizer creates each slot inside
  `strategy.extended.colocate_vars_with(variable)`, and
- **updates**: it applies each through `strategy.extended.update(variable,
  ...)`; both colocate with the variable, which TF refuses for a
  `ShardedVariable` ("doesn't support being used as a reference").

There is no public route around these, so this module -- the one place that
does it, like `keras_dist.training.stateless` for `stateless_apply` -- adapts the
pieces, each only where a `ShardedVariable` is involved (everything else goes
to TF's own code unchanged):

- `install(strategy)` gives *that strategy object* (instance attributes, not
  TF's classes) an `extended.update` that calls the update function directly
  on a `ShardedVariable` (under parameter servers there is one replica per
  worker: nothing to merge), an `extended.colocate_vars_with` that creates a
  variable colocated with a sharded one as the same shards, each on its own
  shard's parameter server (so optimizer slots are sharded like their
  variables), and a variable creator hook that marks every new
  `ShardedVariable` (`mark`).
- `mark(variable)` gives one `ShardedVariable` a `handle` whose gradient is
  the shards' gradients put together -- a dense tensor of the full shape, or
  one `tf.IndexedSlices` with global row ids when a shard's gradient is
  sparse (an embedding lookup) -- so `tape.gradient` returns what it returns
  for an unsharded variable, and Keras' clipping, loss scaling and the
  user's `train_step` see the same thing; plus `read_value()` and
  `__array__` (saving).
- `prepare(model)` makes each `keras.layers.Embedding` look rows up shard by
  shard (`tf.nn.embedding_lookup` over the shards, TF's "div" layout, which
  is the partitioner's; a gather on an unsharded table): a step reads only
  the rows it needs, and the gradient is sparse, so SGD writes only those
  rows (`scatter_*` on each shard).

`prepare` also has Keras' elementwise optimizers (SGD, Adam, AdamW,
RMSprop, Adagrad, ...) run their own `update_step` shard by shard, each on
its shard's parameter server with that shard of every slot, as TF colocates
an unsharded variable's update with it: only the gradient travels. Other
optimizers (and weight decay, EMA, gradient accumulation) update the whole
variable on the worker, reading and writing each shard where it lives
(`ShardedVariable.assign_*`): exact as well, with more traffic.

This module is the adapter; the private TF and Keras names it needs (the
`ShardedVariable` type, the composite-gradient protocol, the strategy's
variable creator, a Keras variable's backing variable, Keras' nested layers
and the TF optimizer's per-distribution update and slot index) are each
reached through `keras_dist._compat`, which says why each has no public
route. tests/test_sharded.py exercises each path against Keras' own results,
so a change in either library shows there.

Saving reads the shards together (`numpy()`), so `.keras` files and
`save_weights` files hold whole tensors, and loading splits them again:
they load under any number of parameter servers, or none.

Example:

>>> import keras, keras_dist as kd
>>> kd.sharded.is_sharded(keras.Variable([1.0, 2.0]))
False
"""

import contextlib
import functools

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import update

ShardedVariable = _compat.ShardedVariable


def is_sharded(variable):
    """Whether `variable` (a `keras.Variable` or a `tf.Variable`) is split
    into shards by a `variable_partitioner`.

    Example:

    >>> import keras, numpy as np, keras_dist as kd
    >>> kd.sharded.is_sharded(keras.Variable(np.zeros((3, 2))))
    False
    """
    return isinstance(_compat.backend_variable(variable), ShardedVariable)


def shards(variable):
    """The `tf.Variable` shards of a variable, in row order (one, the
    variable itself, when it is not sharded).

    Example:

    >>> import keras, numpy as np, keras_dist as kd
    >>> len(kd.sharded.shards(keras.Variable(np.zeros((5, 2)))))
    1
    """
    value = _compat.backend_variable(variable)
    if not isinstance(value, ShardedVariable):
        return [value]
    return list(value.variables)


def row_offsets(variable):
    """The first row of each shard of a sharded variable.

    Example:

    >>> import keras, numpy as np, keras_dist as kd
    >>> kd.sharded.row_offsets(keras.Variable(np.zeros((5, 2))))
    [0]
    """
    if not is_sharded(variable):
        return [0]
    offsets, row = [], 0
    for shard in shards(variable):
        offsets.append(row)
        row += shard.shape[0]
    return offsets


class _ShardedGradient:
    """`tape.gradient` protocol (`__composite_gradient__`): differentiate
    with respect to each shard, return one gradient for the whole."""

    def get_gradient_components(self, value):
        return [shard.handle for shard in value.variable.variables]

    def replace_gradient_components(self, value, grads):
        variable = value.variable
        if all(g is None for g in grads):
            return None
        parts = variable.variables
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            indices, values = [], []
            for offset, g, part in zip(row_offsets(variable), grads, parts):
                if g is None:
                    continue
                if not isinstance(g, tf.IndexedSlices):
                    g = tf.IndexedSlices(g, tf.range(part.shape[0], dtype=tf.int64))
                indices.append(tf.cast(g.indices, tf.int64) + offset)
                values.append(g.values)
            return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                    dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
        grads = [tf.zeros(p.shape, p.dtype) if g is None else g for g, p in zip(grads, parts)]
        return tf.concat(grads, axis=0)


class _ShardedHandle(_compat.CompositeHandle, gradient=_ShardedGradient()):
    """What `tape.gradient` sees as a sharded variable's handle: the shards'
    handles, with the gradient protocol above."""


def mark(variable):
    """Lets Keras use one `ShardedVariable`: a gradient `handle`,
    `read_value()` and `__array__` (instance attributes). Idempotent."""
    if _compat.overrides(variable, "handle"):
        return variable

    def read_value():
        return tf.convert_to_tensor(variable)

    def to_array(dtype=None, copy=None):
        array = variable.numpy()
        return array if dtype is None else array.astype(dtype)

    return _compat.override(variable, handle=_ShardedHandle(variable), read_value=read_value,
                            __array__=to_array)


def install(strategy):
    """Lets Keras 3's optimizers create state for and update the sharded
    variables of `strategy` (a `ParameterServerStrategy`); see the module
    docstring. Idempotent; changes only this strategy object, and only for
    `ShardedVariable`s.

    Example:

    >>> import tensorflow as tf, keras_dist as kd
    >>> strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    >>> kd.sharded.install(strategy) is strategy
    True
    """
    extended = strategy.extended
    if _compat.overrides(extended, "_kd_sharded"):
        return strategy
    update, colocate, create = (extended.update, extended.colocate_vars_with,
                                _compat.strategy_variable_creator(extended))

    def update_sharded(var, fn, args=(), kwargs=None, group=True):
        if isinstance(var, ShardedVariable):
            # One replica per worker under parameter servers: the function
            # runs as it would inside TF's update, on the whole variable;
            # its reads and writes reach each shard where it lives.
            return fn(var, *args, **(kwargs or {}))
        return update(var, fn, args=args, kwargs=kwargs, group=group)

    def colocate_sharded(colocate_with_variable):
        if isinstance(colocate_with_variable, ShardedVariable):
            return _shaped_like(colocate, colocate_with_variable)
        return colocate(colocate_with_variable)

    def create_marked(next_creator, **kwargs):
        variable = create(next_creator, **kwargs)
        if isinstance(variable, ShardedVariable):
            mark(variable)
        return variable

    _compat.set_strategy_variable_creator(extended, create_marked)
    _compat.override(extended, update=update_sharded, colocate_vars_with=colocate_sharded,
                     _kd_sharded=True)
    return strategy


@contextlib.contextmanager
def _shaped_like(colocate, reference):
    """Variables created in this block are sharded like `reference`: one
    slice per shard, each colocated with its shard."""
    inside = []

    def creator(next_creator, **kwargs):
        if inside:  # a shard being created
            return next_creator(**kwargs)
        initial = kwargs.get("initial_value")
        value = initial() if callable(initial) else initial
        value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
        if value.shape != reference.shape:
            raise ValueError(
                f"A variable colocated with the sharded variable {reference.name!r} "
                f"{reference.shape} must have its shape; got {value.shape}.")
        name = kwargs.get("name")
        parts = []
        inside.append(True)
        try:
            for i, (offset, shard) in enumerate(zip(row_offsets(reference), reference.variables)):
                part = dict(kwargs, initial_value=value[offset:offset + shard.shape[0]], shape=None)
                if name:
                    part["name"] = f"{name}/part_{i}"
                with colocate(shard):
                    parts.append(tf.Variable(**part))
        finally:
            inside.pop()
        return mark(ShardedVariable(parts, name=name or "ShardedVariable"))

    with tf.variable_creator_scope(creator):
        yield


def prepare(model):
    """Readies `model` for training on parameter servers: marks its sharded
    variables (in case they were created before `install`), has elementwise
    optimizers update them shard by shard, and makes each
    `keras.layers.Embedding` read only the rows it needs (sharded or not:
    Keras' `ops.take` reads the whole table, which on a parameter server
    means sending all of it each step). Returns the sharded variables'
    paths. Idempotent.

    Example:

    >>> import keras, keras_dist as kd
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> kd.sharded.prepare(model)
    []
    """
    paths = []
    for variable in model.variables:
        if is_sharded(variable):
            mark(_compat.backend_variable(variable))
            paths.append(variable.path)
    optimizer = getattr(model, "optimizer", None)
    for variable in (optimizer.variables if optimizer is not None else ()):
        if is_sharded(variable):
            mark(_compat.backend_variable(variable))
    for candidate in update.optimizer_chain(optimizer):
        if type(candidate) in _ELEMENTWISE:
            _compat.override_distributed_update_step(
                candidate, lambda original, candidate=candidate: functools.partial(
                    _update_step_per_shard, candidate, original))
    for layer in _compat.sublayers(model):
        if (type(layer).call is keras.layers.Embedding.call
                and not getattr(layer, "lora_enabled", False)
                and not getattr(layer, "quantization_mode", None)
                and getattr(layer, "embeddings", None) is not None  # built
                and not _compat.overrides(layer, "call")):
            _compat.override(layer, call=functools.partial(_embedding_call, layer))
    return paths


def _embedding_call(layer, inputs):
    """`keras.layers.Embedding.call` reading only the rows asked for (from
    each shard of a sharded table): the same result as Keras' `ops.take`,
    negative ids counted from the end."""
    table = layer.embeddings.value
    if isinstance(table, ShardedVariable):
        params = list(table.variables)
    elif isinstance(table, tf.Variable):
        params = [table]  # a gather on the variable: its server sends the rows
    else:
        # In a StatelessScope (local steps: the worker's own copy, a tensor)
        # or autocast: Keras' own lookup on that tensor.
        return keras.layers.Embedding.call(layer, inputs)
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    rows = tf.cast(table.shape[0], ids.dtype)
    ids = tf.where(ids < 0, ids + rows, ids)
    outputs = tf.nn.embedding_lookup(params, ids)
    return keras.ops.cast(outputs, layer.compute_dtype)


# Keras optimizers whose update of a variable is elementwise (each entry of
# the new variable and slots depends only on the same entry): updating each
# shard on its own gives exactly the whole update. Not Lamb (a per-variable
# trust ratio), Adafactor (row / column statistics), Muon (whole matrices)
# nor subclasses, which may change `update_step`: those update the whole
# variable on the worker (exact too, with more traffic).
_ELEMENTWISE = tuple(getattr(keras.optimizers, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl",
    "Lion") if hasattr(keras.optimizers, name))


def _update_step_per_shard(optimizer, original, distribution, grads_and_vars, learning_rate):
    """The optimizer's `_distributed_tf_update_step` with each sharded
    variable updated shard by shard, on the shard's own parameter server
    (TF colocates an unsharded variable's update with it the same way): the
    update reads and writes one shard of the variable and of each slot
    there, and only the gradient travels."""
    rest = []
    for grad, var in grads_and_vars:
        if isinstance(var, ShardedVariable) and grad is not None:
            _update_shards(optimizer, grad, var, learning_rate)
        else:
            rest.append((grad, var))
    return original(distribution, rest, learning_rate)


def _update_shards(optimizer, grad, var, learning_rate):
    offsets = row_offsets(var)
    # The slots sharded like `var` (other variables' slots with the same
    # layout too: `update_step` reads only this variable's).
    slots = [v for v in optimizer.variables
             if is_sharded(v) and row_offsets(v) == offsets and v.shape == var.shape]
    parts = _split_gradient(grad, offsets, var.variables)
    for i, (shard, part) in enumerate(zip(var.variables, parts)):
        _compat.alias_optimizer_variable(optimizer, var, shard)
        whole = [_compat.backend_variable(slot) for slot in slots]
        try:
            for slot, value in zip(slots, whole):
                _compat.set_backend_variable(slot, value.variables[i])
            with tf.device(shard.device):
                optimizer.update_step(part, shard, learning_rate)
        finally:
            for slot, value in zip(slots, whole):
                _compat.set_backend_variable(slot, value)


def _split_gradient(grad, offsets, parts):
    """One gradient per shard: row slices, or the sparse rows of each shard
    (with shard-local row ids)."""
    if not isinstance(grad, tf.IndexedSlices):
        return [grad[offset:offset + part.shape[0]] for offset, part in zip(offsets, parts)]
    indices = tf.cast(grad.indices, tf.int64)
    starts = tf.constant(offsets, tf.int64)
    shard = tf.reduce_sum(tf.cast(indices[:, None] >= starts[None, 1:], tf.int32), axis=1)
    local = indices - tf.gather(starts, shard)
    ids = tf.dynamic_partition(local, shard, len(parts))
    values = tf.dynamic_partition(grad.values, shard, len(parts))
    return [tf.IndexedSlices(v, i, dense_shape=tf.constant([p.shape[0]] + p.shape[1:].as_list(), tf.int64))
            for v, i, p in zip(values, ids, parts)]
