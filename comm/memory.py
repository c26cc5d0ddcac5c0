"""Deprecated alias of :mod:`tritonmoe.comm.programs.memory_reuse` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.comm.programs.memory_reuse import *  # noqa: F401,F403
from tritonmoe.comm.programs.memory_reuse import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.comm.memory is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.comm.programs.memory_reuse instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.comm.programs.memory_reuse',):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
