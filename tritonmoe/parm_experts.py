"""Deprecated alias of :mod:`tritonmoe.experts.model_parallel` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.experts.model_parallel import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.parm_experts is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.experts.model_parallel instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.experts.model_parallel',):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
