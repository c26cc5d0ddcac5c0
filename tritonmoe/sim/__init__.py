"""The performance model: what a schedule costs, simulated by running its program.

Below the run-time policies (:mod:`tritonmoe.policy`), which ask it on every new token
bucket, and below the offline planner (:mod:`tritonmoe.plan`), which profiles machines, fits
cost models to them and studies layouts with it.

* :mod:`.cost_model`: :class:`CostModel` (alpha-beta collectives per kind, group size and link
  class; compute rooflines; interference; versioned JSON) and :class:`Cluster` (a machine from
  its hardware, with presets); :mod:`.fits` holds the fitting math and the samples.
* :mod:`.executor`: :class:`SimExecutor`, which records the programs of
  :mod:`tritonmoe.comm.programs` for every rank of a virtual cluster; :mod:`.engine` runs them
  (lanes, dependencies, matched collectives, fair-share links).
* :mod:`.simulate`, :mod:`.schedules`, :mod:`.planner`: one layer step of every rank, the
  registered schedules and their dimensions, and the choice among candidates.
* :mod:`.search`: MPMoE's profile-based granularity search.
* :mod:`.memory_model`, :mod:`.parm_model`: MPMoE's memory strategies and Parm's schedules
  under the simulator.
"""
