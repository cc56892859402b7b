"""keras-dist installed as users install it: from a built wheel, into a fresh
environment, used from outside the source tree.

In the normal suite this builds the wheel from the checkout, checks what is
in it, installs it into a new virtual environment that borrows this
environment's dependencies (TensorFlow, Keras, scikit-learn: no download),
and runs tests/scripts/installed_smoke.py there from an empty folder. Under
`make compat` (tools/compat.py installed the wheel, with its dependencies
pinned, into a fresh environment per TensorFlow x Keras pair) it runs the
same smoke script with that environment's Python.
"""

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

from procs import REPO

SMOKE = os.path.join(REPO, "tests", "scripts", "installed_smoke.py")


def build_wheel(out_dir):
    """`pip wheel` of the checkout (an isolated PEP 517 build, like `make dist`)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(out_dir), REPO], check=True, timeout=600)
    wheels = [p for p in os.listdir(out_dir) if p.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return os.path.join(out_dir, wheels[0])


def fresh_environment(root):
    """A new venv whose site-packages links every installed distribution of
    this one except keras-dist itself (and its editable-install hooks)."""
    venv.EnvBuilder(with_pip=True).create(str(root))
    python = os.path.join(root, "bin", "python")
    target = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    for name in os.listdir(ours):
        lowered = name.lower()
        if (lowered.startswith(("keras_dist", "__editable__", "_distutils_hack", "pip",
                                "setuptools", "distutils-precedence"))
                or name.endswith(".pth") or os.path.exists(os.path.join(target, name))):
            continue
        os.symlink(os.path.join(ours, name), os.path.join(target, name))
    return python


def run_smoke(python, cwd):
    result = subprocess.run([python, SMOKE], cwd=cwd, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.compat("wheel")
@pytest.mark.multiprocess
def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if os.environ.get("KD_COMPAT_INSTALLED"):
        # tools/compat.py installed the wheel and its pinned dependencies here.
        found = run_smoke(sys.executable, elsewhere)
        assert not found["keras_dist"].startswith(os.path.join(REPO, "keras_dist"))
        return

    wheel = build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "keras_dist/__init__.py" in names and "keras_dist/optimizers/base.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names

    python = fresh_environment(tmp_path / "env")
    # --no-index: every dependency must already be satisfied by what was linked.
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", wheel],
                   check=True, timeout=300)
    found = run_smoke(python, elsewhere)
    assert found["keras_dist"].startswith(str(tmp_path / "env")), found
    assert found["accuracy"] > 0.85


def test_compat_prepares_every_requirement_of_the_wheel_but_the_pinned_pair():
    """`make compat-env` (tools/compat.py --prepare-only) installs what
    `wheel[test]` will ask for, TensorFlow and Keras pinned to the pair, so
    that `make compat` afterwards installs only the wheel. Checked against
    pyproject.toml itself: a requirement added there is prepared too."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location(
        "compat_tool", os.path.join(REPO, "tools", "compat.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    assert tool.wheel_requirements() == wanted
    ran = []
    tool.environment = lambda pair, cache: "python"   # no venv: only the command line
    tool.run = lambda cmd, **kwargs: ran.append(cmd)
    tool.prepare_requirements(("2.16.2", "3.10.0"), "unused")
    (cmd,) = ran
    assert cmd[:4] == ["python", "-m", "pip", "install"]
    assert cmd[-2:] == ["tensorflow==2.16.2", "keras==3.10.0"]
    others = [r for r in wanted if not r.startswith(("tensorflow>", "keras>"))]
    assert cmd[5:-2] == others and "tensorboard>=2.16" in others
