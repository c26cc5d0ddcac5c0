"""Deprecated alias of :mod:`tritonmoe.sim.work` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.work import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.work is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.work instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.sim.work',):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
