"""Schedule programs: each written once against :class:`tritonmoe.comm.executor.Executor`.

:class:`~tritonmoe.comm.executor.RealExecutor` runs a program on real tensors and process
groups; the planner's :class:`~tritonmoe.sim.sim_executor.SimExecutor` simulates the very same
program against a cost model. This package holds the programs, named by role:

* :mod:`.pipeline`: the pipelined expert-parallel step (dispatch / expert FFN / combine per
  micro-op, forward and backward), Lina- and MPMoE-style overlap.
* :mod:`.memory_reuse`: MPMoE's memory reuse around the pipelined step (recompute or offload
  of the dispatched inputs and the intermediate activations).
* :mod:`.model_parallel`: Parm's schedules under model + expert + expert-sharding parallelism.
* :mod:`.saa`: the simultaneous all-to-all and all-gather collective (Parm's SAA).
* :mod:`.hierarchical`: the two-level (intra-node, then inter-node) all-to-all.

Programs import the communication primitives (:mod:`tritonmoe.comm`), the op floor and the
ground floor; never configs, layers, expert paths, policies or the planner.
"""
