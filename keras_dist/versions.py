"""The TensorFlow and Keras versions keras_dist is tested with.

`make compat` tests the oldest, a middle and the newest supported
TensorFlow x Keras pair (`TESTED_PAIRS`); CI runs the oldest pair on every
change. Importing keras_dist outside `TESTED_RANGE` warns once, naming the
range: it may work, but nobody has checked.

Keras 3.10 is the lowest supported Keras: before it, Keras' own
distributed training neither scales each replica's loss nor aggregates
metric variables across replicas (see CHANGELOG.md).

Example:

>>> from keras_dist import versions
>>> versions.parse("3.10.0rc1")
(3, 10, 0)
>>> versions.TESTED_RANGE["keras"]
('3.10', '3.15')
"""

import os
import re
import sys
import warnings

import keras
import tensorflow as tf

TESTED_PAIRS = (("2.16.2", "3.10.0"), ("2.18.1", "3.12.4"), ("2.21.0", "3.15.1"))
"""`(tensorflow, keras)` version pairs that `make compat` tests: the oldest
supported, a middle one and the newest (tools/compat.py reads them from here)."""

TESTED_RANGE = {
    "tensorflow": (".".join(TESTED_PAIRS[0][0].split(".")[:2]),
                   ".".join(TESTED_PAIRS[-1][0].split(".")[:2])),
    "keras": (".".join(TESTED_PAIRS[0][1].split(".")[:2]),
              ".".join(TESTED_PAIRS[-1][1].split(".")[:2])),
}
"""Per package, the inclusive `(lowest, highest)` minor versions tested."""


def parse(version):
    """`"3.10.0rc1"` -> `(3, 10, 0)`: the leading numeric release fields.

    Args:
        version: String. A version as packages print it.

    Returns:
        A tuple of up to three integers.

    Example:

    >>> parse("2.16.2")
    (2, 16, 2)
    """
    fields = []
    for part in str(version).split(".")[:3]:
        match = re.match(r"\d+", part)
        if not match:
            break
        fields.append(int(match.group()))
    return tuple(fields)


def outside_tested_range(tensorflow=None, keras_version=None):
    """Names the packages whose version lies outside `TESTED_RANGE`.

    Args:
        tensorflow: String or `None`. A TensorFlow version; `None` means
            the installed one.
        keras_version: String or `None`. A Keras version; `None` means
            the installed one.

    Returns:
        A list of strings like `"tensorflow 2.22.0 (tested: 2.16 to 2.21)"`,
        empty when both are in range. A version below the range is below
        the supported minimum (pip refuses it unless told `--no-deps`) and
        says so.

    Example:

    >>> outside_tested_range("2.16.2", "3.10.0")
    []
    >>> outside_tested_range("2.22.0", "3.10.0")
    ['tensorflow 2.22.0 (tested: 2.16 to 2.21)']
    >>> outside_tested_range("2.16.2", "3.9.2")
    ['keras 3.9.2 (below the supported minimum 3.10)']
    """
    found = []
    for name, version in (("tensorflow", tensorflow or tf.__version__),
                          ("keras", keras_version or keras.version())):
        low, high = TESTED_RANGE[name]
        minor = parse(version)[:2]
        if minor < parse(low):
            found.append(f"{name} {version} (below the supported minimum {low})")
        elif minor > parse(high):
            found.append(f"{name} {version} (tested: {low} to {high})")
    return found


_warned = []


def _user_stacklevel():
    """The `stacklevel` that points a warning at the first frame outside
    keras_dist and the import machinery: the user's line that first used
    keras_dist (it is loaded lazily, so that is not always the import)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1  # the caller of this function is level 1
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        if not (internal or name.startswith(package)):
            return level
        if not internal:  # warnings.warn does not count the import machinery
            level += 1
        frame = frame.f_back
    return 1


def warn_if_untested():
    """Warns once per process when TensorFlow or Keras is outside the tested range.

    Called when keras_dist is imported. Silence it with
    `warnings.filterwarnings("ignore", module="keras_dist.versions")`.

    Returns:
        The list from `outside_tested_range()`.

    Example:

    >>> warn_if_untested()  # the tested versions: nothing to say
    []
    """
    found = outside_tested_range()
    if found and not _warned:
        _warned.append(True)
        if any("below the supported minimum" in f for f in found):
            advice = ("Distributed training is known to go wrong there (Keras before "
                      "3.10 miscounts metrics and losses across replicas); upgrade, see "
                      "docs/compatibility.md.")
        else:
            advice = ("It may work; if something fails, try a tested version (see "
                      "docs/compatibility.md) and report what you found.")
        warnings.warn(f"keras_dist has not been tested with {' and '.join(found)}. {advice}",
                      RuntimeWarning, stacklevel=_user_stacklevel())
    return found
