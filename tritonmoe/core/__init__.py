"""The ground floor: types, settings, validation and exactness machinery.

Everything else in tritonmoe builds on this package, and this package imports nothing of
tritonmoe's outside itself (``docs/design.md`` draws the floors; ``tests/test_architecture.py``
enforces them).

* :mod:`tritonmoe.core.types`: :class:`Routing`, :class:`PermuteInfo`, :func:`max_permuted_rows`.
* :mod:`tritonmoe.core.settings`: the process-wide backend and validation switches.
* :mod:`tritonmoe.core.validation`: the typed argument checks every public entry runs.
* :mod:`tritonmoe.core.exact`: row-invariant fp64 products and deferred weight gradients, which
  make pipelined schedules bitwise equal to the plain computation.
"""
