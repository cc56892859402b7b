"""What happens to gradients between `train_step` and the optimizer.

- `global_gradient_apply` gives synchronous replicas Keras' one-device
  semantics: gradient clipping on the global gradient
  (`clipping_for_replicas` divides the thresholds while a step is traced),
  and the loss of a batch split unevenly over replicas averaged over the
  global batch.
- `ship_gradients` sends a step's gradients to the one parameter server
  that holds every weight (`home_device`) in one transfer per dtype.
- `scale_gradients`, `identity_all` and `all_finite`: dense and sparse
  (`IndexedSlices`) gradients alike.
"""

import contextlib

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training.update import optimizer_chain


def global_gradient_apply(optimizer, examples, policy, synced=None):
    """A sync hook giving replicas Keras' one-device update.

    Each replica's loss is its local mean scaled by 1 / replicas (Keras'
    `scale_loss_for_distribution`); with a batch split unevenly (33 over 2)
    that is not the global mean. The hook rescales each replica's gradient by
    `replicas * local_examples / global_examples`, which makes their sum the
    gradient of the global mean (exact for the default `sum_over_batch_size`
    reduction; the factor is 1 for even splits).

    Keras clips (`clipnorm`, `clipvalue`, `global_clipnorm`) inside `apply`,
    before its own all-reduce, i.e. each replica's share. When any optimizer
    of the chain clips, the hook all-reduces the gradients first and hands
    each replica `global / replicas` with the thresholds divided by the
    number of replicas (`clipping_for_replicas`, around the trace), so the
    clipped sum is the clipped global gradient
    (`clip(g / R, c / R) = clip(g, c) / R`; exact for 2 or 4 replicas,
    within one rounding otherwise).

    The finite check and the global batch size travel in one small
    all-reduce, so every replica takes the same skip decision. It is the
    first point where the replicas meet: when `synced` is a list, the hook
    appends the time that all-reduce returned on this replica (each replica
    reads its own clock, so the time it waited there for the others is
    free of clock differences between hosts).
    """
    def hook(original, grads, variables):
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        local_bad = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
        finite = tf.equal(local_bad, 0.0)
        if replicas > 1:
            local = tf.cast(examples, tf.float32)
            total_examples, total_bad = tf.unstack(context.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.stack([local, local_bad])))
            if synced is not None:
                with tf.control_dependencies([total_examples]):
                    synced.append(tf.timestamp())
            factor = tf.math.divide_no_nan(local * replicas, total_examples)
            grads = scale_gradients(grads, factor)
            finite = tf.equal(total_bad, 0.0)
            if _clips(optimizer):
                grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
                grads = scale_gradients(grads, 1.0 / replicas)
        policy.apply(original, grads, variables, finite=finite, optimizer=optimizer)

    return hook


_CLIP_ARGS = ("clipnorm", "clipvalue", "global_clipnorm")


def _clips(optimizer):
    return any(getattr(o, a, None) for o in optimizer_chain(optimizer) for a in _CLIP_ARGS)


@contextlib.contextmanager
def clipping_for_replicas(optimizer, replicas):
    """Divides the chain's clipping thresholds by `replicas` in the block.

    Wraps the (single-threaded) call that traces a synchronous step, so
    every replica's trace sees the same thresholds; see
    `global_gradient_apply`.
    """
    saved = []
    if replicas > 1 and _clips(optimizer):
        for o in optimizer_chain(optimizer):
            for name in _CLIP_ARGS:
                value = getattr(o, name, None)
                if value:
                    saved.append((o, name, value))
                    setattr(o, name, value / replicas)
    try:
        yield
    finally:
        for o, name, value in saved:
            setattr(o, name, value)




def all_finite(grads):
    """A boolean scalar: whether every gradient is finite."""
    flags = [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def scale_gradients(grads, scale):
    """Multiplies dense and sparse (`IndexedSlices`) gradients by `scale`."""
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype),
                                        g.indices, g.dense_shape))
        else:
            out.append(g * tf.cast(scale, g.dtype))
    return out


def home_device(variables):
    """The one device every variable of `variables` lives on, else `None`.

    `None` as well for a `ShardedVariable` (several devices), an empty list,
    or a variable without a device string.

    Example:

    >>> import keras
    >>> from keras_dist.training.gradients import home_device
    >>> layer = keras.layers.Dense(2)
    >>> layer.build((None, 3))
    >>> home_device(layer.trainable_variables).endswith("CPU:0")
    True
    """
    devices = set()
    for variable in variables:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        try:
            device = value.device
        except (AttributeError, ValueError, NotImplementedError):
            return None
        if not isinstance(device, str) or not device:
            return None
        devices.add(device)
    return devices.pop() if len(devices) == 1 else None


