"""Test session set-up: two logical CPUs, so MirroredStrategy has 2 replicas.

This must run before anything starts TensorFlow's runtime, which is why it
lives here and not in a fixture.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("TF_CONFIG", None)
os.environ.pop("KERAS_DIST_STRATEGY", None)
sys.path.insert(0, os.path.dirname(__file__))  # tests/procs.py

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

CPUS = ["/cpu:0", "/cpu:1"]
