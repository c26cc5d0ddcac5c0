"""Deprecated alias of :mod:`tritonmoe.custom_ops` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.custom_ops import *  # noqa: F401,F403
from tritonmoe.custom_ops import __all__  # noqa: F401

warnings.warn(
    "tritonmoe.ops is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.custom_ops instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.custom_ops',):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
