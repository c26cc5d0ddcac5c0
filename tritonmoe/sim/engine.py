"""The discrete-event engine: when every recorded operation of every rank starts and ends.

Input: one :class:`~tritonmoe.plan.Program` per rank (what :class:`~tritonmoe.plan.SimExecutor`
recorded from the schedule code) and a :class:`~tritonmoe.plan.CostModel`. Output: an
:class:`EngineResult` with each op's issue, start and end on a virtual clock and the
:class:`~tritonmoe.comm.Timeline` of every rank. The rules:

* **Host.** A rank's host issues its ops in program order, each after the ops it waited for
  ended (``SimOp.host_waits`` / ``host_after``; on the CPU host model a compute op is such a
  wait for the next op, since it runs on the issuing thread) and ``cost.host_op_s`` after the previous communication or
  copy op it issued.
* **Lanes.** Ops of one lane of one rank start in issue order (FIFO), at most
  ``cost.lane_slots[lane]`` at a time (default 1), each once its dependencies (``SimOp.deps``)
  have ended.
* **Priority** (:mod:`tritonmoe.comm.priority`, Lina): a collective of negative priority (a
  gradient micro-op) starts only while its rank has no collective of priority >= 0 (a token
  exchange) issued and not yet ended -- the real scheduler's gate. A running one is never
  pre-empted.
* **Collectives** are matched across their group's members by per-group sequence (the k-th
  collective a rank issues on a group meets every member's k-th): a mismatch of op or sizes
  between members raises :class:`CollectiveMismatchError` (on a real cluster: a hang, or gloo
  aborting). A collective starts when every member is ready; its span on each member starts
  when that member was ready (waiting for peers counts as communication, as in a measured
  timeline). A member that never issues it is a :class:`ScheduleHangError`.
* **Costs.** A transfer (collective, copy) is ``latency + demand``: the latency alone, then a
  data phase whose busy time on each resource it crosses (a rank's NIC or intra-node link, from
  :meth:`CostModel.collective_cost`) progresses at a max-min fair share of that resource: two
  equal transfers on one link take twice as long. A compute op's data phase is its roofline time
  (:meth:`CostModel.compute_time`) on the rank's compute resource (on the CPU host model with
  ``cost.host_cores``, also a share of its node's cores, so ranks computing at once slow each
  other down as on an oversubscribed CPU). Each op's rate is further
  capped by the interference factors (:meth:`CostModel.retained`) of the other classes running
  on its ranks.
* **Symmetric mode** (``symmetric=True``, for large P): only some ranks' programs are given
  (typically one); every other member of a group is assumed to issue the same collectives with
  the same sizes at the same time, so a collective starts when the simulated members are ready
  and costs what the decomposition gives with the absent members mirroring them. Exact when all
  ranks run identical programs (uniform routing); with skewed routing simulate the most loaded
  rank, which is then assumed to be the last to arrive at every collective.

The engine is deterministic (no randomness; ties broken by rank and program order).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tritonmoe.comm.timeline import Span, Timeline

from tritonmoe.sim.cost_model import COLLECTIVES, COPIES, CostModel
from tritonmoe.sim.executor import Program, SimOp

__all__ = [
    "SimulationError",
    "CollectiveMismatchError",
    "ScheduleHangError",
    "OpTiming",
    "EngineResult",
    "run",
    "op_class",
]

#: Pairwise split checks of an all-to-all up to this group size (above: totals only).
_PAIRWISE_CHECK_MAX_P = 64
_EPS = 1e-12


class SimulationError(RuntimeError):
    """The simulated schedule cannot run as recorded."""


class CollectiveMismatchError(SimulationError, ValueError):
    """Members of a group issued different collectives (or sizes) at the same sequence number: on
    a real cluster the ranks would hang or gloo would abort."""


class ScheduleHangError(SimulationError):
    """Some rank waits forever: a collective some member never issues, or a dependency cycle."""


def op_class(op: SimOp) -> str:
    """Interference class of an op: "comm" (collectives), "mem" (copies), "comp" (compute)."""
    if op.op in COLLECTIVES:
        return "comm"
    if op.op in COPIES:
        return "mem"
    return "comp"


@dataclass
class OpTiming:
    """When an op was issued by its host, started on its lane (for a collective: when this
    member was ready) and ended, in seconds."""

    issue: float = math.nan
    start: float = math.nan
    end: float = math.nan


@dataclass
class EngineResult:
    """Timings of every op (``timings[rank][index]``) and the :class:`Timeline` of all ranks."""

    programs: list[Program]
    timings: dict[int, list[OpTiming]]
    timeline: Timeline
    symmetric: bool = False

    def step_time(self) -> float:
        """First start to last end over every simulated rank."""
        starts = [t.start for ts in self.timings.values() for t in ts]
        ends = [t.end for ts in self.timings.values() for t in ts]
        return (max(ends) - min(starts)) if ends else 0.0

    def rank_end(self, rank: int) -> float:
        return max((t.end for t in self.timings[rank]), default=0.0)


class _Flow:
    """A running transfer or computation: latency phase, then ``work`` seconds at full speed
    spread over ``usage`` (resource -> fraction of the flow's full-speed time it is busy)."""

    __slots__ = ("members", "klass", "lat_end", "remaining", "usage", "rate", "ranks")

    def __init__(self, members, klass, lat_end, work, demands, ranks):
        self.members = members  # [(rank, op index)]
        self.klass = klass
        self.lat_end = lat_end
        self.remaining = work
        self.usage = {r: d / work for r, d in demands.items()} if work > 0 else {}
        self.rate = 0.0
        self.ranks = ranks  # ranks whose interference applies


@dataclass
class _Match:
    ops: dict = field(default_factory=dict)  # rank -> op index
    arrived: dict = field(default_factory=dict)  # rank -> time ready
    first: Optional[SimOp] = None


def _size_mismatch(op: str, ranks: tuple, ops: dict, symmetric: bool) -> Optional[str]:
    """What disagrees between the members' sizes of one matched collective (``ops``: rank ->
    :class:`SimOp`; ``op`` its kind), or None: an all-to-all's (or exchange's) pairwise sends and
    receives (totals only above :data:`_PAIRWISE_CHECK_MAX_P` ranks; nothing to compare in
    symmetric mode with absent members), another collective's input sizes."""
    P = len(ranks)
    if op in ("all_to_all", "send_recv"):
        if symmetric and len(ops) < P:
            return None  # absent members mirror the simulated ones: nothing to compare them with
        if P > _PAIRWISE_CHECK_MAX_P:
            if sum(sum(o.send_bytes) for o in ops.values()) != sum(sum(o.recv_bytes) for o in ops.values()):
                return "the bytes sent and received over the group differ"
            return None
        for s_i, s in enumerate(ranks):
            for d_i, d in enumerate(ranks):
                if ops[s].send_bytes[d_i] != ops[d].recv_bytes[s_i]:
                    return (
                        f"rank {s} sends {ops[s].send_bytes[d_i]} bytes to rank {d}, which expects "
                        f"{ops[d].recv_bytes[s_i]}"
                    )
        return None
    sizes = {r: o.send_bytes[0] if o.send_bytes else 0 for r, o in ops.items()}
    if len(set(sizes.values())) > 1:
        return "input sizes differ: " + ", ".join(f"rank {r}: {v} B" for r, v in sizes.items())
    return None


def _fair_share(data: list[_Flow]) -> None:
    """Set each flow's ``rate`` (fraction of its full speed, from 0) to its max-min fair share of
    the resources it crosses, by progressive filling: every unfrozen flow's rate grows alike until
    a resource saturates or a flow reaches full speed, whose flows then freeze. Flows that share
    no resource all run at full speed."""
    users: dict = {}
    shared = False
    for f in data:
        for res in f.usage:
            n = users.get(res, 0) + 1
            users[res] = n
            shared = shared or n > 1
    if shared:
        cap_left = {res: 1.0 for res in users}
        unfrozen = list(data)
        while unfrozen:
            load: dict = {}
            for f in unfrozen:
                for res, u in f.usage.items():
                    load[res] = load.get(res, 0.0) + u
            delta = min([cap_left[res] / l for res, l in load.items() if l > 0] + [1.0 - f.rate for f in unfrozen])
            delta = max(delta, 0.0)
            for f in unfrozen:
                f.rate += delta
            for res, l in load.items():
                cap_left[res] -= delta * l
            saturated = {res for res, l in load.items() if l > 0 and cap_left[res] <= 1e-12}
            unfrozen = [
                f for f in unfrozen if 1.0 - f.rate > 1e-12 and not any(res in saturated for res in f.usage)
            ]
    else:  # no resource is shared: every op at full speed
        for f in data:
            f.rate = 1.0


class _Engine:
    """One simulation's state and event loop (the rules of the module docstring): hosts issue,
    collectives are matched across members, lanes start their ops, flows share resources."""

    def __init__(self, programs: Sequence[Program], cost: CostModel, symmetric: bool) -> None:
        self.cost = cost
        self.symmetric = symmetric
        self.progs = {p.rank: p for p in programs}
        if len(self.progs) != len(programs):
            raise ValueError("two programs for one rank")
        hc = {p.host_compute for p in programs}
        if len(hc) > 1:
            raise ValueError("programs mix the CPU and the CUDA host model")
        self.now = 0.0
        self.timings = {r: [OpTiming() for _ in p.ops] for r, p in self.progs.items()}
        self.pending = {r: [len(o.deps) for o in p.ops] for r, p in self.progs.items()}
        self.dependents: dict[int, list[list[int]]] = {}
        for r, p in self.progs.items():
            dep = [[] for _ in p.ops]
            for o in p.ops:
                for d in o.deps:
                    if not 0 <= d < o.index:
                        raise SimulationError(f"rank {r} op {o.index} depends on op {d}, not an earlier op")
                    dep[d].append(o.index)
            self.dependents[r] = dep
        self.next_issue = {r: 0 for r in self.progs}
        self.host_free = {r: 0.0 for r in self.progs}
        self.queues: dict[int, dict[str, deque]] = {r: {} for r in self.progs}
        self.running: dict[tuple, int] = {}
        self.seq: dict[tuple, int] = {}
        self.matches: dict[tuple, _Match] = {}
        self.op_match: dict[tuple, tuple] = {}
        self.flows: list[_Flow] = []
        self.active_classes: dict[int, dict[str, int]] = {r: {} for r in self.progs}
        self.exchanges_open: dict[int, int] = {r: 0 for r in self.progs}  # issued, not ended (priority >= 0)
        self.heap: list = []
        self.counter = 0
        self.done = 0
        self.total = sum(len(p.ops) for p in self.progs.values())
        self.rates_dirty = True
        self.cpu_share = cost.cpu_share()
        if symmetric and self.cpu_share is not None:
            raise ValueError("symmetric mode cannot model ranks sharing a CPU (host_cores): simulate every rank")

    # -- host ----------------------------------------------------------------------------------

    def try_issue(self, r: int) -> None:
        prog = self.progs[r]
        ops = prog.ops
        tim = self.timings[r]
        while self.next_issue[r] < len(ops):
            i = self.next_issue[r]
            o = ops[i]
            t = self.host_free[r]
            for w in o.host_waits + ((o.host_after,) if o.host_after is not None else ()):
                e = tim[w].end
                if math.isnan(e):
                    return  # the host is blocked in a wait (or running a compute) until it ends
                t = max(t, e)
            if t > self.now + _EPS:
                self.push(t, "issue", r)
                return
            t = max(t, self.now)
            tim[i].issue = t
            self.next_issue[r] = i + 1
            if o.op != "compute":
                self.host_free[r] = t + self.cost.host_op_s
            else:
                self.host_free[r] = t
            self.queues[r].setdefault(o.lane, deque()).append(i)
            if o.op in COLLECTIVES:
                self.register(r, o)
                if o.priority >= 0:
                    self.exchanges_open[r] += 1

    # -- collectives ---------------------------------------------------------------------------

    def register(self, r: int, o: SimOp) -> None:
        g = o.group
        k = self.seq.get((r, g.ranks), 0)
        self.seq[(r, g.ranks)] = k + 1
        key = (g.ranks, k)
        m = self.matches.get(key)
        if m is None:
            m = self.matches[key] = _Match(first=o)
        else:
            f = m.first
            if f.op != o.op:
                raise CollectiveMismatchError(
                    f"collective #{k} on group {g.ranks}: rank {f.rank} issued {f.op} '{f.kind}' (micro-op {f.micro_op}, "
                    f"{f.phase}) but rank {r} issued {o.op} '{o.kind}' (micro-op {o.micro_op}, {o.phase}); on a real "
                    "cluster these ranks would hang. Issue collectives in the same order on every rank"
                )
        m.ops[r] = o.index
        self.op_match[(r, o.index)] = key
        if len(m.ops) == self.expected(g):
            self.check_sizes(key, m)

    def expected(self, g) -> int:
        return sum(1 for q in g.ranks if q in self.progs) if self.symmetric else g.size

    def check_sizes(self, key, m: _Match) -> None:
        ranks, k = key
        ops = {r: self.progs[r].ops[i] for r, i in m.ops.items()}
        first = m.first
        bad = _size_mismatch(first.op, ranks, ops, self.symmetric)
        if bad:
            raise CollectiveMismatchError(
                f"collective #{k} on group {ranks} ({first.op} '{first.kind}', micro-op {first.micro_op}, {first.phase}): "
                f"{bad}; on a real cluster this hangs or aborts. Derive every split from one counts exchange"
            )

    # -- lanes ---------------------------------------------------------------------------------

    def dispatch(self, r: int) -> None:
        prog = self.progs[r]
        for lane, q in self.queues[r].items():
            slots = self.cost.lane_slots.get(lane, 1)
            while q and self.running.get((r, lane), 0) < slots:
                i = q[0]
                if self.pending[r][i] > 0:
                    break
                o = prog.ops[i]
                if o.priority < 0 and o.op in COLLECTIVES and self.exchanges_open[r] > 0:
                    break  # gated behind the rank's token exchanges (priority scheduling)
                q.popleft()
                self.running[(r, lane)] = self.running.get((r, lane), 0) + 1
                self.start(r, prog.ops[i])

    def start(self, r: int, o: SimOp) -> None:
        self.timings[r][o.index].start = self.now
        if o.op == "compute":
            work = self.cost.compute_time(o.work)
            if self.cost.host_compute:
                work += self.cost.compute_op_s  # the executor's own cost, on the issuing thread
            demands = {("compute", r): work}
            if self.cpu_share is not None and work > 0:  # ranks of a node share its cores
                demands[("cpu", self.cost.node_of(r))] = work * self.cpu_share
            self.add_flow([(r, o.index)], "comp", 0.0, work, demands, [r])
        elif o.op in COPIES:
            lat, dem = self.cost.copy_cost(o.op, r, sum(o.send_bytes))
            work = max(dem.values(), default=0.0)
            self.add_flow([(r, o.index)], "mem", lat, work, dem, [r])
        else:
            key = self.op_match[(r, o.index)]
            m = self.matches[key]
            m.arrived[r] = self.now
            if len(m.arrived) == self.expected(o.group):
                self.start_collective(key, m)

    def start_collective(self, key, m: _Match) -> None:
        ranks, _ = key
        members = sorted(m.ops)
        ops = [self.progs[r].ops[m.ops[r]] for r in members]
        pos = {q: j for j, q in enumerate(ranks)}
        idx = [pos[r] for r in members]
        op = ops[0].op
        if op in ("all_to_all", "send_recv"):
            send = [o.send_bytes for o in ops]
            recv = [o.recv_bytes for o in ops]
        else:
            send = [o.send_bytes for o in ops]
            recv = send
        lat, dem = self.cost.collective_cost(op, ranks, send, recv, members=idx)
        work = max(dem.values(), default=0.0)
        self.add_flow([(r, m.ops[r]) for r in members], "comm", lat, work, dem, members)
        del self.matches[key]

    def add_flow(self, members, klass, lat, work, demands, ranks) -> None:
        values = [lat, work, *demands.values()]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            r, i = members[0]
            raise SimulationError(
                f"rank {r} op {i} ({klass}) costs latency={lat!r}, work={work!r}, demands={dict(demands)!r}: a time "
                "of the cost model or of its Work is not finite or is negative"
            )
        f = _Flow(members, klass, self.now + lat, work, demands, ranks)
        self.flows.append(f)
        for r in ranks:
            ac = self.active_classes[r]
            ac[klass] = ac.get(klass, 0) + 1
        self.rates_dirty = True

    # -- rates ---------------------------------------------------------------------------------

    def compute_rates(self) -> None:
        """Rates of the running data phases: the max-min fair share of the resources each
        crosses (progressive filling), times its interference factor (the speed it keeps while
        other classes of work run on its ranks, :meth:`CostModel.retained`)."""
        data = [f for f in self.flows if f.lat_end <= self.now + _EPS and f.remaining > 0]
        for f in self.flows:
            f.rate = 0.0
        self.rates_dirty = False
        if not data:
            return
        _fair_share(data)
        for f in data:
            factor = 1.0
            for r in f.ranks:
                ac = self.active_classes[r]
                others = [c for c, n in ac.items() if n > (1 if c == f.klass else 0)]
                if others:
                    factor = min(factor, self.cost.retained(f.klass, others))
            f.rate *= factor

    # -- events --------------------------------------------------------------------------------

    def push(self, t: float, what: str, payload) -> None:
        if not math.isfinite(t):
            raise SimulationError(f"an op of rank {payload} would end at t={t!r} s: a time of the cost model or of "
                                  "its Work is not finite")
        self.counter += 1
        heapq.heappush(self.heap, (t, self.counter, what, payload))

    def finish(self, f: _Flow) -> set:
        touched = set()
        for r, i in f.members:
            self.timings[r][i].end = self.now
            o = self.progs[r].ops[i]
            self.running[(r, o.lane)] -= 1
            if o.op in COLLECTIVES and o.priority >= 0:
                self.exchanges_open[r] -= 1
            for j in self.dependents[r][i]:
                self.pending[r][j] -= 1
            self.done += 1
            touched.add(r)
        for r in f.ranks:
            self.active_classes[r][f.klass] -= 1
        self.rates_dirty = True
        return touched

    def run(self) -> None:
        for r in sorted(self.progs):
            self.try_issue(r)
            self.dispatch(r)
        # every step ends a flow or a timer, or starts one that a later step ends: a few steps per
        # op bound a run; a run past the bound is a non-finite or degenerate time, not a schedule
        bound = 64 * (self.total + 1) + 10_000
        steps = 0
        while True:
            steps += 1
            if steps > bound:
                raise SimulationError(
                    f"the simulation made no progress after {bound} steps at t={self.now:g} s ({self.done} of "
                    f"{self.total} ops done): a time or rate of the cost model or of an op's Work is not finite "
                    "or not positive"
                )
            if self.rates_dirty:
                self.compute_rates()
            t_next = math.inf
            for f in self.flows:
                if f.lat_end > self.now + _EPS:
                    t_next = min(t_next, f.lat_end)
                elif f.remaining <= 0:
                    t_next = self.now
                elif f.rate > 0:
                    end = self.now + f.remaining / f.rate
                    if math.isnan(end):
                        raise SimulationError(f"a transfer's end became NaN at t={self.now:g} s: a size or rate of "
                                              "the cost model is not a number")
                    t_next = min(t_next, end)
            if self.heap:
                t_next = min(t_next, self.heap[0][0])
            if math.isnan(t_next):
                raise SimulationError(f"a simulated time became NaN at t={self.now:g} s: a time or rate of the cost "
                                      "model or of an op's Work is not a number")
            if not math.isfinite(t_next):
                break
            dt = max(0.0, t_next - self.now)
            for f in self.flows:
                if f.lat_end <= self.now + _EPS and f.remaining > 0 and f.rate > 0:
                    f.remaining -= f.rate * dt
            prev = self.now
            self.now = max(self.now, t_next)
            tol = 1e-9 * max(1e-6, self.now)
            touched: set = set()
            still = []
            for f in self.flows:
                if f.lat_end <= self.now + _EPS:
                    if f.lat_end > prev + _EPS:
                        self.rates_dirty = True  # a latency phase ended: it now competes for links
                    if f.remaining <= tol * max(f.rate, 1e-30) or f.remaining <= 1e-15:
                        touched |= self.finish(f)
                        continue
                still.append(f)
            self.flows = still
            while self.heap and self.heap[0][0] <= self.now + _EPS:
                _, _, what, r = heapq.heappop(self.heap)
                touched.add(r)
            for r in sorted(touched):
                self.try_issue(r)
            # a finished op can free a lane on its rank; an issue can fill one
            for r in sorted(touched):
                self.dispatch(r)
        if self.done != self.total:
            raise ScheduleHangError(_hang_report(self))


def _hang_report(self: _Engine) -> str:
    """Where each stuck rank waits, for the ScheduleHangError."""
    lines = []
    for r, prog in sorted(self.progs.items()):
        tim = self.timings[r]
        stuck = next((o for o in prog.ops if math.isnan(tim[o.index].end)), None)
        if stuck is None:
            continue
        why = ""
        key = self.op_match.get((r, stuck.index))
        if key is not None and key in self.matches:
            m = self.matches[key]
            missing = [q for q in stuck.group.ranks if q in self.progs and q not in m.ops]
            why = f"waits in collective #{key[1]} on group {key[0]}; never issued by ranks {missing}"
        elif self.pending[r][stuck.index]:
            why = "waits for a dependency that never ends"
        else:
            why = "never started"
        lines.append(f"rank {r}: op {stuck.index} {stuck.op} '{stuck.kind}' (micro-op {stuck.micro_op}, {stuck.phase}) {why}")
    return "the schedule never finishes (a real run would hang): " + "; ".join(lines[:8])


def run(
    programs: Sequence[Program],
    cost: CostModel,
    *,
    symmetric: bool = False,
    timeline: bool = True,
) -> EngineResult:
    """Simulate ``programs`` (one per rank; a subset with ``symmetric=True``) on ``cost``.

    Returns an :class:`EngineResult` (op timings and, with ``timeline``, a
    :class:`~tritonmoe.comm.Timeline` of every simulated rank). Raises
    :class:`CollectiveMismatchError` or :class:`ScheduleHangError` for schedules that would
    hang on a real cluster, :class:`~tritonmoe.plan.CostModelError` when the cost model cannot
    price an op."""
    if not programs:
        raise ValueError("run() needs at least one program")
    eng = _Engine(programs, cost, symmetric)
    eng.run()
    tl = Timeline()
    if timeline:
        for r in sorted(eng.progs):
            for o, t in zip(eng.progs[r].ops, eng.timings[r]):
                tl.add(Span(o.kind, o.micro_op, o.phase, t.start, t.end, o.lane, r))
    return EngineResult(list(programs), eng.timings, tl, symmetric)
