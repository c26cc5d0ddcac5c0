"""Deprecated alias of :mod:`tritonmoe.sim.planner` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.planner import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.planner is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.planner instead",
    DeprecationWarning,
    stacklevel=2,
)
