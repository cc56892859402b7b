"""A task that starts its real TensorFlow server and waits (isolation tests)."""

import json
import os
import sys
import time

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]),
                              job_name=task["type"], task_index=task["index"], start=True)
address = config["cluster"][task["type"]][task["index"]]
print(f"serving {address}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 600)
