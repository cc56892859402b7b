"""absl flags for training scripts: one set of switches for `keras_dist.fit`.

`define_flags()` at the top of a script defines them (the groups are in
`GROUPS`); in `main`, `strategy_from_flags()` comes first, before any
TensorFlow op; `wrap_optimizer(...)` goes into the model's `compile`, and
`kd.fit(..., **fit_kwargs(strategy=strategy))` takes the rest. Then
`--strategy=mirrored`, `--staleness=dcasgd --max_staleness=8`,
`--local_steps=4` or `--straggler_threshold=0.2 --tensorboard_dir=/tmp/tb`
change the training without touching the script. docs/flags.md has a whole
script and the table of flags; `examples/train_digits.py` is one.

With every flag at its default, `fit_kwargs()` gives `kd.fit`'s own defaults.
Neither importing this module nor `define_flags` imports TensorFlow or Keras,
so a script's `--help` answers at once: the strategy names and the wrappers'
defaults are kept here as constants (`tests/test_flags.py` checks them against
`kd.StrategyKind` and the constructors). TensorFlow comes with the three calls
that build things, and nothing here creates a tensor before
`strategy_from_flags`, so MultiWorkerMirroredStrategy can still be created
first. Those calls also quiet TensorFlow's Python INFO logs, which absl's
`app.run` turns on, unless the user asked for them with `--verbosity` / `-v`
(see `_quiet_tensorflow`).

Example:

>>> from absl import flags
>>> from keras_dist import flags as kd_flags
>>> fv = flags.FlagValues()
>>> _ = kd_flags.define_flags(fv)
>>> _ = fv(["train.py", "--strategy=default", "--straggler_threshold=0.2"])
>>> kwargs = kd_flags.fit_kwargs(fv)
>>> kwargs["strategy"], [type(c).__name__ for c in kwargs["callbacks"]]
('default', ['StragglerDetector'])
"""

import inspect
import logging
import os
import sys

from absl import flags as absl_flags

__all__ = ["define_flags", "fit_kwargs", "strategy_from_flags", "wrap_optimizer"]

FLAGS = absl_flags.FLAGS

STALENESS_WRAPPERS = {
    "scaled": "StalenessScaled",
    "dynsgd": "DynSGD",
    "dcasgd": "DCASGD",
    "gap_aware": "GapAware",
    "delay_adaptive": "DelayAdaptive",
    "ringmaster": "Ringmaster",
}
"""`--staleness` short name -> class in `keras_dist.optimizers` (`none`: no wrapper)."""

OUTER_OPTIMIZERS = ("nesterov", "delayed_nesterov")
"""`--outer_optimizer` choices: a Nesterov `SGD`, or `DelayedNesterov`."""

# What the flags take from classes that import TensorFlow, copied here so that
# defining the flags imports none of them; tests/test_flags.py checks each
# against its source (`test_define_time_constants_match_their_sources`).
_STRATEGY_KINDS = ("default", "one_device", "mirrored", "multi_worker", "parameter_server")
"""`kd.StrategyKind`'s values, in its order."""
_NONFINITE_MODES = ("skip", "raise")  # keras_dist.training.nonfinite.MODES
_DCASGD_MODES = ("constant", "adaptive")  # keras_dist.optimizers.dcasgd.MODES
_DEFAULTS = {
    "DCASGD": {"mode": "constant", "lambda_": 0.04, "lambda0": 2.0, "momentum": 0.95,
               "epsilon": 1e-7},
    "GapAware": {"beta": 0.999, "epsilon": 1e-8},
    "StragglerDetector": {"threshold": 0.2, "window": 100, "action": "warn"},
    "BackupAndRestore": {"grace_period": 30.0},
}
"""Class name -> constructor argument -> its default."""

# Flag -> constructor argument, for the wrappers that take hyperparameters.
_WRAPPER_ARGS = {
    "dcasgd": {"dcasgd_mode": "mode", "dcasgd_lambda": "lambda_", "dcasgd_lambda0": "lambda0",
               "dcasgd_momentum": "momentum", "dcasgd_epsilon": "epsilon"},
    "gap_aware": {"gap_aware_beta": "beta", "gap_aware_epsilon": "epsilon"},
    "ringmaster": {"ringmaster_threshold": "threshold"},
}

