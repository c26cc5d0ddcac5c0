"""Deprecated alias of :mod:`tritonmoe.sim.memory_model`, :mod:`tritonmoe.policy.memory_strategy` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.sim.memory_model import *  # noqa: F401,F403
from tritonmoe.policy.memory_strategy import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.memory is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.sim.memory_model / tritonmoe.policy.memory_strategy instead",
    DeprecationWarning,
    stacklevel=2,
)
