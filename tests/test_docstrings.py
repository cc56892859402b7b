"""The `Example:` blocks of keras_dist's docstrings run, and say what is true.

Every docstring example is collected with the stdlib `doctest` module and run
as its own test (named after the object, e.g. `keras_dist.training.api.fit`), so a
wrong example fails and the failure says where. Every public name in
`keras_dist.__all__` must carry such an example; for a submodule listed there
(`keras_dist.optimizers`), that is its module docstring and every name in the
submodule's own `__all__`.
"""

import doctest
import importlib
import inspect
import pkgutil
import re

import pytest

import keras_dist

def _package_modules():
    """Every module of the package (so a new one is never left out), each under
    the name it is defined at: `keras_dist.sharded` and `keras_dist.recipes`
    are public paths of the same module objects as their implementations."""
    names = ["keras_dist"]
    for info in pkgutil.walk_packages(keras_dist.__path__, "keras_dist."):
        if "._boot" in info.name:
            continue  # sitecustomize: imported by Python at start-up, no examples
        module = importlib.import_module(info.name)
        if module.__name__ == info.name:
            names.append(info.name)
    return tuple(sorted(names))


MODULES = _package_modules()
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_EXAMPLE_SECTION = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)


def _collect():
    finder = doctest.DocTestFinder()
    tests = {}
    for name in MODULES:
        for test in finder.find(importlib.import_module(name)):
            if test.examples:
                tests[test.name] = test
    return [tests[name] for name in sorted(tests)]


DOCTESTS = _collect()


def _public_names():
    """`keras_dist.__all__`, plus `sub.NAME` for each name a listed submodule exports."""
    names = []
    for name in sorted(keras_dist.__all__):
        names.append(name)
        obj = getattr(keras_dist, name)
        if inspect.ismodule(obj):
            names += [f"{name}.{member}" for member in sorted(getattr(obj, "__all__", ()))]
    return names


PUBLIC_NAMES = _public_names()


def _resolve(dotted):
    obj = keras_dist
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def run_doctest(test):
    """Runs one `doctest.DocTest`; returns `(failures, report)`."""
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS, verbose=False)
    report = []
    result = runner.run(test, out=report.append)
    return result.failed, "".join(report)


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test):
    failures, report = run_doctest(test)
    assert failures == 0, f"Docstring example of {test.name} failed:\n{report}"


def test_examples_were_found():
    # Guards against a finder change that silently collects nothing.
    assert len(DOCTESTS) >= len(PUBLIC_NAMES)


def test_a_wrong_example_fails():
    wrong = doctest.DocTestParser().get_doctest(
        ">>> 1 + 1\n3\n", {}, "wrong_example", "<test>", 0)
    failures, report = run_doctest(wrong)
    assert failures == 1
    assert "Expected:" in report and "Got:" in report


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_name_has_runnable_example(name):
    obj = _resolve(name)
    doc = obj.__doc__ or ""  # not inspect.getdoc: no inherited docstrings
    match = _EXAMPLE_SECTION.search(doc)
    assert match, f"keras_dist.{name} has no `Example:` section in its docstring."
    assert ">>>" in doc[match.end():], (
        f"The `Example:` section of keras_dist.{name} has no `>>>` line.")
    # doctest names a module's own docstring after the module.
    qualified = obj.__name__ if inspect.ismodule(obj) else (
        f"{obj.__module__}.{obj.__qualname__}")
    assert qualified in {t.name for t in DOCTESTS}, (
        f"doctest does not collect the example of keras_dist.{name} "
        f"(looked for {qualified}).")