class Packed:
    """Tensors flattened into one vector where this is built, to be split
    back (`unpack`) on another device: one transfer between the two instead
    of one per tensor.

    Numeric tensors travel bit for bit in one vector of the narrowest numeric
    dtype among them, wider ones bitcast into it (an int64 counter rides in
    a float32 vector as two float32s); bool tensors go in one vector of their
    own; `None`, sparse (`IndexedSlices`) and not fully shaped ones pass as
    they are. Build it under the sending device's scope and call `unpack`
    under the receiving one's.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training.gradients import Packed
    >>> packed = Packed([tf.ones((2, 3)), tf.constant(7, tf.int64), None])
    >>> with tf.device("/CPU:0"):
    ...     weights, count, nothing = packed.unpack()
    >>> tuple(weights.shape), int(count), nothing
    ((2, 3), 7, None)
    """

    def __init__(self, tensors):
        self._items = list(tensors)
        groups = {}
        for i, t in enumerate(self._items):
            if not (tf.is_tensor(t) and not isinstance(t, tf.IndexedSlices)
                    and t.shape.is_fully_defined()):
                continue
            if t.dtype == tf.bool:
                groups.setdefault(tf.bool, []).append(i)
            elif t.dtype.is_floating or t.dtype.is_integer:
                groups.setdefault("numeric", []).append(i)
        numeric = groups.pop("numeric", [])
        self.carrier = min((self._items[i].dtype for i in numeric), key=lambda d: d.size,
                           default=None)
        if numeric:
            groups[self.carrier] = numeric
        self._groups = groups
        self._flats = {}
        for dtype, indices in groups.items():
            pieces = []
            for i in indices:
                t = tf.reshape(self._items[i], [-1])
                if t.dtype != dtype:
                    t = tf.reshape(tf.bitcast(t, dtype), [-1])
                pieces.append(t)
            self._flats[dtype] = tf.concat(pieces, axis=0)

    @property
    def transfers(self):
        """How many tensors cross between the devices (packed vectors and
        the tensors that pass as they are)."""
        packed = {i for indices in self._groups.values() for i in indices}
        return len(self._flats) + sum(1 for i, t in enumerate(self._items)
                                      if i not in packed and t is not None)

    def unpack(self):
        """The tensors, split back from the packed vectors in the current
        device scope (the others as they were given)."""
        out = list(self._items)
        for dtype, indices in self._groups.items():
            items = [self._items[i] for i in indices]
            ratios = [t.dtype.size // dtype.size for t in items]
            parts = tf.split(self._flats[dtype],
                             [t.shape.num_elements() * r for t, r in zip(items, ratios)])
            for i, t, ratio, part in zip(indices, items, ratios, parts):
                if t.dtype != dtype:
                    part = tf.bitcast(part if ratio == 1 else tf.reshape(part, [-1, ratio]),
                                      t.dtype)
                out[i] = tf.reshape(part, t.shape)
        return out


def ship_gradients(grads, device, extra=None):
    """`grads` as tensors on `device`, sent in one transfer (`Packed`).

    Each gradient consumed on a parameter server is otherwise a transfer of
    its own. Here the dense gradients are flattened into one vector where
    they were computed, and split back on `device`, so the update's math
    there reads local tensors. `None`, sparse (`IndexedSlices`) and not
    fully shaped gradients are left as they are. `extra`, a float64 vector
    (a step's report), rides along bit for bit in the same transfer.

    Returns:
        `(grads, extra)`, both on `device` (`extra` is `None` without one).

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training.gradients import ship_gradients
    >>> grads = [tf.ones((2, 3)), None, tf.zeros((3,))]
    >>> shipped, extra = ship_gradients(grads, "/CPU:0", tf.constant([0.1], tf.float64))
    >>> [None if g is None else tuple(g.shape) for g in shipped], float(extra[0])
    ([(2, 3), None, (3,)], 0.1)
    """
    grads = list(grads)
    items = grads + ([tf.cast(extra, tf.float64)] if extra is not None else [])
    packed = Packed(items)
    with tf.device(device):
        out = packed.unpack()
    return out[:len(grads)], (out[-1] if extra is not None else None)


def identity_all(grads):
    return [None if g is None
            else tf.nest.map_structure(tf.identity, g, expand_composites=True)
            for g in grads]


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g