GROUPS = {
    "strategy": ("strategy",),
    "nonfinite_updates": ("nonfinite_updates",),
    "staleness": ("staleness", "max_staleness") + tuple(
        name for args in _WRAPPER_ARGS.values() for name in args),
    "local_steps": ("local_steps", "outer_optimizer", "outer_learning_rate",
                    "outer_momentum"),
    "straggler": ("straggler_threshold", "straggler_window", "straggler_action"),
    "metrics": ("tensorboard_dir", "per_replica_metrics"),
    "sharding": ("shard_min_bytes",),
    "backup": ("backup_dir", "save_freq", "grace_period"),
}
"""Group name (a `define_flags` switch) -> the flags it defines."""


def define_flags(flag_values=FLAGS, *, strategy=True, nonfinite_updates=True, staleness=True,
                 local_steps=True, straggler=True, metrics=True, sharding=True, backup=True):
    """Defines keras_dist's flags (see `GROUPS`) on `flag_values`.

    Each argument but the first switches one group on or off. The flags
    become key flags of the calling module, so the script's `--help` lists
    them. Idempotent: a group this function already defined on
    `flag_values` is left as it is, so a second call (or two modules that
    both call it) is harmless. A flag of the same name defined elsewhere,
    e.g. by the script itself, is absl's `DuplicateFlagError`, which names
    both modules: switch that group off, or rename the script's flag.

    Bad values fail at parsing with absl's `IllegalFlagValueError`, which
    names the flag, the value and what is allowed; so does a wrapper's
    hyperparameter given for another wrapper (`--dcasgd_lambda` with
    `--staleness=gap_aware`), `--max_staleness` with `--staleness=ringmaster`
    (both drop stale updates; use one) or a straggler setting with the
    detector off.

    Args:
        flag_values: `absl.flags.FlagValues`. Defaults to `absl.flags.FLAGS`.
        strategy: Boolean. `--strategy`: `auto` (the default: `KERAS_DIST_STRATEGY`,
            then the cluster, then local GPUs) or a `kd.StrategyKind` name.
        nonfinite_updates: Boolean. `--nonfinite_updates`: `skip`, `raise`,
            or unset (the model's own setting, else `skip`).
        staleness: Boolean. `--staleness`: `none` or a wrapper of
            `STALENESS_WRAPPERS`; `--max_staleness` (unset: no limit) adds
            `StalenessLimit` around it (not with `ringmaster`, which drops
            stale updates itself); the `--dcasgd_*` and `--gap_aware_*`
            hyperparameters, with the wrappers' own defaults, and
            `--ringmaster_threshold` (`adaptive`, or an integer >= 1).
        local_steps: Boolean. `--local_steps` (1), `--outer_optimizer`
            (`nesterov` or `delayed_nesterov`), `--outer_learning_rate`
            (1.0) and `--outer_momentum` (0.0): parameter servers only, see
            `fit_kwargs`.
        straggler: Boolean. `--straggler_threshold` (unset or 0: no
            detector), `--straggler_window`, `--straggler_action`.
        metrics: Boolean. `--tensorboard_dir` (unset: no TensorBoard) and
            `--per_replica_metrics` (the per-worker table at the end). Not
            `--log_dir`: absl's logging module defines that one.
        sharding: Boolean. `--shard_min_bytes` (unset: no sharding).
        backup: Boolean. `--backup_dir` (unset: no backups),
            `--save_freq` (`epoch` or a number of steps) and
            `--grace_period` (seconds from SIGTERM to SIGKILL): a
            `kd.callbacks.BackupAndRestore`, see `fit_kwargs`.

    Returns:
        List of the names of the flags of the groups switched on.

    Example:

    >>> from absl.flags import FlagValues, IllegalFlagValueError
    >>> import keras_dist as kd
    >>> fv = FlagValues()   # absl's global FLAGS by default
    >>> kd.flags.define_flags(fv, staleness=False, local_steps=False, straggler=False,
    ...                       metrics=False, sharding=False, backup=False)
    ['strategy', 'nonfinite_updates']
    >>> fv["strategy"].default
    'auto'
    >>> try:
    ...     fv(["train.py", "--strategy=mirored"])
    ... except IllegalFlagValueError as error:
    ...     print(error)
    flag --strategy=mirored: value should be one of
    <auto|default|one_device|mirrored|multi_worker|parameter_server>
    """
    switches = dict(strategy=strategy, nonfinite_updates=nonfinite_updates,
                    staleness=staleness, local_steps=local_steps, straggler=straggler,
                    metrics=metrics, sharding=sharding, backup=backup)
    caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
    caller = sys.argv[0] if caller == "__main__" else caller  # absl's name for the script
    names = []
    for group, wanted in switches.items():
        if not wanted:
            continue
        if not _defined_here(flag_values, GROUPS[group][0]):
            _DEFINE[group](flag_values)
        for name in GROUPS[group]:
            flag_values.register_key_flag_for_module(caller, flag_values[name])
        names += GROUPS[group]
    return names


