"""Deprecated alias of :mod:`tritonmoe.core.exact` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.core.exact import *  # noqa: F401,F403
from tritonmoe.core.exact import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.exact is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.core.exact instead",
    DeprecationWarning,
    stacklevel=2,
)
