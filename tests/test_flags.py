"""keras_dist.flags: absl flags -> kd.fit arguments, wrapped optimizers, strategy.

Each test parses an argv into a fresh `absl.flags.FlagValues`, so nothing
touches the global FLAGS. Ends with a real training run of the digits MLP
under `kd.fit(..., **fit_kwargs(fv))`.
"""

import ast
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags

import keras_dist as kd
from keras_dist import flags as kd_flags
import docblocks
from procs import REPO, digits_model

TWO_PS = {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                      "ps": ["127.0.0.1:3", "127.0.0.1:4"]},
          "task": {"type": "chief", "index": 0}}


def parsed(*args, **groups):
    """A fresh FlagValues with keras_dist's flags, parsed from `args`."""
    fv = flags.FlagValues()
    kd_flags.define_flags(fv, **groups)
    fv(["train.py", *args])
    return fv


def sgd():
    return keras.optimizers.SGD(0.1)


# ------------------------------------------------------------------ defining
def test_defaults():
    fv = parsed()
    assert fv.strategy == "auto" and fv.nonfinite_updates is None
    assert fv.staleness == "none" and fv.max_staleness is None
    # ALGORITHMS.md's defaults, read from the wrappers' signatures.
    assert (fv.dcasgd_mode, fv.dcasgd_lambda, fv.dcasgd_lambda0, fv.dcasgd_momentum,
            fv.dcasgd_epsilon) == ("constant", 0.04, 2.0, 0.95, 1e-7)
    assert (fv.gap_aware_beta, fv.gap_aware_epsilon) == (0.999, 1e-8)
    assert (fv.local_steps, fv.outer_learning_rate, fv.outer_momentum) == (1, 1.0, 0.0)
    assert fv.straggler_threshold is None
    assert (fv.straggler_window, fv.straggler_action) == (100, "warn")
    assert fv.tensorboard_dir is None and fv.per_replica_metrics is False
    assert fv.shard_min_bytes is None


def test_default_flags_give_kd_fit_defaults():
    kwargs = kd_flags.fit_kwargs(parsed())
    assert kwargs == {"strategy": "auto", "local_steps": 1, "callbacks": []}
    signature = inspect.signature(kd.fit).parameters
    assert kwargs["strategy"] == signature["strategy"].default
    assert kwargs["local_steps"] == signature["local_steps"].default
    original = sgd()
    assert kd_flags.wrap_optimizer(original, parsed()) is original


def test_strategy_choices_come_from_strategy_kind():
    fv = parsed()
    choices = fv["strategy"].parser.enum_values
    assert choices == ["auto"] + [k.value for k in kd.StrategyKind]
    for name in choices:
        assert kd_flags.fit_kwargs(parsed(f"--strategy={name}"))["strategy"] == name


def test_define_flags_returns_group_flags_and_switches_groups_off():
    fv = flags.FlagValues()
    names = kd_flags.define_flags(fv, strategy=False, staleness=False, sharding=False,
                                  backup=False)
    assert names == list(kd_flags.GROUPS["nonfinite_updates"] + kd_flags.GROUPS["local_steps"]
                         + kd_flags.GROUPS["straggler"] + kd_flags.GROUPS["metrics"])
    assert sorted(fv) == sorted(names)
    fv(["train.py", "--local_steps=3"])
    # Groups not defined contribute nothing; a strategy given explicitly does.
    assert kd_flags.fit_kwargs(fv) == {"local_steps": 3, "callbacks": []}
    assert kd_flags.fit_kwargs(fv, strategy="mirrored")["strategy"] == "mirrored"


def test_define_flags_twice_is_idempotent():
    fv = flags.FlagValues()
    first = kd_flags.define_flags(fv, staleness=False)
    assert "staleness" not in fv
    second = kd_flags.define_flags(fv)  # adds the missing group, keeps the rest
    assert set(first) < set(second) and sorted(fv) == sorted(second)
    fv(["train.py", "--staleness=dynsgd", "--local_steps=2"])
    assert (fv.staleness, fv.local_steps) == ("dynsgd", 2)


def test_a_flag_defined_by_the_script_is_a_clear_duplicate():
    fv = flags.FlagValues()
    flags.DEFINE_string("strategy", "mirrored", "the script's own", flag_values=fv)
    with pytest.raises(flags.DuplicateFlagError, match="strategy"):
        kd_flags.define_flags(fv)
    kd_flags.define_flags(fv, strategy=False)  # the way out
    assert "staleness" in fv


