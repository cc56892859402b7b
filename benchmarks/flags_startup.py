"""How fast a flags script answers `--help`, against `import tensorflow`.

    python benchmarks/flags_startup.py             # 7 interleaved runs of each

Times three fresh processes, wall clock, one after the other in each round:
`python -c "import tensorflow"`, `python train.py --help` (docs/flags.md's
script, written to a temporary directory) and `python
examples/train_digits.py --help`. `keras_dist.flags.define_flags` imports no
TensorFlow, so `--help` should cost a Python start and absl. Target: the
median `--help` <= 0.25 x the median `import tensorflow`. The processes run
with this checkout first on `PYTHONPATH`. Writes
benchmarks/results/flags_startup.json.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import rich.console
import rich.table
from absl import app
from absl import flags

_REPEATS = flags.DEFINE_integer("repeats", 7, "Rounds; each times every command once.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/flags_startup.json",
                              "Where to write the JSON.")
_TARGET = 0.25
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def docs_script(directory):
    """docs/flags.md's `train.py` (the block after `<!-- docs-test: file train.py -->`)."""
    with open(os.path.join(REPO, "docs", "flags.md"), encoding="utf-8") as f:
        page = f.read()
    match = re.search(r"<!-- docs-test: file train\.py -->\n```python\n(.*?)\n```", page,
                      re.DOTALL)
    path = os.path.join(directory, "train.py")
    with open(path, "w") as f:
        f.write(match[1] + "\n")
    return path


def seconds(cmd, env, cwd):
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main(argv):
    del argv
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as work:
        commands = {
            "import tensorflow": [sys.executable, "-c", "import tensorflow"],
            "docs train.py --help": [sys.executable, docs_script(work), "--help"],
            "examples/train_digits.py --help": [
                sys.executable, os.path.join(REPO, "examples", "train_digits.py"), "--help"],
        }
        times = {name: [] for name in commands}
        for _ in range(_REPEATS.value):  # interleaved: load changes hit every command alike
            for name, cmd in commands.items():
                times[name].append(seconds(cmd, env, work))
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["import tensorflow"]
    table = rich.table.Table(title=f"Start-up, median of {_REPEATS.value} interleaved runs")
    table.add_column("command")
    table.add_column("median s", justify="right")
    table.add_column("x import tensorflow", justify="right")
    for name, median in medians.items():
        table.add_row(name, f"{median:.3f}", f"{median / base:.3f}")
    rich.console.Console().print(table)
    ratios = {name: medians[name] / base for name in medians if name != "import tensorflow"}
    met = all(ratio <= _TARGET for ratio in ratios.values())
    print(f"target: --help <= {_TARGET} x import tensorflow: {'met' if met else 'NOT met'}")
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"repeats": _REPEATS.value, "times": times, "medians": medians,
                   "ratios": ratios, "target": _TARGET, "met": met,
                   "python": sys.version.split()[0], "cpus": os.cpu_count(),
                   "loadavg": os.getloadavg()}, f, indent=2)
    return 0 if met else 1


if __name__ == "__main__":
    app.run(main)