def strategy_from_flags(flag_values=FLAGS, *, cluster=None):
    """`kd.resolve_strategy` with `--strategy` (and `--shard_min_bytes`).

    Call it first in `main`, before anything creates a tensor: a
    MultiWorkerMirroredStrategy must exist before TensorFlow runs anything.
    Nothing in this module creates one before it. Hand the strategy to
    `fit_kwargs(strategy=...)` afterwards.

    Args:
        flag_values: Parsed `absl.flags.FlagValues`. Defaults to `FLAGS`.
        cluster: `ClusterConfig`, dict or `None` (read the environment).

    Returns:
        The `tf.distribute.Strategy` the flags name, as `resolve_strategy` builds it.

    Example:

    >>> import keras_dist as kd
    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> _ = kd.flags.define_flags(fv, staleness=False, local_steps=False)
    >>> fv.mark_as_parsed()   # or parse argv: fv(["train.py", "--strategy=default"])
    >>> fv.strategy = "default"
    >>> kd.flags.strategy_from_flags(fv).num_replicas_in_sync
    1

    Raises:
        ValueError: see `kd.resolve_strategy`; also `--shard_min_bytes`
            without parameter servers.
    """
    _quiet_tensorflow()
    from keras_dist.cluster import strategy as strategy_lib

    return strategy_lib.resolve_strategy(
        _value(flag_values, "strategy", "auto"), cluster,
        variable_partitioner=_partitioner(flag_values, cluster))


def wrap_optimizer(optimizer, flag_values=FLAGS):
    """Wraps `optimizer` in the staleness-aware wrapper the flags choose.

    For `model.compile` inside the script's `build_model`. `--staleness`
    picks the wrapper (`none`: none), with its `--dcasgd_*` /
    `--gap_aware_*` / `--ringmaster_threshold` hyperparameters; `--max_staleness` adds
    `StalenessLimit` outermost. With local steps or an outer optimizer (see
    `fit_kwargs`) a push is the update, so the wrapper goes around the outer
    optimizer instead and `optimizer` is returned unchanged.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, or a name Keras knows
            (`"sgd"`).
        flag_values: Parsed `absl.flags.FlagValues`. Defaults to `FLAGS`.

    Returns:
        The wrapped optimizer, or `optimizer` itself when nothing wraps it.

    Example:

    >>> import keras
    >>> from absl import flags
    >>> from keras_dist import flags as kd_flags
    >>> fv = flags.FlagValues()
    >>> _ = kd_flags.define_flags(fv, straggler=False, metrics=False, backup=False)
    >>> _ = fv(["train.py", "--staleness=dcasgd", "--dcasgd_mode=adaptive",
    ...         "--max_staleness=8"])
    >>> opt = kd_flags.wrap_optimizer(keras.optimizers.SGD(0.1), fv)
    >>> type(opt).__name__, opt.max_staleness
    ('StalenessLimit', 8)
    >>> type(opt.inner_optimizer).__name__, opt.inner_optimizer.mode
    ('DCASGD', 'adaptive')
    """
    _quiet_tensorflow()
    if _outer_wanted(flag_values) or not _wrapping(flag_values):
        return optimizer
    import keras

    return _wrap(keras.optimizers.get(optimizer), flag_values)