def test_flags_are_key_flags_of_the_calling_module():
    fv = flags.FlagValues()
    names = kd_flags.define_flags(fv, sharding=False)
    keys = {flag.name for flag in fv.get_key_flags_for_module(__name__)}
    assert set(names) <= keys and "shard_min_bytes" not in keys
    assert "--straggler_threshold" in fv.module_help(__name__)


def test_no_clash_with_flags_absl_and_tensorflow_define():
    # absl.logging defines --log_dir, absl.app --pdb ...: on the global FLAGS of
    # any TensorFlow script ours must not collide with them.
    import absl.app  # noqa: F401
    import absl.logging  # noqa: F401

    names = kd_flags.define_flags(flags.FlagValues())
    taken = {name for name in flags.FLAGS
             if flags.FLAGS.find_module_defining_flag(name) != kd_flags.__name__}
    assert "log_dir" in taken and not taken & set(names)


def test_module_imports_neither_tensorflow_nor_keras():
    # Only at module level: `import keras_dist.flags` must stay cheap.
    tree = ast.parse(inspect.getsource(kd_flags))
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add(node.module.split(".")[0])
    assert top <= {"inspect", "logging", "os", "sys", "absl"}, top
    assert sorted(kd_flags.__all__) == [
        "define_flags", "fit_kwargs", "strategy_from_flags", "wrap_optimizer"]


