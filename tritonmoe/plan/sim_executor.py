"""Deprecated alias of :mod:`tritonmoe.sim.executor` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.executor import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.sim_executor is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.executor instead",
    DeprecationWarning,
    stacklevel=2,
)