def fit_kwargs(flag_values=FLAGS, *, strategy=None, cluster=None, callbacks=None):
    """The `kd.fit` keyword arguments the parsed flags ask for.

    Only the groups defined on `flag_values` contribute:

    - `strategy`: the `strategy` argument if given (e.g. what
      `strategy_from_flags` returned), else `--strategy`;
    - `nonfinite_updates`: when `--nonfinite_updates` is set;
    - `local_steps`, and `outer_optimizer` when there is one. With
      `--outer_optimizer=nesterov` (the default): a Nesterov
      `SGD(--outer_learning_rate, momentum=--outer_momentum)` when those
      differ from 1.0 and 0.0 (which just add each push), or when local
      steps and a staleness wrapper meet (the wrapper then goes around the
      outer optimizer, `SGD(1.0)` by default, and `wrap_optimizer` leaves the
      model's optimizer plain, as local steps need). With
      `--outer_optimizer=delayed_nesterov`: always
      `DelayedNesterov(--outer_learning_rate, momentum=--outer_momentum)`
      (N from the cluster), even at 1.0 and 0.0, where it still applies
      each push at 1 / N; the paper's values are 0.7 and 0.9. Building it
      creates TensorFlow variables: pass `strategy` from
      `strategy_from_flags`;
    - `variable_partitioner`: with `--shard_min_bytes` and no `strategy`
      given, a `MinSizePartitioner` with one shard at most per `ps` task
      (`strategy_from_flags` builds it into the strategy otherwise);
    - `cluster`: when given;
    - `callbacks`, always a list: `kd.callbacks.BackupAndRestore`
      (`--backup_dir`, `--save_freq`, `--grace_period`), `StragglerDetector`
      (`--straggler_threshold`) and `PerReplicaMetrics`
      (`--per_replica_metrics` or `--tensorboard_dir`) first,
      so your callbacks see their logs under Keras' own loop too; then your
      `callbacks`; then `keras.callbacks.TensorBoard(--tensorboard_dir)`, on the
      chief only (other workers' numbers are the same), last so that it
      records every log. Pass your own callbacks here, not to `kd.fit`
      beside `**fit_kwargs(...)`, or Python sees `callbacks` twice.

    Args:
        flag_values: Parsed `absl.flags.FlagValues`. Defaults to `FLAGS`.
        strategy: `tf.distribute.Strategy`, a strategy name, or `None`
            (`--strategy`).
        cluster: `ClusterConfig`, dict or `None` (read the environment).
            Decides who is chief and how many `ps` tasks there are.
        callbacks: List of your own Keras callbacks, or `None`.

    Returns:
        A dict to pass as `kd.fit(..., **fit_kwargs(...))`.

    Example:

    >>> from absl.flags import FlagValues
    >>> from keras_dist import flags as kd_flags
    >>> fv = FlagValues()
    >>> _ = kd_flags.define_flags(fv, backup=False)
    >>> _ = fv(["train.py"])   # every flag at its default
    >>> kd_flags.fit_kwargs(fv)
    {'strategy': 'auto', 'local_steps': 1, 'callbacks': []}

    With callbacks from flags and of your own:

    >>> import keras
    >>> _ = fv(["train.py", "--per_replica_metrics", "--straggler_threshold=0.5",
    ...         "--straggler_window=20"])
    >>> kwargs = kd_flags.fit_kwargs(fv, callbacks=[keras.callbacks.TerminateOnNaN()])
    >>> [type(c).__name__ for c in kwargs["callbacks"]]
    ['StragglerDetector', 'PerReplicaMetrics', 'TerminateOnNaN']
    >>> kwargs["callbacks"][0].window, kwargs["callbacks"][0].threshold
    (20, 0.5)

    Raises:
        TypeError: if `callbacks` is not a list or tuple.
        ValueError: `--shard_min_bytes` without parameter servers.
    """
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            "`callbacks` must be a list of Keras callbacks (it is combined with the "
            f"flags' callbacks). Received: callbacks={callbacks!r}.")
    _quiet_tensorflow()
    if isinstance(cluster, dict):
        cluster = _cluster(cluster)
    kwargs = {}
    if strategy is not None or "strategy" in flag_values:
        kwargs["strategy"] = strategy if strategy is not None else flag_values.strategy
    if _value(flag_values, "nonfinite_updates", None) is not None:
        kwargs["nonfinite_updates"] = flag_values.nonfinite_updates
    if "local_steps" in flag_values:
        kwargs["local_steps"] = flag_values.local_steps
    if _outer_wanted(flag_values):
        outer = _outer(flag_values)
        kwargs["outer_optimizer"] = _wrap(outer, flag_values) if _wrapping(flag_values) \
            else outer
    if strategy is None and _value(flag_values, "shard_min_bytes", None) is not None:
        kwargs["variable_partitioner"] = _partitioner(flag_values, cluster)
    if cluster is not None:
        kwargs["cluster"] = cluster
    kwargs["callbacks"] = _callbacks(flag_values, cluster, list(callbacks or ()))
    return kwargs


