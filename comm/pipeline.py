"""Deprecated alias of :mod:`tritonmoe.comm.programs.pipeline` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.comm.programs.pipeline import *  # noqa: F401,F403
from tritonmoe.comm.programs.pipeline import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.comm.pipeline is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.comm.programs.pipeline instead",
    DeprecationWarning,
    stacklevel=2,
)
