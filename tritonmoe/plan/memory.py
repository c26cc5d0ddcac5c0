"""Deprecated alias of :mod:`tritonmoe.sim.memory_model`, :mod:`tritonmoe.policy.memory_strategy` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.memory_model import *  # noqa: F401,F403
from tritonmoe.policy.memory_strategy import *  # noqa: F401,F403
from tritonmoe.sim.memory_ops import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.memory is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.memory_model / tritonmoe.policy.memory_strategy instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every name of the new module(s), also those outside their ``__all__`` (the old module
    defined or imported them)."""
    import importlib

    for target in ('tritonmoe.sim.memory_model', 'tritonmoe.policy.memory_strategy', 'tritonmoe.sim.memory_ops'):
        module = importlib.import_module(target)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