# ------------------------------------------------------------------ building
def _quiet_tensorflow():
    """Sets the "tensorflow" logger to WARNING, unless the user chose its level.

    absl's `app.run` hands Python logging to absl at `--verbosity`, which is
    INFO (0) by default, and TensorFlow's INFO lines ("Reduce to
    /device:CPU:0 then broadcast to ...", one per variable) drown the
    script's own. Only then does this act: under `app.run` (absl's handler
    is on the root logger), with no `--verbosity` / `-v` on the command
    line (given, TensorFlow's logs follow it: `-v 0` brings its INFO lines
    back), and with the "tensorflow" logger's level still unset (a level the
    script set stays).
    """
    from absl import logging as absl_logging

    if absl_logging.get_absl_handler() not in logging.root.handlers:
        return  # not under app.run: Python's own WARNING default holds
    if "verbosity" in FLAGS and FLAGS["verbosity"].present:
        return
    logger = logging.getLogger("tensorflow")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def _value(flag_values, name, default):
    """The parsed value of `name`, or `default` where its group is not defined."""
    return getattr(flag_values, name) if name in flag_values else default


def _wrapping(flag_values):
    return (_value(flag_values, "staleness", "none") != "none"
            or _value(flag_values, "max_staleness", None) is not None)


def _outer_wanted(flag_values):
    if "local_steps" not in flag_values:
        return False
    if flag_values.outer_optimizer != "nesterov":
        return True  # DelayedNesterov differs from a plain push at any setting
    plain_push = (flag_values.outer_learning_rate == 1.0 and flag_values.outer_momentum == 0.0)
    return not plain_push or (flag_values.local_steps > 1 and _wrapping(flag_values))


def _outer(flag_values):
    """The outer optimizer `--outer_optimizer` names, not yet wrapped."""
    learning_rate, momentum = flag_values.outer_learning_rate, flag_values.outer_momentum
    if flag_values.outer_optimizer == "delayed_nesterov":
        from keras_dist import optimizers

        return optimizers.DelayedNesterov(learning_rate=learning_rate, momentum=momentum)
    import keras

    return keras.optimizers.SGD(learning_rate, momentum=momentum, nesterov=momentum > 0)


_ADAPTIVE = "adaptive"  # keras_dist.optimizers.ringmaster.ADAPTIVE, without importing it


def _ringmaster_threshold(value):
    """`--ringmaster_threshold`'s text as `Ringmaster`'s threshold: an int or
    "adaptive"; `None` where it is neither (an integer < 1 included)."""
    if value == _ADAPTIVE:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and int(value) >= 1:
        return int(value)
    return None


# Flag -> its parsed value as the wrapper's argument, where the two differ.
_WRAPPER_ARG_TYPES = {"ringmaster_threshold": _ringmaster_threshold}


def _wrap(optimizer, flag_values):
    from keras_dist import optimizers

    name = _value(flag_values, "staleness", "none")
    if name != "none":
        args = {arg: _WRAPPER_ARG_TYPES.get(flag, lambda v: v)(getattr(flag_values, flag))
                for flag, arg in _WRAPPER_ARGS.get(name, {}).items()}
        optimizer = getattr(optimizers, STALENESS_WRAPPERS[name])(optimizer, **args)
    limit = _value(flag_values, "max_staleness", None)
    if limit is not None:
        optimizer = optimizers.StalenessLimit(optimizer, max_staleness=limit)
    return optimizer


def _cluster(cluster):
    """`cluster` as a `ClusterConfig`; `None` reads the environment (and may stay `None`)."""
    from keras_dist.cluster.config import ClusterConfig

    if isinstance(cluster, dict):
        return ClusterConfig.from_dict(cluster)
    return ClusterConfig.from_env() if cluster is None else cluster


