"""Run-time policies: the choices a layer makes on every forward pass.

Each policy agrees across the ranks of its group with one small collective, then decides from
the same values with the same deterministic code, so every rank runs the same schedule.

* :mod:`.degree`: ``pipeline_degree="auto"`` (:class:`AutoDegree`, the planner's choice per
  token bucket) and ``"search"`` (:class:`SearchDegree`, MPMoE's online search).
* :mod:`.memory_strategy`: ``memory_strategy="auto"`` (:class:`AutoMemory`,
  :class:`SearchMemory`) and the checks of the strategy settings.
* :mod:`.parm_schedule`: ``parm_schedule="auto"``: Parm's Algorithm 1 over an alpha-beta model
  measured on the process groups.

Policies sit above the performance model (:mod:`tritonmoe.sim`) and below the expert paths that
consult them; nothing here imports the layer or the offline planner.
"""
