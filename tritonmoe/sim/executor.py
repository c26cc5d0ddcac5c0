"""The simulated executor: records what a schedule issues, on every rank of a virtual cluster.

:class:`SimExecutor` implements :class:`tritonmoe.comm.executor.Executor` without running
anything: each call appends a :class:`SimOp` (lane, dependencies, collective group and bytes,
compute :class:`~tritonmoe.comm.executor.Work`) to the rank's :class:`Program` and returns a
:class:`~tritonmoe.comm.executor.Handle` whose value is a
:class:`~tritonmoe.comm.executor.VirtualTensor`. Running the same schedule code once per rank
(each with its own plan) gives P programs; the discrete-event engine
(:mod:`tritonmoe.sim.engine`) then assigns every op a start and end on virtual clocks from a
cost model, matching each collective across its group's members.

Groups are :class:`VirtualGroup` (the global ranks of the members, in group-rank order).

Host model (what the engine needs to know about the issuing thread):

* ``host_compute=True`` (CPU / gloo): ``compute`` runs on the issuing thread, so no later op is
  issued before it ends, and ``wait`` blocks the thread until the awaited op ends.
* ``host_compute=False`` (CUDA): ``compute`` is an asynchronous launch and ``wait`` only orders
  the compute lane after the awaited op; the host runs ahead.

Every op records ``host_after``: the highest-numbered op whose end the host awaited before
issuing it, and ``host_waits``: every op the host awaited since it issued the previous op (a
compute on the CPU host model counts: the thread ran it), so the engine issues an op only after
all of them ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from tritonmoe.comm.executor import COMM, COMPUTE, COPY, Executor, Handle, VirtualTensor, Work

__all__ = ["VirtualGroup", "SimOp", "Program", "SimExecutor"]


@dataclass(frozen=True)
class VirtualGroup:
    """A process group of the virtual cluster: the global ranks of its members, in group-rank
    order."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"a group needs distinct ranks, got {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass
class SimOp:
    """One recorded operation of one rank.

    Attributes:
        rank: the global rank that issued it; ``index``: its position in that rank's program.
        lane, op, kind, micro_op, phase: as in :class:`~tritonmoe.comm.executor.TraceEntry`.
        deps: indices (same rank) of the ops whose results it uses or that it must follow.
        host_after: index of the op the host last waited for before issuing it (None: none).
        host_waits: the ops the host waited for between the previous op's issue and this one's.
        group: the collective's :class:`VirtualGroup` (None for compute and copies).
        send_bytes: bytes sent to each group member, in group-rank order (collectives); for a
            copy, ``(bytes,)``.
        recv_bytes: bytes received from each group member (collectives).
        work: the compute's cost description (compute ops).
        priority: the issuing schedule's priority (priority lanes).
    """

    rank: int
    index: int
    lane: str
    op: str
    kind: str
    micro_op: int
    phase: str
    deps: tuple[int, ...] = ()
    host_after: Optional[int] = None
    host_waits: tuple[int, ...] = ()
    group: Optional[VirtualGroup] = None
    send_bytes: tuple[int, ...] = ()
    recv_bytes: tuple[int, ...] = ()
    work: Optional[Work] = None
    priority: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends (collectives) or moves (copies)."""
        return sum(self.send_bytes)


@dataclass
class Program:
    """Every op one rank issued, in issue order, and how its host behaves."""

    rank: int
    host_compute: bool
    ops: list[SimOp] = field(default_factory=list)
    #: the op the host waited for last (the next op's ``host_after``)
    host_after: Optional[int] = None
    #: ops the host waited for since the last issued op (the next op's ``host_waits``)
    host_pending: set = field(default_factory=set)
    #: CUDA model: ops the compute lane was told to wait for (a stream wait), applied to its next op
    compute_waits: set = field(default_factory=set)


def _vt(x: Any) -> VirtualTensor:
    v = x.value if isinstance(x, Handle) else x
    if isinstance(v, VirtualTensor):
        return v
    if isinstance(v, torch.Tensor):
        return VirtualTensor(tuple(v.shape), v.dtype)
    raise TypeError(f"the simulator needs VirtualTensor (or tensor) arguments, got {type(v).__name__}")


class SimExecutor(Executor):
    """Records a schedule's operations for rank ``rank`` (see the module docstring).

    Args:
        rank: this program's global rank.
        world: the default group (used when an op passes ``group=None``).
        host_compute: the host model (True: CPU/gloo, False: CUDA).
        program: the :class:`Program` to append to (a new one when None), so the forward and the
            backward schedule of a step go into one program.
    """

    def __init__(
        self,
        rank: int,
        world: VirtualGroup,
        *,
        host_compute: bool,
        phase: str = "fwd",
        program: Optional[Program] = None,
    ) -> None:
        super().__init__(phase=phase)
        self.rank = rank
        self.world = world
        if program is not None and program.host_compute != host_compute:
            raise ValueError("a program continues with the host model it started with")
        self.program = program if program is not None else Program(rank, host_compute)

    # -- recording -----------------------------------------------------------------------------

    def _deps(self, args: Sequence[Any], after: Sequence[Handle]) -> tuple[int, ...]:
        idx = []
        for a in list(args) + list(after):
            if isinstance(a, Handle):
                if a.executor is not self and getattr(a.executor, "program", None) is not self.program:
                    raise ValueError("a handle of another rank's executor was passed to this one")
                idx.append(a.index)
        return tuple(sorted(set(idx)))

    def _record(self, lane, op, kind, micro_op, deps, value, **fields) -> Handle:
        entry = self._entry(lane, op, kind, micro_op)
        prog = self.program
        index = len(prog.ops)
        if lane == COMPUTE and prog.compute_waits:
            deps = tuple(sorted(set(deps) | prog.compute_waits))
            prog.compute_waits = set()
        sim = SimOp(
            rank=self.rank, index=index, lane=lane, op=op, kind=kind, micro_op=int(micro_op), phase=self.phase,
            deps=deps, host_after=prog.host_after, host_waits=tuple(sorted(prog.host_pending)), **fields,
        )
        prog.host_pending = set()
        self.program.ops.append(sim)
        return Handle(self, index, lane, entry, value)

    def _group(self, group: Any) -> VirtualGroup:
        g = self.world if group is None else group
        if not isinstance(g, VirtualGroup):
            raise TypeError(f"the simulator's groups are VirtualGroup, got {type(g).__name__}")
        if self.rank not in g.ranks:
            raise ValueError(f"rank {self.rank} issued a collective on a group it is not in: {g.ranks}")
        return g

    def compute(self, fn, *args, work, kind, micro_op=0, out=None, lane=COMPUTE, after=()):
        if not isinstance(work, Work):
            raise TypeError(f"compute(kind={kind!r}) needs work=Work(...) for the simulator, got {work!r}")
        if callable(out) and not isinstance(out, VirtualTensor):
            out = out(*[_vt(a) if isinstance(a, (Handle, torch.Tensor, VirtualTensor)) else a for a in args])
        h = self._record(lane, "compute", kind, micro_op, self._deps(args, after), out, work=work)
        if self.program.host_compute and lane == COMPUTE:
            self.program.host_after = h.index  # the issuing thread ran it
            self.program.host_pending.add(h.index)
        return h

    def all_to_all(self, x, send_splits, recv_splits, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        g = self._group(group)
        v = _vt(x)
        if len(send_splits) != g.size or len(recv_splits) != g.size:
            raise ValueError(f"all_to_all on {g.size} ranks needs {g.size} splits, got {len(send_splits)}/{len(recv_splits)}")
        rb = v.row_bytes()
        return self._record(
            lane, "all_to_all", kind, micro_op, self._deps([x], after), v.with_rows(sum(recv_splits)),
            group=g, send_bytes=tuple(int(s) * rb for s in send_splits),
            recv_bytes=tuple(int(s) * rb for s in recv_splits), priority=priority,
        )

    def all_gather(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        g = self._group(group)
        v = _vt(x)
        return self._record(
            lane, "all_gather", kind, micro_op, self._deps([x], after), v.with_rows(v.shape[0] * g.size),
            group=g, send_bytes=tuple(v.nbytes for _ in g.ranks), recv_bytes=tuple(v.nbytes for _ in g.ranks),
            priority=priority,
        )

    def all_reduce(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        g = self._group(group)
        v = _vt(x)
        return self._record(
            lane, "all_reduce", kind, micro_op, self._deps([x], after), v,
            group=g, send_bytes=(v.nbytes,), recv_bytes=(v.nbytes,), priority=priority,
        )

    def reduce_scatter(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        g = self._group(group)
        v = _vt(x)
        return self._record(
            lane, "reduce_scatter", kind, micro_op, self._deps([x], after), v.with_rows(v.shape[0] // g.size),
            group=g, send_bytes=(v.nbytes,), recv_bytes=(v.nbytes // g.size,), priority=priority,
        )

    def send_recv(self, sends, recvs, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        g = self._group(group)
        sb = [0] * g.size
        rbytes = [0] * g.size
        for t, peer in sends:
            sb[peer] += _vt(t).nbytes
        outs = []
        for like, peer in recvs:
            v = _vt(like)
            rbytes[peer] += v.nbytes
            outs.append(v)
        return self._record(
            lane, "send_recv", kind, micro_op, self._deps([t for t, _ in sends], after), outs,
            group=g, send_bytes=tuple(sb), recv_bytes=tuple(rbytes), priority=priority,
        )

    def copy(self, x, *, to, kind, micro_op=0, lane=COPY, out=None, after=()):
        if to not in ("host", "device"):
            raise ValueError(f"copy(to={to!r}): use 'host' or 'device'")
        v = _vt(x)
        return self._record(
            lane, "copy_d2h" if to == "host" else "copy_h2d", kind, micro_op, self._deps([x], after), v,
            send_bytes=(v.nbytes,),
        )

    def host_sync(self, h: Handle) -> Any:
        """The host blocks until ``h`` ends, on either host model (a ``.tolist()`` of a device
        tensor on CUDA, e.g. the split sizes after the counts exchange)."""
        prog = self.program
        prog.host_after = max(h.index, prog.host_after if prog.host_after is not None else -1)
        prog.host_pending.add(h.index)
        return h.value

    def wait(self, h: Handle) -> Any:
        prog = self.program
        if prog.host_compute:  # the issuing thread blocks until h ends
            prog.host_after = max(h.index, prog.host_after if prog.host_after is not None else -1)
            prog.host_pending.add(h.index)
        else:  # CUDA: the compute stream waits for h's event; the host runs on
            prog.compute_waits.add(h.index)
        return h.value
