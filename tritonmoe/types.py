"""Deprecated alias of :mod:`tritonmoe.core.types` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.core.types import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.types is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.core.types instead",
    DeprecationWarning,
    stacklevel=2,
)
