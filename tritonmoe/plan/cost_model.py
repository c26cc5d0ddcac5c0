"""Deprecated alias of :mod:`tritonmoe.sim.cost_model` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.cost_model import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.cost_model is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.cost_model instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.sim.cost_model', 'tritonmoe.sim.fits'):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