def _partitioner(flag_values, cluster):
    min_bytes = _value(flag_values, "shard_min_bytes", None)
    if min_bytes is None:
        return None
    cluster = _cluster(cluster)
    if cluster is None or not cluster.num_ps:
        where = "no cluster" if cluster is None else f"a cluster of {cluster.describe()}"
        raise ValueError(
            f"--shard_min_bytes={min_bytes} splits large variables across the parameter "
            f"servers, but this process runs on {where}, without 'ps' tasks. Launch "
            "with parameter servers (keras-dist-run --ps N, or 'ps' tasks in TF_CONFIG), "
            "or drop --shard_min_bytes.")
    import tensorflow as tf

    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=min_bytes, max_shards=cluster.num_ps)


def _callbacks(flag_values, cluster, own):
    from keras_dist import callbacks as kd_callbacks

    first, last = [], []
    backup_dir = _value(flag_values, "backup_dir", None)
    if backup_dir:  # first: what it restores is there for every other callback
        save_freq = flag_values.save_freq
        first.append(kd_callbacks.BackupAndRestore(
            backup_dir, save_freq=save_freq if save_freq == "epoch" else int(save_freq),
            grace_period=flag_values.grace_period))
    threshold = _value(flag_values, "straggler_threshold", None)
    if threshold:
        first.append(kd_callbacks.StragglerDetector(
            window=flag_values.straggler_window, threshold=threshold,
            action=flag_values.straggler_action))
    log_dir = _value(flag_values, "tensorboard_dir", None)
    if log_dir or _value(flag_values, "per_replica_metrics", False):
        first.append(kd_callbacks.PerReplicaMetrics(
            log_dir=log_dir or None, table=flag_values.per_replica_metrics))
    if log_dir:
        cluster = _cluster(cluster)
        if cluster is None or cluster.is_chief:
            import keras

            last.append(keras.callbacks.TensorBoard(log_dir=os.fspath(log_dir)))
    return first + own + last


# ------------------------------------------------------------------ defining
def _defined_here(flag_values, name):
    return name in flag_values and flag_values.find_module_defining_flag(name) == __name__


def _validate(flag_values, name, check, rule):
    """Registers `check(value)`; absl's error reads `flag --name=value: rule`."""
    absl_flags.register_validator(name, check, message=rule, flag_values=flag_values)


def _needs(flag_values, switch, names, condition, rule):
    """Flags in `names` may be given only when `condition(value of switch)` holds."""
    def check(values):
        given = [f"--{n}" for n in names if flag_values[n].present]
        if given and not condition(values[switch]):
            raise absl_flags.ValidationError(
                f"{', '.join(given)}: {rule} Received: --{switch}={values[switch]}.")
        return True

    absl_flags.register_multi_flags_validator([switch] + list(names), check,
                                              flag_values=flag_values)


def _define(fv, kind, name, default, help_text, check=None, rule=None, **options):
    """Defines `--name` (`absl_flags.DEFINE_<kind>`) in `fv`, and with `check`
    its validator (see `_validate`)."""
    getattr(absl_flags, f"DEFINE_{kind}")(name, default, help=help_text, flag_values=fv,
                                          **options)
    if check is not None:
        _validate(fv, name, check, rule)


_AT_LEAST_0 = (lambda v: v >= 0, "must be >= 0.")
_ABOVE_0 = (lambda v: v > 0, "must be > 0.")
_FRACTION = (lambda v: 0 <= v < 1, "must be in the range [0, 1).")


def _define_strategy(fv):
    _define(fv, "enum", "strategy", "auto",
            "tf.distribute strategy. 'auto' decides by KERAS_DIST_STRATEGY, then the "
            "cluster (TF_CONFIG / SLURM), then the local GPUs (docs/choosing-a-strategy.md).",
            enum_values=["auto", *_STRATEGY_KINDS])


def _define_nonfinite_updates(fv):
    _define(fv, "enum", "nonfinite_updates", None,
            "What keras_dist's own loops do with an update whose gradients are NaN or Inf: "
            "skip and count it, or raise. Unset: the model's setting, else skip.",
            enum_values=list(_NONFINITE_MODES))


