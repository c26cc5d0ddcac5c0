"""Deprecated alias of :mod:`tritonmoe.comm.programs.model_parallel` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.comm.programs.model_parallel import *  # noqa: F401,F403
from tritonmoe.comm.programs.model_parallel import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.comm.parm is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.comm.programs.model_parallel instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.comm.programs.model_parallel',):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
