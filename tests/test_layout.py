"""The package's layout keeps the promises docs/architecture.md makes.

Each check reads the source (its syntax tree, not its text, so docstrings do
not count) of every module under keras_dist/.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_dist"
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))

# Where the environment may be read: the entry points above the run plan
# (import-time checks, the launchers -- keras-dist-run, and on Ray the task
# actors, whose tasks start from their node's environment -- the cluster
# description, the strategy choice, fault injection, the flags of a user's
# script, the test toolkit)
# and the plan itself. Everything below `RunPlan.build` gets what it needs
# from the plan.
READS_ENVIRONMENT = {
    "__init__.py",
    "_boot/sitecustomize.py",
    "cluster/config.py",
    "cluster/keepalive.py",
    "cluster/launch.py",
    "cluster/plain_fit.py",
    "cluster/ray_tasks.py",
    "cluster/strategy.py",
    "faults.py",
    "flags.py",
    "testing.py",
    "training/plan.py",
}
# Where the environment may be written: the keepalive default, once, at
# `import keras_dist`; the launcher builds its children's environments as
# dicts of their own.
WRITES_ENVIRONMENT = {"cluster/keepalive.py"}


def _name(path):
    return path.relative_to(PACKAGE).as_posix()


def _environment_uses(tree):
    """`(line, kind)` for each read or write of the process environment."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv",
                                                              "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                uses.append((node.lineno, "read"))
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv") for a in node.names):
            uses.append((node.lineno, "read"))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and "environ" in ast.unparse(target.value):
                    uses.append((node.lineno, "write"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("setdefault", "update", "pop", "clear", "putenv") and \
                "environ" in ast.unparse(node.func.value):
            uses.append((node.lineno, "write"))
    return uses


def _imports(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_environment_is_read_only_above_the_plan(path):
    tree = ast.parse(path.read_text())
    uses = _environment_uses(tree)
    name = _name(path)
    reads = [line for line, kind in uses if kind == "read"]
    writes = [line for line, kind in uses if kind == "write"]
    if name not in READS_ENVIRONMENT:
        assert not reads, f"{name} reads the environment (lines {reads}); take it from the RunPlan"
    if name not in WRITES_ENVIRONMENT:
        assert not writes, f"{name} writes the environment (lines {writes})"


def test_the_checks_find_what_they_look_for():
    tree = ast.parse("import os\nx = os.environ.get('A')\nos.environ['B'] = '1'\n"
                     "from keras_dist import testing\n")
    assert sorted(kind for _, kind in _environment_uses(tree)) == ["read", "read", "write"]
    assert "keras_dist.testing" in _imports(tree)


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_production_code_never_imports_the_test_toolkit(path):
    if _name(path) in ("testing.py", "__init__.py"):
        return  # the toolkit itself; the package's lazy `kd.testing` attribute
    imports = _imports(ast.parse(path.read_text()))
    assert "keras_dist.testing" not in imports, (
        f"{_name(path)} imports keras_dist.testing; production fault injection is "
        "keras_dist.faults")


def test_every_training_module_is_in_a_subpackage_by_job():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    # Public entry points and import-time plumbing only; the machinery is in
    # cluster/ and training/ (and optimizers/, callbacks/).
    assert top == ["__init__.py", "_compat.py", "_registration.py", "_runtime.py",
                   "datasets.py", "faults.py", "flags.py", "launch.py", "ray.py",
                   "recipes.py", "sharded.py", "testing.py", "versions.py"], top
    # The subpackages: the four of machinery, the start-up hook, and one entry
    # point too large for a module, the simulator (`from keras_dist import
    # simulate`, its names re-exported by simulate/__init__.py).
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert packages == ["_boot", "callbacks", "cluster", "optimizers", "simulate",
                        "training"], packages


def test_the_simulate_package_only_re_exports():
    """`simulate/__init__.py` is the entry point: its names are defined in the
    package's modules, so a reader finds each by its file."""
    tree = ast.parse((PACKAGE / "simulate" / "__init__.py").read_text())
    defined = [node.lineno for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defined, f"simulate/__init__.py defines names at lines {defined}"


EXECUTORS = ["training/sync_executor.py", "training/async_executor.py",
             "training/worker_step.py"]


@pytest.mark.parametrize("name", EXECUTORS)
def test_executors_call_no_callback_hook(name):
    """The driver calls Keras' hooks; executors only yield events."""
    tree = ast.parse((PACKAGE / name).read_text())
    hooks = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr.startswith("on_")]
    assert not hooks, f"{name} calls callback hooks at lines {hooks}"


# The one module that may use private TensorFlow and Keras names (see its
# docstring for each name and why it has no public route).
COMPAT = "_compat.py"
# Private TF/Keras attributes keras_dist uses, all reached through _compat.
PRIVATE_ATTRIBUTES = {
    "_initial_epoch", "_compile_loss", "_compile_metrics", "_flatten_layers", "_value",
    "_type_spec", "_create_variable", "_embeddings", "_distributed_tf_update_step",
    "_get_variable_index", "_var_key", "_trainable_variables_indices", "__internal__",
    "__composite_gradient__", "_trainable_variables", "_variables", "_backend_update_step",
    "_apply_weight_decay", "_backend_increment_gradient_accumulators", "_use_weight_decay",
}


def _private_imports(tree):
    """`(line, module)` for each import of `keras.src` or `tensorflow.python`."""
    found = []
    for node in ast.walk(tree):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for module in modules:
            if module.split(".")[:2] in (["keras", "src"], ["tensorflow", "python"]):
                found.append((node.lineno, module))
    return found


def _private_attributes(tree):
    """`(line, name)` for each use of a name in PRIVATE_ATTRIBUTES: as an
    attribute (`x._value`) or as a string (`getattr(x, "_value")`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append((node.lineno, node.value))
    return found


def test_the_private_name_checks_find_what_they_look_for():
    tree = ast.parse("import tensorflow.python.ops\nfrom keras.src.trainers import x\n"
                     "import keras.saving\ny = model._initial_epoch\n"
                     "z = getattr(v, '_value', v)\nw = tf.__internal__.CompositeTensor\n")
    assert [m for _, m in _private_imports(tree)] == ["tensorflow.python.ops",
                                                       "keras.src.trainers"]
    assert sorted(n for _, n in _private_attributes(tree)) == [
        "__internal__", "_initial_epoch", "_value"]


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_private_tf_and_keras_names_only_in_compat(path):
    name = _name(path)
    if name == COMPAT:
        return
    tree = ast.parse(path.read_text())
    imports = _private_imports(tree)
    assert not imports, (
        f"{name} imports private TensorFlow/Keras modules {imports}; reach them "
        "through keras_dist._compat (with the reason there is no public route)")
    names = _private_attributes(tree)
    assert not names, (
        f"{name} uses private TensorFlow/Keras names {names}; reach them through "
        "keras_dist._compat (with the reason there is no public route)")


@pytest.mark.parametrize("name", ["PREEMPTED_EXIT_CODE", "DEFAULT_GRACE_PERIOD"])
def test_the_preemption_contract_is_defined_once(name):
    """Tasks and runners agree on the exit code 75 and the 30 s grace period
    because they share one definition (keras_dist/cluster/config.py, which
    loads neither Keras nor TensorFlow)."""
    defined = [str(path.relative_to(PACKAGE)) for path in MODULES
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Assign) and any(
                   getattr(t, "id", None) == name for t in node.targets)]
    assert defined == ["cluster/config.py"], defined
