"""Deprecated alias of :mod:`tritonmoe.backends` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.backends import *  # noqa: F401,F403
from tritonmoe.backends import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.dispatch is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.backends instead",
    DeprecationWarning,
    stacklevel=2,
)
