"""A docs page's cluster script, as a scenario of the shared cluster.

The docs' `<!-- docs-test: cluster --workers 2 --ps 1 -->` scripts
(tests/test_docs_examples.py's `test_cluster_block`) need nothing of their
own from the cluster, so they run in the session's shared one
(tests/scripts/ps_scenarios.py) rather than on a 4-process cluster each.
The chief runs the script (its block and the blocks continuing it) as the
docs test's own job would: as `__main__` in a fresh namespace, in a work
directory holding links to the clone and the page's `file` blocks, with
Keras' epoch limit at the block's `max-epochs` (`KERAS_MAX_EPOCHS` in a job
of its own); the directory and the limit are put back afterwards.

argv: out_dir where (e.g. "docs/local-steps.md:11").
"""

import os
import sys

import keras

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import docblocks  # noqa: E402


def main(out_dir, where):
    found = docblocks.all_scripts()
    script = {s.where: s for s in found}[where]
    docblocks.fill_workdir(out_dir, script.head.page, found)
    limit = script.head.marker("max-epochs")
    before, cwd = keras.config.max_epochs(), os.getcwd()
    os.chdir(out_dir)
    keras.config.set_max_epochs(int(limit) if limit is not None else before)
    try:
        name = f"docs_test_{script.head.line}.py"
        exec(compile(script.code, name, "exec"), {"__name__": "__main__", "__file__": name})
    finally:
        keras.config.set_max_epochs(before)
        os.chdir(cwd)


if __name__ == "__main__":
    main(*sys.argv[1:3])