@pytest.mark.multiprocess
def test_no_tensor_before_the_strategy():
    # MultiWorkerMirrored must be created before TF's runtime starts: importing,
    # defining, parsing and fit_kwargs (callbacks) must not start it.
    script = textwrap.dedent("""
        import sys
        from absl import flags
        from keras_dist import flags as kd_flags
        print("imported:", [m for m in ("tensorflow", "keras") if m in sys.modules])
        fv = flags.FlagValues()
        kd_flags.define_flags(fv)
        fv(["train.py", "--strategy=multi_worker", "--straggler_threshold=0.2",
            "--tensorboard_dir=LOGS", "--per_replica_metrics", "--staleness=gap_aware"])
        kwargs = kd_flags.fit_kwargs(fv)
        import tensorflow as tf
        # Raises "cannot be modified after initialization" once the runtime runs.
        tf.config.threading.set_inter_op_parallelism_threads(2)
        strategy = kd_flags.strategy_from_flags(fv)
        print(isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
              [type(c).__name__ for c in kwargs["callbacks"]])
    """).replace("LOGS", "/tmp/kd_flags_unused")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    env.pop("KERAS_DIST_STRATEGY", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not configured at program startup" not in done.stderr
    assert done.stdout.split("\n")[0] == "imported: []"  # `import keras_dist.flags` is cheap
    assert done.stdout.split("\n")[-2] == (
        "True ['StragglerDetector', 'PerReplicaMetrics', 'TensorBoard']")


def test_define_time_constants_match_their_sources():
    # define_flags reads these from flags.py, not from the classes (which
    # import TensorFlow): they must not drift from where they are defined.
    from keras_dist.optimizers import dcasgd, ringmaster
    from keras_dist.training import nonfinite

    assert kd_flags._STRATEGY_KINDS == tuple(kind.value for kind in kd.StrategyKind)
    assert kd_flags._NONFINITE_MODES == nonfinite.MODES
    assert kd_flags._DCASGD_MODES == dcasgd.MODES
    assert kd_flags._ADAPTIVE == ringmaster.ADAPTIVE
    classes = {"DCASGD": kd.optimizers.DCASGD, "GapAware": kd.optimizers.GapAware,
               "StragglerDetector": kd.callbacks.StragglerDetector,
               "BackupAndRestore": kd.callbacks.BackupAndRestore}
    assert sorted(kd_flags._DEFAULTS) == sorted(classes)
    for name, defaults in kd_flags._DEFAULTS.items():
        parameters = inspect.signature(classes[name].__init__).parameters
        assert defaults == {arg: parameters[arg].default for arg in defaults}, name


def subprocess_env():
    """This checkout's keras_dist first on the path of a fresh process (not
    whatever keras_dist the virtual environment installed), TF quiet."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("TF_CONFIG", None)
    env.pop("KERAS_DIST_STRATEGY", None)
    return env


def docs_script(directory):
    """docs/flags.md's script (its `file train.py` block), written to `directory`."""
    block, = [block for block in docblocks.parse_page("docs/flags.md")
              if block.marker("file") == "train.py"]
    path = os.path.join(directory, "train.py")
    with open(path, "w") as f:
        f.write(block.code)
    return path


# Runs a script as `python SCRIPT --help` would, then says what was imported.
_HELP = textwrap.dedent("""
    import atexit, runpy, sys
    atexit.register(lambda: print("imported:", [m for m in ("tensorflow", "keras")
                                                if m in sys.modules]))
    sys.argv = [sys.argv[1], "--help"]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", ["docs", "examples/train_digits.py",
                                    "examples/straggler_demo.py"])
def test_help_imports_neither_tensorflow_nor_keras(script, tmp_path):
    # `--help` must answer at once: defining the flags imports no TensorFlow.
    path = docs_script(tmp_path) if script == "docs" else os.path.join(REPO, script)
    done = subprocess.run([sys.executable, "-c", _HELP, path], capture_output=True,
                          text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert "--staleness" in done.stdout or "--straggler_threshold" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-2000:])
    assert done.stdout.splitlines()[-1] == "imported: []", done.stderr[-2000:]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("arg, message", [
    ("--strategy=mirored", r"--strategy=mirored: value should be one of <auto\|default\|"
                           r"one_device\|mirrored\|multi_worker\|parameter_server>"),
    ("--staleness=dyn", r"--staleness=dyn: value should be one of "
                        r"<none\|scaled\|dynsgd\|dcasgd\|gap_aware\|delay_adaptive\|"
                        r"ringmaster>"),
    ("--outer_optimizer=adam", r"--outer_optimizer=adam: value should be one of "
                               r"<nesterov\|delayed_nesterov>"),
    ("--nonfinite_updates=ignore", r"--nonfinite_updates=ignore: .*<skip\|raise>"),
    ("--dcasgd_mode=fast", r"--dcasgd_mode=fast: .*<constant\|adaptive>"),
    ("--straggler_action=stop", r"--straggler_action=stop: .*<warn\|raise>"),
    ("--max_staleness=-1", r"--max_staleness=-1: must be an integer >= 0"),
    ("--local_steps=0", r"--local_steps=0: must be an integer >= 1"),
    ("--outer_learning_rate=0", r"--outer_learning_rate=0.0: must be > 0"),
    ("--outer_momentum=1", r"--outer_momentum=1.0: must be in the range \[0, 1\)"),
    ("--straggler_threshold=1.5", r"--straggler_threshold=1.5: must be in the range \(0, 1\)"),
    ("--shard_min_bytes=0", r"--shard_min_bytes=0: must be a number of bytes >= 1"),
    ("--local_steps=two", r"--local_steps=two.*invalid literal"),
])
def test_bad_value_names_flag_value_and_choices(arg, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        parsed(arg)


@pytest.mark.parametrize("args, message", [
    (["--staleness=dcasgd", "--dcasgd_momentum=1.5"], r"--dcasgd_momentum=1.5: .*\[0, 1\)"),
    (["--staleness=gap_aware", "--gap_aware_beta=-0.1"], r"--gap_aware_beta=-0.1: .*\[0, 1\)"),
    (["--staleness=gap_aware", "--gap_aware_epsilon=0"], r"--gap_aware_epsilon=0.0: must be > 0"),
    (["--staleness=dcasgd", "--dcasgd_lambda=-1"], r"--dcasgd_lambda=-1.0: must be >= 0"),
    (["--staleness=gap_aware", "--dcasgd_lambda=0.1"],
     r"--dcasgd_lambda: DCASGD hyperparameters, used only with --staleness=dcasgd.*"
     r"Received: --staleness=gap_aware"),
    (["--gap_aware_beta=0.9"], r"--gap_aware_beta: GapAware hyperparameters.*"
                               r"Received: --staleness=none"),
    (["--staleness=ringmaster", "--ringmaster_threshold=0"],
     r"--ringmaster_threshold=0: must be an integer >= 1 .* or 'adaptive'"),
    (["--staleness=ringmaster", "--ringmaster_threshold=-3"],
     r"--ringmaster_threshold=-3: must be an integer >= 1"),
    (["--staleness=ringmaster", "--ringmaster_threshold=2.5"],
     r"--ringmaster_threshold=2.5: must be an integer >= 1"),
    (["--staleness=ringmaster", "--ringmaster_threshold=Adaptive"],
     r"--ringmaster_threshold=Adaptive: must be an integer >= 1"),
    (["--ringmaster_threshold=4"], r"--ringmaster_threshold: Ringmaster hyperparameters, "
                                   r"used only with --staleness=ringmaster.*"
                                   r"Received: --staleness=none"),
    (["--staleness=dynsgd", "--ringmaster_threshold=adaptive"],
     r"--ringmaster_threshold: Ringmaster hyperparameters.*Received: --staleness=dynsgd"),
    (["--staleness=ringmaster", "--max_staleness=8"],
     r"--max_staleness=8 with --staleness=ringmaster: both drop stale updates .*"
     r"Use one of them: --staleness=ringmaster --ringmaster_threshold=9 drops what "
     r"--max_staleness=8 does"),
    (["--staleness=ringmaster", "--ringmaster_threshold=3", "--max_staleness=0"],
     r"--max_staleness=0 with --staleness=ringmaster: .*--ringmaster_threshold=1 "),
    (["--straggler_window=10", "--straggler_action=raise"],
     r"--straggler_window, --straggler_action: StragglerDetector settings, but the "
     r"detector is off.*--straggler_threshold"),
])
def test_inconsistent_flags_are_refused(args, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        parsed(*args)


def test_unparsed_flags_are_not_read():
    fv = flags.FlagValues()
    kd_flags.define_flags(fv)
    with pytest.raises(flags.UnparsedFlagAccessError, match="strategy"):
        kd_flags.fit_kwargs(fv)


# ------------------------------------------------------------------ wrappers
@pytest.mark.parametrize("args, cls, config", [
    (["--staleness=scaled"], kd.optimizers.StalenessScaled, {}),
    (["--staleness=dynsgd"], kd.optimizers.DynSGD, {}),
    (["--staleness=dcasgd"], kd.optimizers.DCASGD,
     {"mode": "constant", "lambda_": 0.04, "lambda0": 2.0, "momentum": 0.95, "epsilon": 1e-7}),
    (["--staleness=dcasgd", "--dcasgd_mode=adaptive", "--dcasgd_lambda=0.1",
      "--dcasgd_lambda0=1.5", "--dcasgd_momentum=0.9", "--dcasgd_epsilon=1e-6"],
     kd.optimizers.DCASGD,
     {"mode": "adaptive", "lambda_": 0.1, "lambda0": 1.5, "momentum": 0.9, "epsilon": 1e-6}),
    (["--staleness=gap_aware"], kd.optimizers.GapAware, {"beta": 0.999, "epsilon": 1e-8}),
    (["--staleness=gap_aware", "--gap_aware_beta=0.99", "--gap_aware_epsilon=1e-6"],
     kd.optimizers.GapAware, {"beta": 0.99, "epsilon": 1e-6}),
    (["--staleness=delay_adaptive"], kd.optimizers.DelayAdaptive, {"workers": None}),
    (["--staleness=ringmaster"], kd.optimizers.Ringmaster, {"threshold": "adaptive"}),
    (["--staleness=ringmaster", "--ringmaster_threshold=6"], kd.optimizers.Ringmaster,
     {"threshold": 6}),
])
def test_each_wrapper_with_its_parameters(args, cls, config):
    opt = kd_flags.wrap_optimizer(sgd(), parsed(*args))
    assert type(opt) is cls
    got = opt.get_config()
    assert {k: got[k] for k in config} == config
    assert isinstance(opt.inner_optimizer, keras.optimizers.SGD)
    assert float(opt.learning_rate) == pytest.approx(0.1)
    # The config round-trips, so a saved model keeps the flags' choice.
    again = cls.from_config(got)
    assert {k: again.get_config()[k] for k in config} == config


def test_every_wrapper_name_is_covered():
    assert set(kd_flags.STALENESS_WRAPPERS) == {"scaled", "dynsgd", "dcasgd", "gap_aware",
                                                "delay_adaptive", "ringmaster"}
    for name, cls_name in kd_flags.STALENESS_WRAPPERS.items():
        assert cls_name in kd.optimizers.__all__


def test_new_wrapper_flags_defaults():
    fv = parsed()
    assert fv.ringmaster_threshold == "adaptive" and fv.outer_optimizer == "nesterov"
    assert "ringmaster_threshold" in kd_flags.GROUPS["staleness"]
    assert "outer_optimizer" in kd_flags.GROUPS["local_steps"]


def test_delay_adaptive_takes_its_workers_from_the_cluster():
    opt = kd_flags.wrap_optimizer(sgd(), parsed("--staleness=delay_adaptive"))
    assert type(opt) is kd.optimizers.DelayAdaptive
    assert opt.workers is None  # N: the cluster's worker count, when built
    assert type(opt.inner_optimizer) is keras.optimizers.SGD
    # Not in the "limit" family: --max_staleness goes around it as around the others.
    limited = kd_flags.wrap_optimizer(sgd(), parsed("--staleness=delay_adaptive",
                                                    "--max_staleness=8"))
    assert type(limited) is kd.optimizers.StalenessLimit and limited.max_staleness == 8
    assert type(limited.inner_optimizer) is kd.optimizers.DelayAdaptive


@pytest.mark.parametrize("value, threshold", [
    (None, "adaptive"), ("adaptive", "adaptive"), ("1", 1), ("12", 12), ("007", 7)])
def test_ringmaster_threshold_becomes_an_int_or_adaptive(value, threshold):
    args = ["--staleness=ringmaster"] + (
        [] if value is None else [f"--ringmaster_threshold={value}"])
    opt = kd_flags.wrap_optimizer(sgd(), parsed(*args))
    assert type(opt) is kd.optimizers.Ringmaster
    assert opt.threshold == threshold and type(opt.threshold) is type(threshold)
    assert type(opt.inner_optimizer) is keras.optimizers.SGD


def test_max_staleness_with_ringmaster_is_refused_by_value_not_presence():
    # What the flag error prevents: the two limits cannot nest.
    with pytest.raises(ValueError, match="StalenessLimit cannot wrap Ringmaster"):
        kd.optimizers.StalenessLimit(kd.optimizers.Ringmaster(sgd(), threshold=4),
                                     max_staleness=8)
    # A script's own default for --max_staleness is refused too, at parsing.
    fv = flags.FlagValues()
    kd_flags.define_flags(fv)
    fv.set_default("max_staleness", 5)
    with pytest.raises(flags.IllegalFlagValueError,
                       match="--max_staleness=5 with --staleness=ringmaster"):
        fv(["train.py", "--staleness=ringmaster"])


def test_max_staleness_wraps_outermost():
    alone = kd_flags.wrap_optimizer(sgd(), parsed("--max_staleness=0"))
    assert type(alone) is kd.optimizers.StalenessLimit and alone.max_staleness == 0
    assert isinstance(alone.inner_optimizer, keras.optimizers.SGD)
    both = kd_flags.wrap_optimizer(sgd(), parsed("--staleness=dynsgd", "--max_staleness=8"))
    assert type(both) is kd.optimizers.StalenessLimit and both.max_staleness == 8
    assert type(both.inner_optimizer) is kd.optimizers.DynSGD


def test_an_optimizer_name_is_accepted():
    opt = kd_flags.wrap_optimizer("adam", parsed("--staleness=dynsgd"))
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)
    assert kd_flags.wrap_optimizer("adam", parsed()) == "adam"  # unchanged: compile takes it


# ---------------------------------------------------- local steps / outer opt
def test_local_steps_alone_add_each_push():
    fv = parsed("--local_steps=4")
    kwargs = kd_flags.fit_kwargs(fv)
    assert kwargs["local_steps"] == 4 and "outer_optimizer" not in kwargs


def test_local_steps_move_the_wrapper_to_the_outer_optimizer():
    fv = parsed("--local_steps=4", "--staleness=dynsgd", "--max_staleness=6")
    original = sgd()
    assert kd_flags.wrap_optimizer(original, fv) is original  # local steps need it plain
    outer = kd_flags.fit_kwargs(fv)["outer_optimizer"]
    assert type(outer) is kd.optimizers.StalenessLimit and outer.max_staleness == 6
    assert type(outer.inner_optimizer) is kd.optimizers.DynSGD
    plain = outer.inner_optimizer.inner_optimizer
    assert isinstance(plain, keras.optimizers.SGD)
    assert float(plain.learning_rate) == 1.0 and plain.momentum == 0.0


def test_outer_learning_rate_and_momentum_make_a_nesterov_outer_sgd():
    fv = parsed("--outer_learning_rate=0.7", "--outer_momentum=0.9")
    outer = kd_flags.fit_kwargs(fv)["outer_optimizer"]
    config = outer.get_config()
    assert type(outer) is keras.optimizers.SGD
    assert (config["learning_rate"], config["momentum"], config["nesterov"]) == (
        pytest.approx(0.7), 0.9, True)
    wrapped = kd_flags.fit_kwargs(parsed("--outer_learning_rate=0.5", "--staleness=scaled"))
    assert type(wrapped["outer_optimizer"]) is kd.optimizers.StalenessScaled
    assert wrapped["local_steps"] == 1


def test_outer_optimizer_nesterov_is_the_default_behaviour():
    # Given explicitly, `nesterov` changes nothing: no outer optimizer at 1.0 / 0.0 ...
    for args in ([], ["--outer_optimizer=nesterov"]):
        kwargs = kd_flags.fit_kwargs(parsed("--local_steps=4", *args))
        assert "outer_optimizer" not in kwargs
        outer = kd_flags.fit_kwargs(parsed("--outer_momentum=0.5", *args))["outer_optimizer"]
        assert type(outer) is keras.optimizers.SGD
        assert (float(outer.learning_rate), outer.momentum, outer.nesterov) == (1.0, 0.5, True)


@pytest.mark.parametrize("args, learning_rate, momentum", [
    ([], 1.0, 0.0),  # the flags' defaults: still an outer optimizer (pushes at 1 / N)
    (["--outer_learning_rate=0.7", "--outer_momentum=0.9"], 0.7, 0.9),
    (["--local_steps=8", "--outer_momentum=0.3"], 1.0, 0.3),
])
def test_outer_optimizer_delayed_nesterov(args, learning_rate, momentum):
    fv = parsed("--outer_optimizer=delayed_nesterov", *args)
    original = sgd()
    assert kd_flags.wrap_optimizer(original, fv) is original
    kwargs = kd_flags.fit_kwargs(fv)
    outer = kwargs["outer_optimizer"]
    assert type(outer) is kd.optimizers.DelayedNesterov
    assert float(outer.learning_rate) == pytest.approx(learning_rate)
    assert outer.momentum == momentum
    assert outer.workers is None and outer.c == 0.0  # N from the cluster, the paper's c
    assert kwargs["local_steps"] == fv.local_steps


def test_delayed_nesterov_goes_inside_the_staleness_wrapper():
    fv = parsed("--local_steps=4", "--outer_optimizer=delayed_nesterov",
                "--outer_learning_rate=0.7", "--outer_momentum=0.9",
                "--staleness=ringmaster", "--ringmaster_threshold=3")
    original = sgd()
    assert kd_flags.wrap_optimizer(original, fv) is original
    outer = kd_flags.fit_kwargs(fv)["outer_optimizer"]
    assert type(outer) is kd.optimizers.Ringmaster and outer.threshold == 3
    inner = outer.inner_optimizer
    assert type(inner) is kd.optimizers.DelayedNesterov
    assert (float(inner.learning_rate), inner.momentum) == (pytest.approx(0.7), 0.9)
    limited = kd_flags.fit_kwargs(parsed("--outer_optimizer=delayed_nesterov",
                                         "--staleness=delay_adaptive", "--max_staleness=6"))
    outer = limited["outer_optimizer"]
    assert type(outer) is kd.optimizers.StalenessLimit and outer.max_staleness == 6
    assert type(outer.inner_optimizer) is kd.optimizers.DelayAdaptive
    assert type(outer.inner_optimizer.inner_optimizer) is kd.optimizers.DelayedNesterov


# ----------------------------------------------------------------- fit_kwargs
def test_callbacks_order_and_settings(tmp_path):
    fv = parsed("--straggler_threshold=0.6", "--straggler_window=8",
                "--straggler_action=raise", f"--tensorboard_dir={tmp_path}")
    mine = keras.callbacks.TerminateOnNaN()
    callbacks = kd_flags.fit_kwargs(fv, callbacks=[mine])["callbacks"]
    detector, metrics, own, board = callbacks
    assert isinstance(detector, kd.callbacks.StragglerDetector)
    assert (detector.threshold, detector.window, detector.action) == (0.6, 8, "raise")
    assert isinstance(metrics, kd.callbacks.PerReplicaMetrics)
    assert (metrics.log_dir, metrics.table) == (str(tmp_path), False)
    assert own is mine
    assert isinstance(board, keras.callbacks.TensorBoard) and board.log_dir == str(tmp_path)


def test_per_replica_metrics_without_tensorboard_prints_the_table():
    (metrics,) = kd_flags.fit_kwargs(parsed("--per_replica_metrics"))["callbacks"]
    assert (metrics.log_dir, metrics.table) == (None, True)


def test_straggler_threshold_zero_is_off():
    assert kd_flags.fit_kwargs(parsed("--straggler_threshold=0"))["callbacks"] == []


def test_tensorboard_only_on_the_chief(tmp_path):
    fv = parsed(f"--tensorboard_dir={tmp_path}")
    workers = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}
    leader = {**workers, "task": {"type": "worker", "index": 0}}
    other = {**workers, "task": {"type": "worker", "index": 1}}
    lead = kd_flags.fit_kwargs(fv, cluster=leader)
    assert [type(c).__name__ for c in lead["callbacks"]] == ["PerReplicaMetrics", "TensorBoard"]
    assert lead["cluster"].is_chief
    follow = kd_flags.fit_kwargs(fv, cluster=other)
    assert [type(c).__name__ for c in follow["callbacks"]] == ["PerReplicaMetrics"]


def test_callbacks_must_be_a_list():
    with pytest.raises(TypeError, match="`callbacks` must be a list"):
        kd_flags.fit_kwargs(parsed(), callbacks=keras.callbacks.TerminateOnNaN())


def test_nonfinite_updates_and_strategy_instance():
    strategy = tf.distribute.get_strategy()
    kwargs = kd_flags.fit_kwargs(parsed("--nonfinite_updates=raise", "--strategy=mirrored"),
                                 strategy=strategy)
    assert kwargs["nonfinite_updates"] == "raise" and kwargs["strategy"] is strategy


def test_shard_min_bytes_gives_a_partitioner_per_ps_task():
    fv = parsed("--shard_min_bytes=1024")
    partitioner = kd_flags.fit_kwargs(fv, cluster=TWO_PS)["variable_partitioner"]
    assert isinstance(partitioner, tf.distribute.experimental.partitioners.MinSizePartitioner)
    # 1000 x 32 float32 = 128 KB: as many shards as ps tasks (2), not 125.
    assert partitioner(tf.TensorShape([1000, 32]), tf.float32) == [2, 1]
    assert partitioner(tf.TensorShape([4, 32]), tf.float32) == [1, 1]  # 512 B: whole
    # A strategy already built (by strategy_from_flags) carries its partitioner.
    built = kd_flags.fit_kwargs(fv, cluster=TWO_PS, strategy=tf.distribute.get_strategy())
    assert "variable_partitioner" not in built


def test_shard_min_bytes_without_parameter_servers_is_an_error():
    fv = parsed("--shard_min_bytes=1024")
    with pytest.raises(ValueError, match=r"--shard_min_bytes=1024 .* no cluster, without 'ps'"):
        kd_flags.fit_kwargs(fv)
    with pytest.raises(ValueError, match=r"--shard_min_bytes=1024 .* a cluster of 2 workers"):
        kd_flags.strategy_from_flags(fv, cluster={
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0}})


def test_strategy_from_flags():
    assert kd_flags.strategy_from_flags(parsed("--strategy=default")) is (
        tf.distribute.get_strategy())
    one = kd_flags.strategy_from_flags(parsed("--strategy=one_device"))
    assert isinstance(one, tf.distribute.OneDeviceStrategy)
    with pytest.raises(ValueError, match="'parameter_server' was requested"):
        kd_flags.strategy_from_flags(parsed("--strategy=parameter_server"))


# ------------------------------------------------------------------- logging
@pytest.mark.parametrize("under_app_run, verbosity_given, own_level, expected", [
    (True, False, logging.NOTSET, logging.WARNING),   # absl's INFO default: quieted
    (True, True, logging.NOTSET, logging.NOTSET),     # --verbosity / -v: follows it
    (True, False, logging.INFO, logging.INFO),        # the script's own choice stays
    (False, False, logging.NOTSET, logging.NOTSET),   # not under app.run: untouched
])
@pytest.mark.parametrize("call", ["strategy_from_flags", "wrap_optimizer", "fit_kwargs"])
def test_tensorflow_info_logs_are_quiet_unless_asked(monkeypatch, call, under_app_run,
                                                     verbosity_given, own_level, expected):
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    handlers = [h for h in logging.root.handlers if h is not handler]
    monkeypatch.setattr(logging.root, "handlers", handlers + [handler] * under_app_run)
    monkeypatch.setattr(flags.FLAGS["verbosity"], "present", int(verbosity_given))
    logger = logging.getLogger("tensorflow")
    before = logger.level
    logger.setLevel(own_level)
    try:
        fv = parsed("--strategy=default")
        if call == "wrap_optimizer":
            kd_flags.wrap_optimizer(sgd(), fv)
        else:
            getattr(kd_flags, call)(fv)
        assert logger.level == expected
    finally:
        logger.setLevel(before)


# Python log lines at INFO: TF's own handler's ("INFO:tensorflow:...", when
# TensorFlow was imported before app.run) or absl's ("I1205 23:07:28.65 140 x.py:619]").
_PYTHON_INFO = re.compile(r"INFO:tensorflow:|\bI\d{4} [\d:.]+ +\d+ \S+\.py:\d+\]")


@pytest.mark.multiprocess
def test_docs_script_under_the_launcher_prints_no_tensorflow_info(tmp_path):
    # absl's app.run sets logging to INFO: without keras-dist quieting it the
    # chief prints "Reduce to /device:CPU:0 then broadcast to ..." per
    # variable (4 lines with one worker and one ps, as with two workers).
    script = docs_script(tmp_path)

    def run(command, *args):
        done = subprocess.run(
            [*command, sys.executable, script, "--epochs=1", *args],
            capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        return [line for line in out.splitlines() if _PYTHON_INFO.search(line)], out

    # docs/flags.md's two commands (its shell block is `covered` by this
    # test): the launcher run with the page's staleness flags (on one worker,
    # not two: the same code, one process fewer), the Mirrored run below.
    noise, out = run([sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "1",
                      "--ps", "1", "--"], "--staleness=dynsgd", "--max_staleness=4")
    assert noise == [], "\n".join(noise[:20])
    assert re.search(r"^\[chief:0\] keras_dist: using parameter_server strategy", out, re.M)
    # The flags took effect: DynSGD's scale and StalenessLimit's drops are logged.
    assert re.search(r"^\[chief:0\] \d+/\d+ - .*accuracy.*dropped_updates.*dyn_sgd_scale_mean",
                     out, re.M), out[-3000:]
    # Asked for (absl's --verbosity, or -v): TensorFlow's INFO lines are back.
    # One process shows it as well as a cluster (the same logger; which
    # --verbosity / -v / app.run cases keep which level:
    # test_tensorflow_info_logs_are_quiet_unless_asked): MirroredStrategy
    # logs its devices at INFO.
    asked, _ = run([], "--strategy=mirrored", "--verbosity=0")
    assert any("Using MirroredStrategy with devices" in line for line in asked), asked


# ----------------------------------------------------------------- end to end
def test_fit_with_flags_end_to_end(tmp_path):
    from keras_dist.datasets import load_digits

    (x, y), _ = load_digits()
    x, y = x[:256], y[:256]
    fv = parsed("--strategy=default", "--staleness=dynsgd", "--straggler_threshold=0.2",
                "--straggler_window=4", f"--tensorboard_dir={tmp_path}")

    def build_model():
        return digits_model(kd_flags.wrap_optimizer(keras.optimizers.SGD(0.1), fv), hidden=16)

    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(sorted(logs))

    kwargs = kd_flags.fit_kwargs(fv, strategy=kd_flags.strategy_from_flags(fv),
                                 callbacks=[Record()])
    with pytest.warns(UserWarning, match="staleness"):  # DynSGD outside async training
        history = kd.fit(build_model, x, y, epochs=2, batch_size=32, verbose=0, **kwargs)
    assert isinstance(history.model.optimizer, kd.optimizers.DynSGD)
    assert len(history.history["loss"]) == 2
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][1] < history.history["loss"][0]
    # PerReplicaMetrics' logs reach the user's callback listed after it.
    assert "replica0/updates" in seen[0] and history.history["replica0/updates"] == [8, 8]
    # TensorBoard: Keras' run and the per-replica run.
    assert os.listdir(tmp_path / "train") and os.listdir(tmp_path / "replica0")


def test_backup_flags_add_a_backup_callback_first(tmp_path):
    from keras_dist.callbacks import BackupAndRestore

    fv = flags.FlagValues()
    kd_flags.define_flags(fv)
    fv(["train.py", f"--backup_dir={tmp_path}", "--save_freq=50", "--grace_period=25",
        "--per_replica_metrics"])
    callbacks = kd_flags.fit_kwargs(fv)["callbacks"]
    assert isinstance(callbacks[0], BackupAndRestore)
    assert (callbacks[0].backup_dir, callbacks[0].save_freq, callbacks[0].grace_period) == (
        str(tmp_path), 50, 25.0)
    fv = flags.FlagValues()
    kd_flags.define_flags(fv)
    fv(["train.py", f"--backup_dir={tmp_path}"])
    assert kd_flags.fit_kwargs(fv)["callbacks"][0].save_freq == "epoch"


@pytest.mark.parametrize("argv, message", [
    (["--backup_dir=b", "--save_freq=0"], "--save_freq=0: must be 'epoch' or an integer"),
    (["--backup_dir=b", "--save_freq=hour"], "must be 'epoch' or an integer number of steps"),
    (["--backup_dir=b", "--grace_period=0"], "--grace_period=0.0: must be a number of seconds"),
    (["--save_freq=50"], "--save_freq: BackupAndRestore settings, but no backups are made"),
])
def test_bad_backup_flags_fail_at_parsing(argv, message):
    fv = flags.FlagValues()
    kd_flags.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError, match=re.escape(message)):
        fv(["train.py", *argv])
