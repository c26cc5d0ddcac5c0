"""Cost models: what a collective, a copy and a compute cost, fitted by least squares or derived.

A :class:`CostModel` answers three questions for the discrete-event engine
(:mod:`tritonmoe.sim.engine`):

* **Collectives and copies**: ``alpha + beta * nbytes`` seconds per (collective kind, group size,
  link class), the alpha-beta model of Parm (paper 003 Eq. 12), fitted by least squares
  (:meth:`CostModel.fit`) from timed runs (``python -m tritonmoe.plan profile``). Where a single
  line does not fit the measurements (held-out error above :data:`PIECEWISE_TRIGGER`), the fit is
  piecewise in size, as MPMoE argues for hardware that is under-used at small volumes (004 §IV-B).
  ``nbytes`` is always what each rank passes in: the whole send buffer of an all-to-all (its own
  rows included), the shard of an all-gather, the full input of a reduce-scatter or all-reduce,
  the bytes a rank sends in a point-to-point exchange, the bytes of a copy.
* **Compute**: a roofline per :class:`~tritonmoe.comm.executor.Work` kind (``"gemm"``,
  ``"elementwise"``, ``"copy"``): ``launches * launch_s + t_ideal / eff(t_ideal)`` with
  ``t_ideal = max(flops / flops_per_s, bytes / bytes_per_s)`` and an efficiency curve ``eff``
  (piecewise linear in log t_ideal; 1 when the measurements show no under-utilization).
* **Interference** (MPMoE §4.4): ``interference[(y, x)]`` is the fraction of its speed an
  operation of class y (``"comm"``, ``"comp"``, ``"mem"``) keeps while an operation of class x
  (or ``"all"``: two other classes) runs concurrently on the same rank; 1 when not given.

A cost model derived from a :class:`~tritonmoe.plan.Cluster` (``cluster.cost_model(dtype)``)
keeps the cluster and decomposes every collective into link traffic instead (all-to-all
pairwise over intra- and inter-node links, rings for all-gather / reduce-scatter, all-reduce =
RS + AG), so concurrent transfers fair-share the links they cross.

Files are versioned JSON (:data:`FORMAT`, :data:`VERSION`): :meth:`CostModel.save` /
:meth:`CostModel.load`. A missing file, another version, or a group size the model was not fitted
for is an error that names the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from tritonmoe.comm.executor import Work
from tritonmoe.core.suggest import suggest_unknown_kwargs

from .fits import (
    COLLECTIVES, COPIES, LINK_CLASSES, OP_CLASSES, CommSample, ComputeRate, ComputeSample, CostModelError, HostSample,
    InterferenceSample, LinearFit, fit_linear, fit_host, fit_compute, sample_from_json,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "COLLECTIVES",
    "COPIES",
    "LINK_CLASSES",
    "OP_CLASSES",
    "CostModelError",
    "LinearFit",
    "ComputeRate",
    "CommSample",
    "ComputeSample",
    "InterferenceSample",
    "HostSample",
    "CostModel",
    "fit_linear",
    "GPU",
    "Link",
    "Cluster",
    "PRESETS",
    "GPUS",
    "LINKS",
    "EFFICIENCY",
]

FORMAT = "tritonmoe.plan.CostModel"
VERSION = 1


@dataclass
class CostModel:
    """What operations cost on one machine or cluster (see the module docstring).

    Attributes:
        collectives: ``(kind, group_size, link) -> LinearFit`` of seconds in bytes per rank.
        copies: ``"copy_d2h"/"copy_h2d" -> LinearFit``.
        compute: Work kind -> :class:`ComputeRate`.
        interference: ``(y, x) -> retained speed fraction`` (MPMoE's alpha(y, x)).
        host_compute: the host model of the machine (True: CPU/gloo, compute runs on the
            issuing thread; False: CUDA).
        host_op_s: host seconds to issue one collective or copy.
        compute_op_s: host seconds the executor adds around one compute (CPU host model).
        lane_slots: operations a lane may run at once (default 1: one CUDA stream; gloo runs
            a process group's asynchronous work on ``threads`` worker threads).
        ranks_per_node: ranks per node of the machine the model describes (None: every rank
            on one node, so every group is "intra").
        host_cores: CPU host model only: the cores one node's ranks share for compute (measured:
            the slowdown when every rank computes at once), None for no sharing. A compute op
            of a rank running ``threads_per_rank`` threads then uses ``threads_per_rank /
            host_cores`` of the node's CPU, so ops of several ranks fair-share it; the compute
            rates are those of one rank computing alone.
        dtype: the element type the compute rates were measured or derived in.
        cluster: the :class:`~tritonmoe.plan.Cluster` of a derived model (collectives are then
            decomposed into link traffic), else None.
        source: where the model comes from ("profile", "cluster:<name>", ...); ``meta``: free
            form (machine, versions, date, load); ``path``: the file it was loaded from.
        samples: the measurements a fitted model came from (kept in its file, so it can be
            refitted or inspected; not part of its fingerprint).
    """

    collectives: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)
    compute: dict = field(default_factory=dict)
    interference: dict = field(default_factory=dict)
    host_compute: bool = False
    host_op_s: float = 0.0
    compute_op_s: float = 0.0
    lane_slots: dict = field(default_factory=dict)
    ranks_per_node: Optional[int] = None
    host_cores: Optional[float] = None
    threads_per_rank: int = 1
    dtype: str = "bfloat16"
    cluster: Any = None
    source: str = "synthetic"
    meta: dict = field(default_factory=dict)
    path: Optional[str] = None
    samples: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_model_values(self)

    # -- fitting -------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        measurements: Iterable[Any],
        *,
        host_compute: bool = True,
        dtype: str = "float32",
        lane_slots: Optional[Mapping[str, int]] = None,
        ranks_per_node: Optional[int] = None,
        host_cores: Optional[float] = None,
        threads_per_rank: int = 1,
        source: str = "profile",
        meta: Optional[dict] = None,
        piecewise: bool = True,
    ) -> "CostModel":
        """Fit a model from :class:`CommSample`, :class:`ComputeSample`,
        :class:`InterferenceSample` and :class:`HostSample` records (any mix, any order):
        alpha/beta per (kind, group size, link) and per copy direction, a roofline per compute
        kind, the median retained speed per (y, x) and the median host issue time."""
        measurements = list(measurements)
        comm, comp, inter, host, host_compute_s = _group_samples(measurements)
        model = cls(
            host_compute=host_compute,
            host_op_s=statistics.median(host) if host else 0.0,
            compute_op_s=statistics.median(host_compute_s) if host_compute_s else 0.0,
            lane_slots=dict(lane_slots or {}),
            ranks_per_node=ranks_per_node,
            host_cores=host_cores,
            threads_per_rank=threads_per_rank,
            dtype=dtype,
            source=source,
            meta=dict(meta or {}),
            samples=measurements,
        )
        _fit_groups(model, comm, comp, inter, piecewise=piecewise)
        return model

    def refit(self, **overrides: Any) -> "CostModel":
        """Fit again from :attr:`samples` (e.g. after a change of the fitting procedure), keeping
        the model's settings unless overridden."""
        if not self.samples:
            raise CostModelError(f"{self._where()} keeps no samples to refit (re-run `python -m tritonmoe.plan profile`)")
        kw = dict(host_compute=self.host_compute, dtype=self.dtype, lane_slots=self.lane_slots,
                  ranks_per_node=self.ranks_per_node, host_cores=self.host_cores,
                  threads_per_rank=self.threads_per_rank, source=self.source, meta=self.meta)
        kw.update(overrides)
        return CostModel.fit(self.samples, **kw)

    # -- questions -----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"cost model file {self.path}" if self.path else f"this cost model ({self.source})"

    def group_sizes(self, kind: Optional[str] = None) -> list[int]:
        """Group sizes with a fitted collective (of ``kind`` if given)."""
        return sorted({p for (k, p, _l) in self.collectives if kind is None or k == kind})

    def collective_fit(self, kind: str, group_size: int, link_class: str = "intra") -> LinearFit:
        """The fitted line of a collective, or a :class:`CostModelError` naming the file and
        the fix."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVES)}")
        if link_class not in LINK_CLASSES:
            raise ValueError(f"link_class={link_class!r}; use 'intra' or 'inter'")
        if self.cluster is not None:
            return self.cluster.collective_line(kind, group_size, link_class)
        if group_size == 1:
            return LinearFit.line(0.0, 0.0)
        fit = self.collectives.get((kind, int(group_size), link_class))
        if fit is None:
            sizes = self.group_sizes(kind)
            links = sorted({l for (k, p, l) in self.collectives if k == kind and p == group_size})
            if links:
                what = f"{kind} over {group_size} ranks was fitted for link class {', '.join(links)} only"
            elif sizes:
                what = f"{kind} was fitted for group sizes {sizes}, not {group_size}"
            else:
                what = f"{kind} was not measured"
            raise CostModelError(
                f"{self._where()}: {what}. Fix: re-run `python -m tritonmoe.plan profile --nproc {group_size}` "
                f"(or under torchrun with {group_size} ranks{' across nodes' if link_class == 'inter' else ''}) and "
                "pass the new file, or describe the machine as a tritonmoe.plan.Cluster"
            )
        return fit

    def predict(self, kind: str, nbytes: float, group_size: int, link_class: str = "intra") -> float:
        """Seconds of one collective (``kind`` in :data:`COLLECTIVES`) moving ``nbytes`` per rank
        over ``group_size`` ranks of ``link_class``, or of a copy (``kind`` in :data:`COPIES`;
        group size and link ignored)."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if kind in COPIES:
            return self.copy_time(kind, nbytes)
        return self.collective_fit(kind, group_size, link_class)(nbytes)

    def copy_time(self, kind: str, nbytes: float) -> float:
        if self.cluster is not None:
            return self.cluster.copy_line()(nbytes)
        fit = self.copies.get(kind)
        if fit is None:
            raise CostModelError(
                f"{self._where()}: {kind} was not measured. Fix: re-run `python -m tritonmoe.plan profile` "
                "(it times host/device copies) or describe the machine as a tritonmoe.plan.Cluster"
            )
        return fit(nbytes)

    def compute_time(self, work: Work) -> float:
        """Seconds of a compute op: the sum over its parts of each kind's roofline."""
        total = 0.0
        for w in work.leaves():
            rate = self.compute.get(w.kind)
            if rate is None and w.kind == "host":
                continue  # a model without a measured host cost prices none
            if rate is None:
                raise CostModelError(
                    f"{self._where()}: no compute rate for Work kind {w.kind!r} (has {sorted(self.compute)}). "
                    "Fix: re-run `python -m tritonmoe.plan profile`, or use a kind the model has"
                )
            total += rate.time(w)
        return total

    def node_of(self, rank: int) -> int:
        """The node a rank is on (rank // ranks_per_node; node 0 when all are on one)."""
        if self.cluster is not None:
            return self.cluster.node_of(rank)
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def cpu_share(self) -> Optional[float]:
        """Fraction of a node's CPU one rank's compute uses at full speed (CPU host model with
        ``host_cores``), else None."""
        if not self.host_compute or not self.host_cores:
            return None
        return min(1.0, self.threads_per_rank / self.host_cores)

    def retained(self, y: str, others: Iterable[str]) -> float:
        """Speed fraction an op of class ``y`` keeps while ``others`` (classes of the other
        running ops on its rank; ``y`` itself when another op of its class runs) run:
        alpha(y, "all") for two or more other classes when given, else the minimum over the
        other classes present, times alpha(y, y) when ``y`` is among them (the slowdown beyond
        the fair share of two concurrent ops of one class, e.g. two gloo collectives)."""
        xs = set(others)
        same = self.interference.get((y, y), 1.0) if y in xs else 1.0
        xs.discard(y)
        if not xs:
            return same
        if len(xs) >= 2 and (y, "all") in self.interference:
            return same * self.interference[(y, "all")]
        return same * min(self.interference.get((y, x), 1.0) for x in xs)

    def link_class(self, ranks: Sequence[int]) -> str:
        """"intra" when every rank is on one node, else "inter"."""
        if self.cluster is not None:
            return self.cluster.link_class(ranks)
        if self.ranks_per_node is None:
            return "intra"
        return "intra" if len({r // self.ranks_per_node for r in ranks}) == 1 else "inter"

    def collective_cost(
        self,
        op: str,
        ranks: Sequence[int],
        send: Sequence[Sequence[float]],
        recv: Sequence[Sequence[float]],
        *,
        members: Optional[Sequence[int]] = None,
    ) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of one collective over the global ``ranks``
        (see :meth:`tritonmoe.plan.Cluster.collective_cost` for ``send``/``recv``/``members``).

        A fitted model prices it as its line at the largest per-rank size of any member
        (the collective ends with its slowest member) and charges the size-proportional part
        to every member's network resource ``("net", rank)``."""
        if self.cluster is not None:
            return self.cluster.collective_cost(op, ranks, send, recv, members=members)
        P = len(ranks)
        if members is None:
            members = list(range(P))
        if P == 1:
            return 0.0, {}
        if op in ("all_to_all", "send_recv"):
            x = max(max(sum(s), sum(r)) for s, r in zip(send, recv))
        else:
            x = max(float(row[0]) if len(row) else 0.0 for row in send)
        alpha, data = self.collective_fit(op, P, self.link_class(ranks)).split(x)
        if data <= 0:
            return alpha, {}
        return alpha, {("net", ranks[m]): data for m in members}

    def copy_cost(self, op: str, rank: int, nbytes: float) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of a host<->device copy on ``rank``."""
        if self.cluster is not None:
            alpha, data = self.cluster.copy_line().split(nbytes)
            return alpha, ({self.cluster.copy_resource(rank): data} if data > 0 else {})
        if op not in self.copies:
            self.copy_time(op, nbytes)  # raises the error naming the file and the fix
        alpha, data = self.copies[op].split(nbytes)
        return alpha, ({("copy", rank): data} if data > 0 else {})

    def check_group_size(self, group_size: int, kinds: Sequence[str] = ("all_to_all",), link_class: str = "intra") -> None:
        """Raise :class:`CostModelError` when a collective the schedule uses was not fitted for
        ``group_size`` (before any simulation)."""
        for k in kinds:
            self.collective_fit(k, group_size, link_class)

    # -- persistence ---------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """A hash of the model's content (ranks compare it to know they plan with one model)."""
        d = self.to_json()
        d.pop("meta", None)
        d.pop("samples", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict:
        """The model as a versioned JSON object (:func:`_model_to_json`)."""
        return _model_to_json(self)

    @classmethod
    def from_json(cls, d: Mapping, *, path: Optional[str] = None) -> "CostModel":
        """The model of a JSON object written by :meth:`to_json` (:func:`_model_from_json`); a
        :class:`CostModelError` naming ``path`` and the fix when it is not one."""
        return _model_from_json(cls, d, path=path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the model as versioned JSON (atomically)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        """Read a model written by :meth:`save` (or ``python -m tritonmoe.plan profile``)."""
        path = os.fspath(path)
        return cls.from_json(_read_model_file(path), path=path)

    # -- reporting -----------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """Human-readable lines: every fit with its R^2 and held-out error (:func:`_describe_model`)."""
        return _describe_model(self)


def _group_samples(measurements: Sequence[Any]) -> tuple[dict, dict, dict, list, list]:
    """The measurements of :meth:`CostModel.fit`, each checked and sorted by what it measures:
    ``(comm, comp, inter, host, host_compute_s)`` -- communication samples per (kind, group
    size, link) or per copy kind, compute samples per Work kind, retained speeds per (y, x), and
    host seconds to issue an operation and around a compute."""
    comm: dict[tuple, list[CommSample]] = {}
    comp: dict[str, list[ComputeSample]] = {}
    inter: dict[tuple, list[float]] = {}
    host: list[float] = []
    host_compute_s: list[float] = []
    for m in measurements:
        if isinstance(m, CommSample):
            if m.kind not in COLLECTIVES + COPIES:
                raise ValueError(f"CommSample kind {m.kind!r} is not one of {', '.join(COLLECTIVES + COPIES)}")
            if m.link not in LINK_CLASSES:
                raise ValueError(f"CommSample link {m.link!r} is not one of {', '.join(LINK_CLASSES)}")
            key = (m.kind,) if m.kind in COPIES else (m.kind, int(m.group_size), m.link)
            comm.setdefault(key, []).append(m)
        elif isinstance(m, ComputeSample):
            comp.setdefault(m.kind, []).append(m)
        elif isinstance(m, InterferenceSample):
            if m.y not in OP_CLASSES or m.x not in OP_CLASSES + ("all",):
                raise ValueError(f"InterferenceSample ({m.y!r}, {m.x!r}): classes are {OP_CLASSES} (x also 'all')")
            inter.setdefault((m.y, m.x), []).append(min(1.0, m.alone_s / m.concurrent_s))
        elif isinstance(m, HostSample):
            (host_compute_s if m.what == "compute" else host).append(m.seconds)
        else:
            raise TypeError(f"CostModel.fit: unknown measurement {type(m).__name__}")
    return comm, comp, inter, host, host_compute_s


def _fit_groups(model: CostModel, comm: dict, comp: dict, inter: dict, *, piecewise: bool) -> None:
    """Fill ``model``'s fits from the grouped samples of :func:`_group_samples`: a line (or
    piecewise line) per collective and per copy kind, a roofline per compute kind (the host
    cost from the composite samples, priced with the model's other rates), the median retained
    speed per (y, x)."""
    for key, ss in comm.items():
        fit = fit_linear([s.nbytes for s in ss], [s.seconds for s in ss], piecewise=piecewise)
        if len(key) == 1:
            model.copies[key[0]] = fit
        else:
            model.collectives[key] = fit
    composite = comp.pop("composite", [])
    for kind, ss in comp.items():
        model.compute[kind] = fit_compute(kind, ss)
    if composite:
        model.compute["host"] = fit_host(model, composite)
    model.interference = {k: statistics.median(v) for k, v in inter.items()}


# -- persistence: versioned JSON files (CostModel.to_json / from_json / save / load) ------------


def _bad(where: str, field_name: str, value: Any, want: str) -> CostModelError:
    return CostModelError(
        f"{where}: {field_name} = {value!r}; it must be {want}. Fix: re-create the model with "
        "`python -m tritonmoe.plan profile --out FILE` (or CostModel.fit), or correct that value"
    )


def _finite_nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _positive_rate(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) and v > 0


def _check_fit(where: str, name: str, f: Any) -> None:
    if not isinstance(f, LinearFit) or not f.pieces:
        raise _bad(where, name, f, "a LinearFit with at least one piece")
    if f.x_range is not None:
        lo, hi = f.x_range
        if not (_finite_nonneg(lo) and _finite_nonneg(hi) and lo <= hi):
            raise _bad(where, f"{name}.x_range", f.x_range, "finite sizes >= 0, the smaller first")
    prev = 0.0
    for i, (upper, a, b) in enumerate(f.pieces):
        if not (isinstance(upper, (int, float)) and not math.isnan(upper) and upper > prev):
            raise _bad(where, f"{name}.pieces[{i}].upper", upper, "a size above the previous piece's (inf for the last)")
        if not (isinstance(a, (int, float)) and math.isfinite(a)):
            raise _bad(where, f"{name}.pieces[{i}].alpha", a, "finite seconds")
        if not _finite_nonneg(b):
            raise _bad(where, f"{name}.pieces[{i}].beta", b, "finite and >= 0 seconds per byte")
        # a later piece of a joined fit may have a negative intercept; its time may not be
        # negative where it starts (nor, with beta >= 0, anywhere after)
        if a + b * prev < -1e-12:
            raise _bad(where, f"{name}.pieces[{i}]", (upper, a, b),
                       f"a line whose time at the piece's start ({prev:g} bytes) is >= 0")
        prev = upper


def check_model_values(model: "CostModel") -> None:
    """Refuse a model whose values would make the simulator spin or plan from NaN: every time
    finite and non-negative, every rate positive (inf allowed: that term is free), every
    efficiency positive, every retained fraction in (0, 1], every count >= 1. A :class:`CostModelError`
    naming the file (or "cost model") and the field."""
    where = f"cost model file {model.path}" if model.path else "cost model"
    for key, f in model.collectives.items():
        _check_fit(where, f"collectives[{key}]", f)
        size = key[1] if isinstance(key, tuple) and len(key) == 3 else None
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise _bad(where, f"collectives[{key}].group_size", size, "an int >= 1")
    for key, f in model.copies.items():
        _check_fit(where, f"copies[{key!r}]", f)
    for key, r in model.compute.items():
        name = f"compute[{key!r}]"
        if not isinstance(r, ComputeRate):
            raise _bad(where, name, r, "a ComputeRate")
        for attr in ("flops_per_s", "bytes_per_s"):
            if not _positive_rate(getattr(r, attr)):
                raise _bad(where, f"{name}.{attr}", getattr(r, attr), "> 0 (inf: free)")
        if not _finite_nonneg(r.launch_s):
            raise _bad(where, f"{name}.launch_s", r.launch_s, "finite and >= 0 seconds")
        for i, (t, e) in enumerate(r.curve):
            if not (_finite_nonneg(t) and t > 0 and _finite_nonneg(e) and e > 0):
                raise _bad(where, f"{name}.curve[{i}]", (t, e), "a (seconds > 0, finite efficiency > 0) point")
    for key, v in model.interference.items():
        if not (_finite_nonneg(v) and 0 < v <= 1):
            raise _bad(where, f"interference[{key}]", v, "a retained fraction in (0, 1]")
    for attr in ("host_op_s", "compute_op_s"):
        if not _finite_nonneg(getattr(model, attr)):
            raise _bad(where, attr, getattr(model, attr), "finite and >= 0 seconds")
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    for key, v in model.lane_slots.items():
        if not count(v):
            raise _bad(where, f"lane_slots[{key!r}]", v, "an int >= 1")
    if not count(model.threads_per_rank):
        raise _bad(where, "threads_per_rank", model.threads_per_rank, "an int >= 1")
    if model.ranks_per_node is not None and not count(model.ranks_per_node):
        raise _bad(where, "ranks_per_node", model.ranks_per_node, "None or an int >= 1")
    if model.host_cores is not None and not (_finite_nonneg(model.host_cores) and model.host_cores > 0):
        raise _bad(where, "host_cores", model.host_cores, "None or a finite number > 0")


def _model_to_json(model: CostModel) -> dict:
    """``model`` as a versioned JSON object (:data:`FORMAT`, :data:`VERSION`), its samples
    included."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": model.source,
        "dtype": model.dtype,
        "host_compute": model.host_compute,
        "host_op_s": model.host_op_s,
        "compute_op_s": model.compute_op_s,
        "lane_slots": dict(model.lane_slots),
        "ranks_per_node": model.ranks_per_node,
        "host_cores": model.host_cores,
        "threads_per_rank": model.threads_per_rank,
        "collectives": [
            {"kind": k, "group_size": p, "link": l, **f.to_json()} for (k, p, l), f in sorted(model.collectives.items())
        ],
        "copies": [{"kind": k, **f.to_json()} for k, f in sorted(model.copies.items())],
        "compute": [{"kind": k, **r.to_json()} for k, r in sorted(model.compute.items())],
        "interference": [{"y": y, "x": x, "retained": v} for (y, x), v in sorted(model.interference.items())],
        "cluster": model.cluster.to_json() if model.cluster is not None else None,
        "meta": model.meta,
        "samples": [{"type": type(m).__name__, **asdict(m)} for m in model.samples],
    }


def _model_from_json(cls: type, d: Mapping, *, path: Optional[str] = None) -> CostModel:
    """A ``cls`` (:class:`CostModel`) from a JSON object of :func:`_model_to_json`; a
    :class:`CostModelError` that names ``path`` (or "cost model JSON") and the fix for another
    format or version or a damaged object."""
    where = f"cost model file {path}" if path else "cost model JSON"
    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
        raise CostModelError(
            f"{where} is not a tritonmoe cost model (no \"format\": \"{FORMAT}\"). Fix: write one with "
            "`python -m tritonmoe.plan profile --out FILE` or CostModel.save"
        )
    if d.get("version") != VERSION:
        raise CostModelError(
            f"{where} has version {d.get('version')!r}; this tritonmoe reads version {VERSION}. Fix: re-run "
            "`python -m tritonmoe.plan profile --out FILE` with this version"
        )
    try:
        cluster = None
        if d.get("cluster") is not None:
            cluster = Cluster.from_json(d["cluster"])
        return cls(
            collectives={
                (c["kind"], int(c["group_size"]), c["link"]): LinearFit.from_json(c) for c in d["collectives"]
            },
            copies={c["kind"]: LinearFit.from_json(c) for c in d.get("copies", [])},
            compute={c["kind"]: ComputeRate.from_json(c) for c in d.get("compute", [])},
            interference={(c["y"], c["x"]): float(c["retained"]) for c in d.get("interference", [])},
            host_compute=bool(d["host_compute"]),
            host_op_s=float(d.get("host_op_s", 0.0)),
            compute_op_s=float(d.get("compute_op_s", 0.0)),
            lane_slots={k: int(v) for k, v in d.get("lane_slots", {}).items()},
            ranks_per_node=d.get("ranks_per_node"),
            host_cores=d.get("host_cores"),
            threads_per_rank=int(d.get("threads_per_rank", 1)),
            dtype=str(d.get("dtype", "bfloat16")),
            cluster=cluster,
            source=str(d.get("source", "file")),
            meta=dict(d.get("meta", {})),
            path=path,
            samples=[sample_from_json(m) for m in d.get("samples", [])],
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CostModelError):
            raise
        raise CostModelError(
            f"{where} is damaged ({type(exc).__name__}: {exc}). Fix: re-run `python -m tritonmoe.plan profile "
            "--out FILE`"
        ) from exc


def _read_model_file(path: str) -> Any:
    """The JSON object of a cost model file: a :class:`FileNotFoundError` or
    :class:`CostModelError` naming the file and the command that (re-)creates it when it is
    missing or not JSON."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"cost model file {path} does not exist. Fix: create it with `python -m tritonmoe.plan profile "
            f"--out {path}` (add --nproc N for N local ranks, or launch it with torchrun), or pass a "
            "tritonmoe.plan.Cluster instead"
        )
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as exc:
        raise CostModelError(
            f"cost model file {path} is not JSON ({exc}). Fix: re-create it with `python -m tritonmoe.plan "
            f"profile --out {path}`"
        ) from exc
    return d


# -- reporting ------------------------------------------------------------------------------------


def _describe_model(model: CostModel) -> list[str]:
    """Human-readable lines of ``model``: every fit with its R^2 and held-out error."""
    lines = [f"cost model ({model.source}{', ' + model.path if model.path else ''}), dtype {model.dtype}, "
             f"host model {'CPU (compute on the issuing thread)' if model.host_compute else 'CUDA (asynchronous)'}"]
    if model.cluster is not None:
        lines.append(f"  derived from cluster {model.cluster.describe()}")
    for (k, p, l), f in sorted(model.collectives.items()):
        lines.append(f"  {k:15} P={p:<4} {l:5} " + _fit_line(f))
    for k, f in sorted(model.copies.items()):
        lines.append(f"  {k:15} {'':12} " + _fit_line(f))
    for k, r in sorted(model.compute.items()):
        rate = (f"{r.flops_per_s / 1e9:.2f} GFLOP/s" if math.isfinite(r.flops_per_s) else "")
        bw = (f"{r.bytes_per_s / 1e9:.2f} GB/s" if math.isfinite(r.bytes_per_s) else "")
        q = _quality(r.r2, r.heldout_rel_err)
        what = " ".join(x for x in (rate, bw) if x)
        lines.append(f"  compute {k:11} {what + ', ' if what else ''}launch {r.launch_s * 1e6:.1f} us"
                     f"{', ' + str(len(r.curve)) + '-point efficiency curve' if r.curve else ''}{q}")
    for (y, x), v in sorted(model.interference.items()):
        lines.append(f"  interference alpha({y}, {x}) = {v:.3f} (retained speed)")
    if model.host_op_s or model.compute_op_s:
        lines.append(f"  host time per operation: {model.host_op_s * 1e6:.1f} us to issue a collective, "
                     f"{model.compute_op_s * 1e6:.1f} us around a compute")
    if model.host_cores:
        lines.append(f"  compute shares {model.host_cores:.2f} effective cores per node ({model.threads_per_rank} "
                     "thread(s) per rank)")
    if model.lane_slots:
        lines.append("  lane slots " + ", ".join(f"{k}: {v}" for k, v in sorted(model.lane_slots.items())))
    return lines


def _quality(r2, held) -> str:
    parts = []
    if r2 is not None:
        parts.append(f"R^2 {r2:.4f}")
    if held is not None:
        parts.append(f"held-out rel err {100 * held:.1f}%")
    return f" ({', '.join(parts)})" if parts else ""


def _fit_line(f: LinearFit) -> str:
    def piece(u: float, b: float, alpha: str = "") -> str:
        upto = "" if math.isinf(u) else "<=" + _human(u) + ": "
        return f"{upto}{alpha}1/beta {(1 / b / 1e9) if b > 0 else math.inf:.3f} GB/s"

    if f.continuous and len(f.pieces) > 1:
        # pieces that join: the startup once, then each piece's bandwidth up to its knot
        lo = f.x_range[0] if f.x_range else 0.0
        ps = f"startup {f(lo) * 1e6:.1f} us (at {_human(lo)}), then " + "; ".join(piece(u, b) for u, _a, b in f.pieces)
    else:
        ps = "; ".join(piece(u, b, f"alpha {a * 1e6:.1f} us, ") for u, a, b in f.pieces)
    return ps + _quality(f.r2, f.heldout_rel_err)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


# ---------------------------------------------------------------------------------------------
# Clusters: a cost model from the hardware, without measuring it
# ---------------------------------------------------------------------------------------------
#
# Cluster descriptions: a cost model from the hardware, without measuring it.
#
# A :class:`Cluster` says what a machine is made of: nodes, GPUs per node, the GPU (tensor-core
# FLOP/s per dtype, memory bandwidth), the intra-node link (NVLink/NVSwitch, or PCIe when GPUs talk
# through the host), the inter-node NICs (bandwidth, how many per node, so GPUs may share one) and
# the host<->device link. :meth:`Cluster.cost_model` turns it into a
# :class:`~tritonmoe.plan.CostModel` whose collectives are decomposed into link traffic:
#
# * **all-to-all** (and point-to-point): every member sends its rows to every peer at once (NCCL
#   groups the P-1 sends/receives); bytes to peers on the same node cross the GPU's intra-node link,
#   bytes to other nodes the GPU's NIC (shared by the GPUs that share it). Latency: the slowest
#   link's plus a per-peer cost for each of the P-1 peers.
# * **all-gather / reduce-scatter**: a ring of P-1 steps of one chunk (the shard; the input / P);
#   a multi-node ring crosses each node boundary through the NICs of the members on that node
#   (NCCL runs one ring per NIC). **all-reduce** = reduce-scatter + all-gather (2(P-1) steps).
# * **copies**: the GPU's PCIe link (shared with its intra-node traffic when that is PCIe too).
#
# Every transfer takes ``latency + demand`` alone, where ``demand`` is the busiest link's
# bytes / bandwidth; concurrent transfers fair-share the links they cross
# (:mod:`tritonmoe.sim.engine`). Rates are spec-sheet peaks times one set of efficiencies
# (:data:`EFFICIENCY`), the same for every cluster: nothing here is tuned to any paper's result.
#
# :data:`PRESETS` holds the papers' testbeds (``../shared/PAPERS.md`` §6), one description per
# testbed, and modern DGX nodes; ``Cluster.preset("dgx-h100", nodes=128)`` is 1,024 H100s.

GB = 1e9

#: Fractions of spec-sheet peaks that real kernels and collectives reach, one set for every
#: cluster (assumptions, stated once): large grouped GEMMs reach ~70% of dense tensor peak;
#: streaming kernels ~80% of memory bandwidth; NCCL ~80% of a link's line rate.
EFFICIENCY = {"gemm": 0.70, "memory": 0.80, "link": 0.80}

#: Per-kernel launch + tail overhead of a GPU kernel (seconds), and per-peer cost of an
#: all-to-all (NCCL send/recv setup per peer).
KERNEL_LAUNCH_S = 5e-6
PER_PEER_S = 1e-6


@dataclass(frozen=True)
class GPU:
    """A GPU model: dense tensor-core FLOP/s per dtype name, memory bandwidth and size (bytes)."""

    name: str
    flops: Mapping[str, float]
    mem_bw: float
    memory: float

    def rate(self, dtype: str) -> float:
        try:
            return self.flops[dtype]
        except KeyError:
            raise ValueError(
                f"{self.name} has no {dtype} rate in its description (has {', '.join(self.flops)}); pick one of those"
            ) from None


@dataclass(frozen=True)
class Link:
    """A link technology: bandwidth per direction (bytes/s, per GPU for intra-node links, per NIC
    for inter-node ones) and the latency of one transfer (seconds)."""

    name: str
    bw: float
    latency: float


#: GPUs (public spec sheets; dense tensor-core rates with fp32 accumulation).
GPUS = {
    "V100-SXM2-16GB": GPU("V100-SXM2-16GB", {"float16": 125e12, "float32": 15.7e12}, 900 * GB, 16 * 2**30),
    "RTX2080Ti": GPU("RTX2080Ti", {"float16": 53.8e12, "float32": 13.4e12}, 616 * GB, 11 * 2**30),
    "RTX4090": GPU("RTX4090", {"float16": 165.2e12, "bfloat16": 165.2e12, "float32": 82.6e12}, 1008 * GB, 24 * 2**30),
    "A100-SXM4-40GB": GPU(
        "A100-SXM4-40GB", {"float16": 312e12, "bfloat16": 312e12, "float32": 19.5e12}, 1555 * GB, 40 * 2**30
    ),
    "H100-SXM5-80GB": GPU(
        "H100-SXM5-80GB", {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12}, 3350 * GB, 80 * 2**30
    ),
    "H200-SXM-141GB": GPU(
        "H200-SXM-141GB", {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12}, 4800 * GB, 141 * 2**30
    ),
}

#: Links (per direction). NVLink: per-GPU aggregate (NVLink2 6 x 25 GB/s, NVLink3 12 x 25,
#: NVLink4 18 x 25); PCIe x16 per GPU; NICs per port.
LINKS = {
    "nvlink2": Link("NVLink2", 150 * GB, 3e-6),
    "nvlink3": Link("NVLink3", 300 * GB, 3e-6),
    "nvlink4": Link("NVLink4", 450 * GB, 3e-6),
    "pcie3": Link("PCIe 3.0 x16", 15.75 * GB, 8e-6),
    "pcie4": Link("PCIe 4.0 x16", 31.5 * GB, 8e-6),
    "pcie5": Link("PCIe 5.0 x16", 63.0 * GB, 8e-6),
    "ib56": Link("56 Gb/s InfiniBand", 7.0 * GB, 6e-6),
    "ib100": Link("100 Gb/s InfiniBand/RoCE", 12.5 * GB, 6e-6),
    "ib200": Link("200 Gb/s HDR InfiniBand", 25.0 * GB, 6e-6),
    "ib400": Link("400 Gb/s NDR InfiniBand", 50.0 * GB, 6e-6),
}


@suggest_unknown_kwargs
@dataclass(frozen=True)
class Cluster:
    """A cluster of ``nodes`` x ``gpus_per_node`` GPUs (see the module docstring).

    Attributes:
        name: a label; ``gpu``: the :class:`GPU`.
        intra: the intra-node :class:`Link` (per GPU); ``intra_is_pcie``: GPUs reach each other
            (and the NIC, and host memory) over their PCIe link, so all of that traffic shares it.
        inter: the NIC :class:`Link`; ``nics_per_node``: NICs per node (GPUs of a node share them
            evenly: 1 NIC for 4 GPUs means 4 GPUs share one NIC).
        host_link: the host<->device :class:`Link` of each GPU.
        efficiency: the fractions of peak reached (:data:`EFFICIENCY` unless overridden).
        interference: MPMoE's retained-speed factors (``(y, x) -> fraction``); none by default
            (their measured values are lost from the paper; link sharing is modelled by the
            fair-share engine instead).
        notes: where each number comes from, and which ones the source leaves free.
    """

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Optional[Link]
    nics_per_node: int
    host_link: Link
    intra_is_pcie: bool = False
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(EFFICIENCY))
    launch_s: float = KERNEL_LAUNCH_S
    per_peer_s: float = PER_PEER_S
    interference: Mapping[tuple, float] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "nics_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "nics_per_node" else 1):
                raise ValueError(f"Cluster.{name}={v!r} must be a positive int")
        if self.nodes > 1 and (self.inter is None or self.nics_per_node < 1):
            raise ValueError(f"a cluster of {self.nodes} nodes needs an inter-node link and nics_per_node >= 1")

    # -- layout --------------------------------------------------------------------------------

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nic_of(self, rank: int) -> tuple:
        local = rank % self.gpus_per_node
        return ("nic", self.node_of(rank), local * self.nics_per_node // self.gpus_per_node)

    def gpus_per_nic(self) -> int:
        return max(1, self.gpus_per_node // max(1, self.nics_per_node))

    def link_class(self, ranks: Sequence[int]) -> str:
        return "intra" if len({self.node_of(r) for r in ranks}) == 1 else "inter"

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes)

    def describe(self) -> str:
        inter = f", {self.nics_per_node} x {self.inter.name} per node" if self.inter is not None and self.nodes > 1 else ""
        return (
            f"{self.name}: {self.nodes} x {self.gpus_per_node} {self.gpu.name}, intra {self.intra.name}"
            f"{' (through the host)' if self.intra_is_pcie else ''}{inter}"
        )

    # -- link traffic --------------------------------------------------------------------------

    def _bw(self, link: Link) -> float:
        return link.bw * self.efficiency["link"]

    def _gpu_res(self, r: int) -> tuple:
        return ("gpu", r)

    def copy_resource(self, r: int) -> tuple:
        """The resource a host<->device copy of rank r uses (its PCIe link)."""
        return ("gpu", r) if self.intra_is_pcie else ("pcie", r)

    def collective_cost(
        self,
        op: str,
        ranks: Sequence[int],
        send: Sequence[Sequence[float]],
        recv: Sequence[Sequence[float]],
        *,
        members: Optional[Sequence[int]] = None,
    ) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of one collective over group ``ranks``.

        ``send[i]`` / ``recv[i]`` are the per-peer bytes of the i-th listed member (group-rank
        order; for all-gather ``(shard,) * P``, for reduce-scatter / all-reduce ``(nbytes,)``).
        ``members`` lists which group ranks those rows belong to (default: all); with a single
        listed member the others are taken to move the same bytes (the engine's symmetric
        mode), and only that member's resources are returned."""
        P = len(ranks)
        if members is None:
            members = list(range(P))
        symmetric = len(members) < P
        node = [self.node_of(r) for r in ranks]
        if op in ("all_to_all", "send_recv"):
            return self._pairwise(ranks, node, send, recv, members, symmetric)
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            return self._ring(op, ranks, node, send, members, symmetric)
        raise ValueError(f"unknown collective {op!r}")

    def _pairwise(self, ranks, node, send, recv, members, symmetric):
        P = len(ranks)
        demands: dict = {}
        nic_out: dict = {}
        nic_in: dict = {}
        any_inter = False
        any_bytes = False
        intra_bw = self._bw(self.intra)
        for row, m in enumerate(members):
            r = ranks[m]
            io = ii = eo = ei = 0.0
            for j in range(P):
                if j == m:
                    continue
                s, q = send[row][j], recv[row][j]
                if node[j] == node[m]:
                    io += s
                    ii += q
                else:
                    eo += s
                    ei += q
            any_bytes = any_bytes or (io + ii + eo + ei) > 0
            any_inter = any_inter or (eo + ei) > 0
            gpu_bytes = max(io + eo, ii + ei) if self.intra_is_pcie else max(io, ii)
            if gpu_bytes:
                demands[self._gpu_res(r)] = demands.get(self._gpu_res(r), 0.0) + gpu_bytes / intra_bw
            if eo or ei:
                nic = self.nic_of(r)
                share = self._nic_sharers(ranks, r) if symmetric else 1
                nic_out[nic] = nic_out.get(nic, 0.0) + eo * share
                nic_in[nic] = nic_in.get(nic, 0.0) + ei * share
        if nic_out or nic_in:
            nic_bw = self._bw(self.inter)
            for nic in set(nic_out) | set(nic_in):
                demands[nic] = max(nic_out.get(nic, 0.0), nic_in.get(nic, 0.0)) / nic_bw
        if not any_bytes:
            return self.per_peer_s, {}
        lat = (self.inter.latency if any_inter else self.intra.latency) + self.per_peer_s * (P - 1)
        return lat, demands

    def _nic_sharers(self, ranks, r) -> int:
        """Members of the group on the same NIC as rank r."""
        nic = self.nic_of(r)
        return sum(1 for q in ranks if self.nic_of(q) == nic)

    def _ring(self, op, ranks, node, send, members, symmetric):
        P = len(ranks)
        if P == 1:
            return 0.0, {}
        x = max(float(row[0]) for row in send) if send else 0.0
        steps, chunk = (P - 1, x) if op == "all_gather" else ((P - 1, x / P) if op == "reduce_scatter" else (2 * (P - 1), x / P))
        nodes = sorted(set(node))
        multi = len(nodes) > 1
        lat = steps * (self.inter.latency if multi else self.intra.latency)
        if x <= 0:
            return lat, {}
        demands: dict = {}
        intra_bw = self._bw(self.intra)
        for m in members:
            demands[self._gpu_res(ranks[m])] = steps * chunk / intra_bw
        if multi:
            nic_bw = self._bw(self.inter)
            mine = {node[m] for m in members}
            for n in mine:
                nics = {self.nic_of(r) for r, nd in zip(ranks, node) if nd == n}
                listed = {self.nic_of(ranks[m]) for m in members if node[m] == n}
                for nic in listed:
                    demands[nic] = steps * chunk / (len(nics) * nic_bw)
        return lat, demands

    def collective_line(self, kind: str, group_size: int, link_class: str = "intra") -> LinearFit:
        """The alpha-beta line of ``kind`` over ``group_size`` ranks with uniform traffic (for
        the Parm-style selectors): placed on one node ("intra"), or across nodes ("inter":
        contiguous blocks of a node's GPUs, or one rank per node when the group is smaller
        than the node count)."""
        P = int(group_size)
        if P < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        if link_class == "intra":
            if P > self.gpus_per_node:
                raise ValueError(
                    f"{self.name}: an intra-node group of {P} ranks does not fit on a node of {self.gpus_per_node} GPUs"
                )
            ranks = list(range(P))
        else:
            if self.nodes < 2:
                raise ValueError(f"{self.name} has one node: no inter-node group")
            if P <= self.nodes:
                ranks = [i * self.gpus_per_node for i in range(P)]
            else:
                if P > self.num_gpus:
                    raise ValueError(f"{self.name}: a group of {P} ranks exceeds its {self.num_gpus} GPUs")
                ranks = list(range(P))
        if P == 1:
            return LinearFit.line(0.0, 0.0)
        x = float(2**20)

        def traffic(nbytes):
            if kind in ("all_to_all", "send_recv"):
                row = [nbytes / P] * P
                return [row] * P, [row] * P
            return [[nbytes] * (P if kind == "all_gather" else 1)] * P, None

        s1, r1 = traffic(x)
        lat, dem = self.collective_cost(kind, ranks, s1, r1 if r1 is not None else s1)
        return LinearFit.line(lat, max(dem.values(), default=0.0) / x)

    def copy_line(self) -> LinearFit:
        return LinearFit.line(self.host_link.latency, 1.0 / self._bw(self.host_link))

    # -- the cost model ------------------------------------------------------------------------

    def cost_model(self, dtype: str | object = "bfloat16") -> CostModel:
        """A :class:`~tritonmoe.plan.CostModel` of this cluster for ``dtype`` (a name or a
        torch dtype): collectives decomposed into link traffic, compute from the GPU's roofline
        times :data:`EFFICIENCY`, asynchronous (CUDA) host model."""
        name = str(dtype).replace("torch.", "")
        peak = self.gpu.rate(name)
        mem = self.gpu.mem_bw * self.efficiency["memory"]
        vector = self.gpu.flops.get("float32", peak)
        compute = {
            "gemm": ComputeRate(peak * self.efficiency["gemm"], mem, self.launch_s),
            "elementwise": ComputeRate(vector, mem, self.launch_s),
            "copy": ComputeRate(math.inf, mem, self.launch_s),
            "host": ComputeRate(math.inf, math.inf, 0.0),  # the launches of the kernels cover it
        }
        return CostModel(
            compute=compute,
            interference=dict(self.interference),
            host_compute=False,
            dtype=name,
            cluster=self,
            ranks_per_node=self.gpus_per_node,
            source=f"cluster:{self.name}",
            meta={"notes": self.notes},
        )

    # -- persistence ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        d = asdict(self)
        d["interference"] = [[y, x, v] for (y, x), v in self.interference.items()]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Cluster":
        d = dict(d)
        d["gpu"] = GPU(**d["gpu"])
        for k in ("intra", "inter", "host_link"):
            if d.get(k) is not None:
                d[k] = Link(**d[k])
        d["interference"] = {(y, x): float(v) for y, x, v in d.get("interference", [])}
        return cls(**d)

    @classmethod
    def preset(cls, name: str, nodes: Optional[int] = None) -> "Cluster":
        """A preset of :data:`PRESETS`, with ``nodes`` nodes when given."""
        try:
            factory = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown cluster preset {name!r}; choose from {', '.join(PRESETS)}") from None
        c = factory()
        return c.with_nodes(nodes) if nodes is not None else c


def _lina() -> Cluster:
    return Cluster(
        "lina", 4, 4, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib100"], 1, LINKS["pcie4"],
        notes="Lina (001 §7.1): 4 nodes x 4 A100 40 GB, 100 Gbps InfiniBand. Free (not stated): the intra-node link "
        "(NVLink3 of an HGX A100 4-GPU board assumed) and one NIC per node.",
    )


def _parm_a() -> Cluster:
    return Cluster(
        "parm-a", 1, 8, GPUS["RTX4090"], LINKS["pcie4"], None, 0, LINKS["pcie4"], intra_is_pcie=True,
        notes="Parm testbed A (003 §VI-A): one server, 8 x RTX 4090 24 GB on PCIe 4.0 x16, no NVLink (GeForce: "
        "no peer-to-peer, GPU traffic goes through the host over each GPU's PCIe link).",
    )


def _parm_b() -> Cluster:
    return Cluster(
        "parm-b", 8, 4, GPUS["RTX2080Ti"], LINKS["pcie3"], LINKS["ib100"], 1, LINKS["pcie3"], intra_is_pcie=True,
        notes="Parm testbed B (003 §VI-A): 8 nodes x 4 RTX 2080Ti 11 GB on PCIe 3.0 x16, ConnectX-5 100 Gb/s "
        "(one per node: the 4 GPUs share it). 2 nodes = the 8-GPU rows, 8 nodes = the 32-GPU rows.",
    )


def _adira() -> Cluster:
    return Cluster(
        "mpmoe-adira", 8, 8, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib200"], 8, LINKS["pcie4"],
        notes="MPMoE Adira (004 §V-A): 8 DGX A100 nodes x 8 A100 40 GB, NVLink 3, 200 Gbps HDR InfiniBand. Free: "
        "one HDR NIC per GPU (the DGX A100 has 8 compute ports); the paper states the rate, not the count.",
    )


def _valor() -> Cluster:
    return Cluster(
        "mpmoe-valor", 4, 4, GPUS["V100-SXM2-16GB"], LINKS["nvlink2"], LINKS["ib56"], 1, LINKS["pcie3"],
        notes="MPMoE Valor (004 §V-A): 4 nodes x 4 Tesla V100 16 GiB, NVLink 2, '56 Gbps' InfiniBand (an FDR rate, "
        "as printed). Free: one NIC per node.",
    )


def _semoe() -> Cluster:
    return Cluster(
        "se-moe", 4, 8, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib200"], 8, LINKS["pcie4"],
        notes="SE-MoE (002 §5.3): 4 nodes x 8 A100 with NVSwitch. Free: the inter-node network (the paper does not "
        "state it; 8 x 200 Gb HDR per node, as on a DGX A100, assumed).",
    )


def _dgx_h100() -> Cluster:
    return Cluster(
        "dgx-h100", 1, 8, GPUS["H100-SXM5-80GB"], LINKS["nvlink4"], LINKS["ib400"], 8, LINKS["pcie5"],
        notes="NVIDIA DGX H100: 8 x H100 SXM5 80 GB, NVLink4 via NVSwitch (900 GB/s bidirectional per GPU), 8 x 400 "
        "Gb/s NDR (ConnectX-7) per node, PCIe 5.0 host links. Use nodes=N for N nodes.",
    )


def _dgx_h200() -> Cluster:
    return Cluster(
        "dgx-h200", 1, 8, GPUS["H200-SXM-141GB"], LINKS["nvlink4"], LINKS["ib400"], 8, LINKS["pcie5"],
        notes="NVIDIA DGX H200: 8 x H200 141 GB (HBM3e 4.8 TB/s), NVLink4 via NVSwitch, 8 x 400 Gb/s NDR per node, "
        "PCIe 5.0 host links. Use nodes=N for N nodes.",
    )


#: The papers' testbeds (PAPERS.md §6) and modern nodes: name -> factory.
PRESETS: dict[str, Callable[[], Cluster]] = {
    "lina": _lina,
    "parm-a": _parm_a,
    "parm-b": _parm_b,
    "mpmoe-adira": _adira,
    "mpmoe-valor": _valor,
    "se-moe": _semoe,
    "dgx-h100": _dgx_h100,
    "dgx-h200": _dgx_h200,
}
