"""Per-rank bodies for tests/test_comm_errors.py (importable by spawned ranks)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def _seconds(group) -> float:
    from tritonmoe.comm.errors import _backend_of

    return _backend_of(group).options._timeout.total_seconds()


def created_group_timeouts(rank: int, P: int) -> dict:
    """The timeout of every kind of process group the library creates, on a world whose
    default group has the run's timeout; plus a group given its own timeout, and the gradient
    lane's typed error when its thread cannot start."""
    import threading

    import tritonmoe as tm
    from tritonmoe.comm import CommScheduler, hierarchical_groups
    from tritonmoe.comm.errors import LaneStartError
    from tritonmoe.comm.splits import group_timeout, new_group
    from tritonmoe.parallel import MoEMesh, data_parallel
    from tritonmoe.parallel.fsdp import _singleton_mesh
    from tritonmoe.parm_layout import ParmLayout, groups_from_process_groups

    out: dict = {"default": group_timeout().total_seconds()}
    short = new_group(range(P), timeout=datetime.timedelta(seconds=3))
    out["explicit 3 s"] = _seconds(short)
    out["new_group(parent=explicit 3 s)"] = _seconds(new_group(range(P), parent=short))
    out["new_group()"] = _seconds(new_group(range(P)))
    h = hierarchical_groups(2, group=short)  # carved out of the 3 s group
    out["hierarchical intra (parent 3 s)"] = _seconds(h.intra)
    out["hierarchical inter (parent 3 s)"] = _seconds(h.inter)
    lay = ParmLayout.make(2, P, 1)
    pg = lay.process_groups()
    for name in ("mp", "ep", "ep_esp", "mp_lane"):
        g = getattr(pg, name)
        if g is not None:
            out[f"parm {name}"] = _seconds(g)
    fused = groups_from_process_groups(ep_group=pg.ep, mp_group=pg.mp)
    out["parm fused ep_esp"] = _seconds(fused.ep_esp)
    if fused.mp_lane is not None and fused.mp_lane is not pg.mp:
        out["parm fused mp_lane"] = _seconds(fused.mp_lane)
    mesh = MoEMesh.build(dp=2, ep=P // 2)
    out["mesh ep"] = _seconds(mesh.ep_group)
    out["mesh dense"] = _seconds(mesh.dense_group)
    out["mesh expert_dp"] = _seconds(mesh.expert_dp_group)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64),
                                tm.MoELayer(tm.MoEConfig(4, 6, P, 2), mesh=mesh, dtype=torch.float64))
    ddp = data_parallel(model, mesh, comm="lina", chunk_bytes=64)
    state = ddp._tritonmoe_data_parallel
    out["data_parallel dense"] = _seconds(state.dense_group)
    if state.expert_group is not None:
        out["data_parallel expert"] = _seconds(state.expert_group)
    state.scheduler.close()
    moe_mesh, dense_mesh = lay.device_meshes()
    out["parm device mesh ep"] = _seconds(moe_mesh.get_group("ep"))
    out["parm device mesh dense mp"] = _seconds(dense_mesh.get_group("mp"))
    from_mesh = type(pg).from_device_mesh(moe_mesh, dense_mesh["mp"])
    if from_mesh.ep_esp is not None and from_mesh.ep_esp is not moe_mesh.get_group("ep"):
        out["parm from_device_mesh ep_esp"] = _seconds(from_mesh.ep_esp)
    fsdp_mesh = _singleton_mesh(mesh)
    out["fsdp singleton"] = _seconds(fsdp_mesh.get_group())
    static = tm.MoELayer(tm.MoEConfig(4, 6, P, 2, ep_capacity=2), ep_group=short, dtype=torch.float64)
    out["static EP control (parent 3 s)"] = _seconds(static.expert_path._control)

    # A gradient lane whose thread cannot start: a typed error from the future, nothing queued.
    original = threading.Thread.start

    def no_thread(self, *a, **k):
        if self.name == "tritonmoe-grad-lane":
            raise RuntimeError("can't start new thread")
        return original(self, *a, **k)

    sched = CommScheduler.lina(64)
    threading.Thread.start = no_thread
    try:
        fut = sched.reduce(torch.ones(8, dtype=torch.float64), group=short)
    finally:
        threading.Thread.start = original
    try:
        fut.wait()
        out["lane"] = "no error"
    except LaneStartError as e:
        out["lane"] = f"LaneStartError: {e}"
    except BaseException as e:  # noqa: BLE001 - reported
        out["lane"] = f"{type(e).__name__}: {e}"
    out["lane queued"] = len(sched._queue)
    sched.close()
    dist.barrier(group=short)
    return out
