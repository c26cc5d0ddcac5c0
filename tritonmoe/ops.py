"""Deprecated alias of :mod:`tritonmoe.custom_ops` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.custom_ops import *  # noqa: F401,F403
from tritonmoe.custom_ops import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.ops is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.custom_ops instead",
    DeprecationWarning,
    stacklevel=2,
)