def _define_staleness(fv):
    _define(fv, "enum", "staleness", "none",
            "Staleness-aware wrapper around the optimizer (asynchronous training): "
            "scaled g/max(tau,1), dynsgd g/(tau+1), dcasgd delay compensation, gap_aware "
            "per-weight gap penalty, delay_adaptive g*N/max(N,tau) (N workers, from the "
            "cluster), ringmaster ignores updates with tau >= --ringmaster_threshold "
            "(docs/staleness-aware-optimizers.md).",
            enum_values=["none"] + list(STALENESS_WRAPPERS))
    _define(fv, "integer", "max_staleness", None,
            "Drop updates staler than this (StalenessLimit, outside the --staleness "
            "wrapper; not with --staleness=ringmaster); 2 x workers is a common choice. "
            "Unset: no limit.",
            lambda v: v is None or v >= 0,
            "must be an integer >= 0 (the largest tau still applied), or unset.")
    _define(fv, "enum", "dcasgd_mode", _DEFAULTS["DCASGD"]["mode"],
            "DC-ASGD: constant lambda (DC-ASGD-c) or adaptive (DC-ASGD-a).",
            enum_values=list(_DCASGD_MODES))
    # Each wrapper's hyperparameters: (flag, wrapper class name, argument, help, check).
    for name, cls, argument, help_text, check in (
            ("dcasgd_lambda", "DCASGD", "lambda_",
             "DC-ASGD constant mode: the variance-control factor lambda.", _AT_LEAST_0),
            ("dcasgd_lambda0", "DCASGD", "lambda0",
             "DC-ASGD adaptive mode: lambda0 in lambda0/sqrt(MS + epsilon).", _AT_LEAST_0),
            ("dcasgd_momentum", "DCASGD", "momentum",
             "DC-ASGD adaptive mode: decay of the mean square MS.", _FRACTION),
            ("dcasgd_epsilon", "DCASGD", "epsilon",
             "DC-ASGD adaptive mode: added under the square root.", _ABOVE_0),
            ("gap_aware_beta", "GapAware", "beta", "Gap-Aware: decay of the average of g*g.",
             _FRACTION),
            ("gap_aware_epsilon", "GapAware", "epsilon",
             "Gap-Aware: epsilon in eta_max * (sqrt(v) + epsilon).", _ABOVE_0)):
        _define(fv, "float", name, _DEFAULTS[cls][argument], help_text, *check)
    _define(fv, "string", "ringmaster_threshold", _ADAPTIVE,
            "Ringmaster: R, an integer >= 1 (updates with tau >= R are ignored; about the "
            "number of workers is usual), or 'adaptive' (R = max(1, floor(sqrt(k))) at the "
            "k-th update; use a decreasing learning rate with it).",
            lambda v: _ringmaster_threshold(v) is not None,
            "must be an integer >= 1 (updates with a delay tau >= it are ignored) or "
            "'adaptive' (R = max(1, floor(sqrt(k))) at the k-th update).")
    for wrapper, names in _WRAPPER_ARGS.items():
        _needs(fv, "staleness", names, lambda value, wrapper=wrapper: value == wrapper,
               f"{STALENESS_WRAPPERS[wrapper]} hyperparameters, used only with "
               f"--staleness={wrapper}. Pass --staleness={wrapper} or leave them out.")

    def one_limit(values):
        # StalenessLimit(Ringmaster(...)) would fail at construction ("cannot wrap").
        limit = values["max_staleness"]
        if values["staleness"] == "ringmaster" and limit is not None:
            raise absl_flags.ValidationError(
                f"--max_staleness={limit} with --staleness=ringmaster: both drop stale "
                "updates (StalenessLimit cannot wrap Ringmaster). Use one of them: "
                f"--staleness=ringmaster --ringmaster_threshold={limit + 1} drops what "
                f"--max_staleness={limit} does, or another --staleness with --max_staleness.")
        return True

    absl_flags.register_multi_flags_validator(["staleness", "max_staleness"], one_limit,
                                              flag_values=fv)


