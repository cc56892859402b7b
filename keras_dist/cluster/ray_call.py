"""Runs a pickled function as a task: `python -m keras_dist.cluster.ray_call PATH`.

`keras_dist.ray.run(function)` pickles the function with Ray's cloudpickle;
each task's actor writes it to PATH and starts this module in a fresh
process, so that the task's TensorFlow servers end with it. The function's
exceptions end the process as any script's would (traceback, exit code 1);
`sys.exit(code)` in it sets the exit code.
"""

import pickle
import sys


def main(path):
    with open(path, "rb") as f:
        function = pickle.load(f)  # imports ray.cloudpickle's helpers as it needs them
    function()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
