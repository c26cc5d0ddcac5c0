"""Planning schedules: the simulated executor, cost models, the simulator and the planner.

* :class:`SimExecutor` / :class:`VirtualGroup` / :class:`Program` / :class:`SimOp`
  (:mod:`.sim_executor`): the schedule code of :mod:`tritonmoe.comm` recorded for every rank of a
  virtual cluster, without a process group or real tensors.
"""

from .sim_executor import Program, SimExecutor, SimOp, VirtualGroup

__all__ = ["Program", "SimExecutor", "SimOp", "VirtualGroup"]
