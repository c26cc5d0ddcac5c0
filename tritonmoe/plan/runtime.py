"""Deprecated alias of :mod:`tritonmoe.policy.degree` (moved in 0.2.0; this alias is removed in 0.3.0)."""

import warnings

from tritonmoe.policy.degree import *  # noqa: F401,F403

warnings.warn(
    "tritonmoe.plan.runtime is deprecated and will be removed in tritonmoe 0.3.0; import tritonmoe.policy.degree instead",
    DeprecationWarning,
    stacklevel=2,
)