def _define_local_steps(fv):
    _define(fv, "integer", "local_steps", 1,
            "Parameter servers only: steps each worker takes on its own copy of the "
            "weights per push (Downpour / local SGD, docs/local-steps.md).",
            lambda v: v >= 1,
            "must be an integer >= 1 (1: every step updates the parameter servers).")
    _define(fv, "enum", "outer_optimizer", OUTER_OPTIMIZERS[0],
            "Parameter servers only: the outer optimizer that applies each push. nesterov: "
            "SGD with Nesterov momentum (DiLoCo), none at --outer_learning_rate=1 "
            "--outer_momentum=0 (the push is added as is); delayed_nesterov: "
            "DelayedNesterov (Liu et al. 2024), each push at 1/N and the momentum updated "
            "once every N pushes (N workers, from the cluster), at any setting; the "
            "paper's setting is --outer_learning_rate=0.7 --outer_momentum=0.9.",
            enum_values=list(OUTER_OPTIMIZERS))
    _define(fv, "float", "outer_learning_rate", 1.0,
            "Parameter servers only: learning rate of the outer optimizer that applies "
            "each push (DiLoCo); 1.0 with --outer_momentum=0 adds the push as is "
            "(--outer_optimizer=nesterov).", *_ABOVE_0)
    _define(fv, "float", "outer_momentum", 0.0,
            "Parameter servers only: momentum of the outer optimizer (Nesterov).", *_FRACTION)


def _define_straggler(fv):
    _define(fv, "float", "straggler_threshold", None,
            "Add a StragglerDetector: flag a worker that costs the job more than this "
            f"share of its time; {_DEFAULTS['StragglerDetector']['threshold']} is "
            "the usual value. Unset or 0: no detector.",
            lambda v: v is None or 0 <= v < 1,
            "must be in the range (0, 1) (a worker is flagged when it costs the job more "
            "than this share of its time), or 0 / unset for no detector.")
    _define(fv, "integer", "straggler_window", _DEFAULTS["StragglerDetector"]["window"],
            "StragglerDetector: steps in the rolling window.",
            lambda v: v >= 2, "must be an integer >= 2.")
    _define(fv, "enum", "straggler_action", _DEFAULTS["StragglerDetector"]["action"],
            "StragglerDetector: log a line, or stop training with StragglerError, when a "
            "worker becomes a straggler.", enum_values=["warn", "raise"])
    _needs(fv, "straggler_threshold", ["straggler_window", "straggler_action"], bool,
           "StragglerDetector settings, but the detector is off. Pass "
           "--straggler_threshold (e.g. 0.2) too, or leave them out.")


def _define_metrics(fv):
    _define(fv, "string", "tensorboard_dir", None,
            "TensorBoard directory: Keras' TensorBoard callback (chief only) and one run "
            "per worker from PerReplicaMetrics (<dir>/<worker>). Unset: none.")
    _define(fv, "boolean", "per_replica_metrics", False,
            "Add PerReplicaMetrics: each worker's loss, step time, throughput and "
            "staleness in the epoch logs, and a table at the end.")


def _define_sharding(fv):
    _define(fv, "integer", "shard_min_bytes", None,
            "Parameter servers only: split variables larger than this into shards of at "
            "least this many bytes, at most one per ps task (MinSizePartitioner, "
            "docs/sharded-variables.md). Unset: no sharding.",
            lambda v: v is None or v >= 1, "must be a number of bytes >= 1, or unset.")


def _define_backup(fv):
    _define(fv, "string", "backup_dir", None,
            "Add a BackupAndRestore: back training up there (a directory every task sees) "
            "and resume from it when rerun or restarted; save and exit with code 75 on "
            "SIGTERM. Unset: no backups.")
    _define(fv, "string", "save_freq", "epoch",
            "BackupAndRestore: 'epoch', or a backup every this many steps.",
            lambda v: v == "epoch" or (v.isdigit() and int(v) >= 1),
            "must be 'epoch' or an integer number of steps >= 1.")
    _define(fv, "float", "grace_period", _DEFAULTS["BackupAndRestore"]["grace_period"],
            "BackupAndRestore: seconds the scheduler leaves between SIGTERM and SIGKILL "
            "(Kubernetes' terminationGracePeriodSeconds).",
            lambda v: v > 0, "must be a number of seconds > 0.")
    _needs(fv, "backup_dir", ["save_freq", "grace_period"], bool,
           "BackupAndRestore settings, but no backups are made. Pass --backup_dir too, or "
           "leave them out.")


_DEFINE = {
    "strategy": _define_strategy,
    "nonfinite_updates": _define_nonfinite_updates,
    "staleness": _define_staleness,
    "local_steps": _define_local_steps,
    "straggler": _define_straggler,
    "metrics": _define_metrics,
    "sharding": _define_sharding,
    "backup": _define_backup,
}
