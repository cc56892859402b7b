"""`python -m keras_dist.launch ...`: the launcher's earlier path, kept working.

The launcher lives in `keras_dist.cluster.launch` (`keras-dist-run`).
"""

import sys

from keras_dist.cluster.launch import main

if __name__ == "__main__":
    sys.exit(main())
