"""MPMoE's memory operations on the simulator: what :mod:`tritonmoe.comm.programs.memory_reuse`
issues at run time for a strategy (offload copies, re-sent dispatches, recomputed first GEMMs,
restores), issued on the simulated executor as the hooks of the pipelined program."""

from __future__ import annotations

from typing import Sequence



from tritonmoe.comm.executor import VirtualTensor, Work
from tritonmoe.comm.programs.memory_reuse import (
    MI_SLOTS,
    memory_layout,
)

__all__ = ["issue_memory_ops"]


def _fc1_work(W, R: int) -> Work:
    """The first GEMM (and its bias) over R rows: what a recompute costs."""
    return Work(2.0 * R * W.d * W.n1, (R * W.d + R * W.n1) * W.s, "gemm", 1 if W.kernels else 2)


def issue_memory_ops(ex, st, strategy: str, rows: Sequence[int]) -> dict:
    """The hooks :func:`tritonmoe.comm.programs.pipeline.forward_pass` / ``backward_pass`` take, issuing
    on the simulator's executor what :mod:`tritonmoe.comm.programs.memory_reuse` issues for ``strategy``:
    ``{"fwd_pre": ..., "fwd_post": ..., "bwd_prefetch": ..., "bwd_pre": ..., "bwd_post": ...,
    "extra_bwd_work": i -> Work, "extra_fwd_work": i -> Work}``. The MI buffer count is the
    candidate's ``memory_mi_buffers``, else the config's."""
    mi = st.candidate.get("memory_mi_buffers", getattr(st.config, "memory_mi_buffers", MI_SLOTS))
    lay = memory_layout(strategy, st.n, mi)
    W, d, dt, plan = st.work, st.config.d_model, st.dtype, st.plan
    n1 = W.n1
    offloads: dict = {}  # (kind, micro-op) -> its forward host copy
    mi_pending: dict = {}  # micro-op -> its backward MI restore
    bwd_done: dict = {}  # micro-op -> its backward expert compute

    def fwd_pre(i: int) -> list:
        # the runtime's store_di waits for the host copy of its DI buffer's occupant (micro-op
        # i-2) before micro-op i's rows land in it, ahead of its expert compute
        h = offloads.pop(("di", i - lay.di_slots), None)
        return [h] if h is not None else []

    def fwd_post(i: int, y) -> list:
        after = (y,)
        if lay.reuse:
            # store_mi: the expert compute wrote MI to a temporary; copying it into its shared
            # buffer waits for the host copy of the buffer's occupant (micro-op i-1, or i-2 with
            # two MI buffers), so only this copy, and what the compute lane runs after it, waits;
            # the runtime stores inside the expert compute, before the rows the combine sends
            # exist, so the combine waits for the store (returned: forward_pass adds it)
            ev = offloads.pop(("mi", i - lay.mi_slots), None)
            after = (ex.compute(None, work=Work(0.0, 2 * rows[i] * n1 * W.s, "elementwise", 1), kind="store",
                                micro_op=i, after=(y,) + ((ev,) if ev is not None else ())),)
        if i in lay.di_offloaded:
            offloads[("di", i)] = ex.copy(VirtualTensor((rows[i], d), dt), to="host", kind="offload", micro_op=i,
                                          after=after)
        if i in lay.mi_offloaded:
            offloads[("mi", i)] = ex.copy(VirtualTensor((rows[i], n1), dt), to="host", kind="offload", micro_op=i,
                                          after=after)
        return list(after) if lay.reuse else []

    def restore_mi(i: int, after: tuple) -> list:
        if i >= st.n or i not in lay.mi_restore or lay.mi_method != "offload":
            return []
        return [ex.copy(VirtualTensor((rows[i], n1), dt), to="device", kind="restore", micro_op=i, after=after)]

    def bwd_prefetch(i: int) -> list:
        works = []
        if i in lay.di_restore:
            if lay.di_method == "offload":
                # into the DI buffer micro-op i-2 read: the runtime's copy waits for the compute
                # lane's work issued so far, micro-op i-2's backward compute the last of it
                prev = bwd_done.get(i - lay.di_slots)
                works.append(ex.copy(VirtualTensor((rows[i], d), dt), to="device", kind="restore", micro_op=i,
                                     after=(prev,) if prev is not None else ()))
            else:
                a, b = st.bounds[i]
                R = plan.send_rows(i)
                send = ex.compute(None, work=W.permute(b - a, R, backward=False), kind="permute", micro_op=i,
                                  out=VirtualTensor((R, d), dt))
                works.append(ex.all_to_all(send, plan.send_splits[i], plan.recv_splits[i], kind="recomm",
                                           micro_op=i))
        if i < lay.mi_slots:  # nothing reads its MI buffer earlier in backward
            works.extend(restore_mi(i, ()))
        return works

    def bwd_post(i: int, y) -> None:
        # micro-op i was the MI buffer's last reader: the next occupant's restore starts after it
        bwd_done[i] = y
        j = i + lay.mi_slots
        works = restore_mi(j, (y,))
        if works:
            mi_pending[j] = works

    def bwd_pre(i: int) -> list:
        return mi_pending.pop(i, [])

    def extra_fwd(i: int) -> Work:
        if not lay.reuse:
            return Work(0.0, 0.0, "elementwise", 0)
        return Work(0.0, 2 * rows[i] * d * W.s, "elementwise", 1)  # DI into its shared buffer (MI: fwd_post)

    def extra_bwd(i: int) -> Work:
        w = Work(0.0, 0.0, "elementwise", 0)
        if i in lay.recommunicated:
            w = w + W.relayout(rows[i], 1)
        if i in lay.recomputed:
            w = w + _fc1_work(W, rows[i])
        return w

    return {"fwd_pre": fwd_pre, "fwd_post": fwd_post, "bwd_prefetch": bwd_prefetch, "bwd_pre": bwd_pre,
            "bwd_post": bwd_post, "extra_fwd_work": extra_fwd, "extra_bwd_work": extra_bwd}


# ---------------------------------------------------------------------------------------------
# The joint choice
# ---------------------------------------------------------------------------------------------
