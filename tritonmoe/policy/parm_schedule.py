"""Parm's automatic schedule choice: alpha-beta costs fitted by least squares, Algorithm 1
(paper 003 section V; PAPERS.md 3.4), and the step model ``parm_schedule="auto"`` uses.

Each collective costs ``alpha + beta * x`` seconds for x elements (Eq. 12). Parm fits one
(alpha, beta) per collective and group from measured times at a few sizes, then compares

* ``t_D1 = 2 * A2A(y / N_MP) + AG_MP(x)`` (S1: two EP&ESP all-to-alls of the dumped slice,
  and the MP all-gather of the output, x = B*L*M elements gathered), and
* ``t_D2 = A2A(y / N_MP) + Overlap(y / N_MP)`` (S2: the dispatch all-to-all and SAA),

with ``y = k * f * B * L * M * N_ESP`` the dumped dispatch tensor of a batch (E experts times
capacity T = k*f*B*L/E rows of M, once per shard), picking S1 when ``t_D1 <= t_D2``
(:func:`algorithm1`).

Readings of the garbled text (PAPERS.md 3.4 ambiguities 1-4): T = k*f*B*L/E (not times M), the
all-to-all size keeps N_ESP, t_D2 has no separate AG term (Overlap already is the concurrent
all-to-all and all-gather), and Overlap is fitted against the same size it is evaluated at, the
all-to-all's input y/N_MP. Sizes are per-rank input elements for all-to-alls and reduce-scatters,
gathered (output) elements for all-gathers, elements for all-reduces. Dropless routing: f = 1.

Algorithm 1 compares forward communication only, and only S1 with S2 (the paper proves both beat
the baseline). Measured on a real transport that is not always so: at small batches the
baseline, with fewer collectives, wins when per-collective latency dominates (gloo), and on CPUs
the experts' compute, which the baseline repeats N_MP times, matters. So ``auto`` predicts the
whole forward + backward step of all three schedules (:func:`step_times`): every collective of
each schedule and its backward mirror (PAPERS.md 3.2 ambiguity 5) with alpha-beta fitted per
(collective, group), plus the gate, the expert shards (forward, input and weight gradients) and
the local copies at measured rates (PAPERS.md 3.4 ambiguity 6), and picks the least. With a
model that has only Algorithm 1's three fits, ``auto`` is Algorithm 1.

Fitting (:func:`measure_cost_model`, :func:`measure_collectives`): every collective is timed from
one row per peer up to the layer's largest message (:func:`collective_rows`), all sizes
interleaved round by round (a burst of load shifts a fit's points alike instead of tilting its
line), the median of the rounds, then the median over the ranks; the line is fitted on the
relative error (small messages set alpha, which decides between schedules with different numbers
of collectives) in a closed form that gives the same bits on every rank. The collectives' fits
are shared by every layer of a layout (Parm fits once per group). The local work is timed on the
rank's own expert shards (``E / n_ep`` experts, ``d_ffn / n_esp`` wide) with the layer's ops, up
to the baseline's rows. What these terms miss on a host-bound transport -- each schedule's fixed
Python work (plans, autograd nodes, small copies) -- the layer measures on itself: its three
schedules on a small batch (:data:`PROBE_TOKENS`) minus the prediction for that batch is each
schedule's :attr:`ParmCostModel.startup`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tritonmoe.core.validation import GLU_ACTIVATIONS
from tritonmoe.comm.splits import comm_device
from tritonmoe.comm.compat import all_gather_single, reduce_scatter_single
from tritonmoe.comm.errors import backend_errors, input_status, raise_rank_input_error
from tritonmoe.comm.executor import RealExecutor
from tritonmoe.comm.programs.saa import saa_schedule
from tritonmoe.backends import implementation
from tritonmoe.core.specs import ffn_options

__all__ = [
    "AlphaBeta",
    "ParmCostModel",
    "fit_alpha_beta",
    "algorithm1",
    "step_times",
    "choose_schedule",
    "ParmSchedulePolicy",
    "measure_cost_model",
    "measure_collectives",
    "collective_rows",
    "local_tokens",
    "message_elements",
    "geometric_sizes",
]


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha + beta * x`` seconds for x elements (alpha: startup seconds, beta: seconds per
    element)."""

    alpha: float
    beta: float

    def __call__(self, x: float) -> float:
        return self.alpha + self.beta * x


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *, relative: bool = False) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * x`` (both clamped at >= 0: a negative startup or
    per-element time is noise). One size gives alpha = 0.

    ``relative``: minimise the relative residuals ``(alpha + beta*x - t) / t`` (least squares
    weighted by ``1/t^2``) instead of the absolute ones. Collective times span orders of magnitude
    over the sizes a layer sends; unweighted, the largest message's noise sets alpha, which is what
    decides between schedules that differ in their number of collectives. Times of 0 (a group of
    one rank) weigh as the smallest positive time.

    Closed form in Python floats, summed in the given order: the same inputs give the same bits
    in every process (a LAPACK solve may not: its kernels can depend on memory alignment), so
    ranks that fit the same measurements take the same decisions even at a tie."""
    if len(sizes) != len(times) or not sizes:
        raise ValueError(f"need matching, non-empty sizes and times, got {len(sizes)} and {len(times)}")
    x = [float(v) for v in sizes]
    t = [float(v) for v in times]
    n = len(x)
    if n == 1 or max(x) == min(x):
        return AlphaBeta(0.0, max(0.0, (sum(t) / n) / max(sum(x) / n, 1.0)))
    pos = [v for v in t if v > 0]
    w = [1.0 / max(v, min(pos)) ** 2 for v in t] if (relative and pos) else [1.0] * n  # squared weights
    sw = sum(w)
    xm = sum(wi * xi for wi, xi in zip(w, x)) / sw
    tm = sum(wi * ti for wi, ti in zip(w, t)) / sw
    sxx = sum(wi * (xi - xm) ** 2 for wi, xi in zip(w, x))
    sxt = sum(wi * (xi - xm) * (ti - tm) for wi, xi, ti in zip(w, x, t))
    beta = sxt / sxx
    alpha = tm - beta * xm
    if beta < 0:  # the (weighted) mean time
        return AlphaBeta(max(0.0, tm), 0.0)
    if alpha < 0:  # refit through the origin
        sxx0 = sum(wi * xi * xi for wi, xi in zip(w, x))
        return AlphaBeta(0.0, max(0.0, sum(wi * xi * ti for wi, xi, ti in zip(w, x, t)) / sxx0))
    return AlphaBeta(alpha, beta)


#: The collectives of the step model, keyed "<op>_<group>": op in a2a, ag, ar, rs, saa; group in
#: all (the P ranks), ep, esp, mp.
COLLECTIVES = ("a2a_all", "a2a_ep", "ag_mp", "ar_mp", "ag_esp", "ar_esp", "rs_esp", "ag_all", "saa")


@dataclass(frozen=True)
class ParmCostModel:
    """Fitted costs of one layout.

    Attributes:
        ag_mp, a2a, overlap: Algorithm 1's three fits (MP all-gather by gathered elements,
            EP&ESP all-to-all and SAA by per-rank input elements).
        collectives: every collective of the three schedules, :data:`COLLECTIVES` -> fit (empty:
            Algorithm 1 only).
        flops_per_s: the expert GEMMs' rate; ``copy_bytes_per_s``: the local copies' rate (None:
            no compute terms).
        startup: schedule -> seconds added to its predicted step: the fixed host work of the
            layer's schedule that the fitted terms do not see, measured on the layer itself
            (:meth:`~tritonmoe.experts.model_parallel.ParmExperts.fit_cost_model`: a small batch's real
            step minus the prediction for it; may be negative). Empty: none.
        local: when measured for a layer (``measure_cost_model(..., config=...)``): seconds of
            this rank's local work of a step (route, permute, expert shard FFN, unpermute,
            forward and backward) by routed row; replaces the rate-based compute terms.
        source: where the fits come from ("measured on ...", a calibration entry).
    """

    ag_mp: AlphaBeta
    a2a: AlphaBeta
    overlap: AlphaBeta
    collectives: dict = field(default_factory=dict)
    flops_per_s: Optional[float] = None
    copy_bytes_per_s: Optional[float] = None
    local: Optional[AlphaBeta] = None
    startup: dict = field(default_factory=dict)
    source: str = ""

    def c(self, name: str, x: float) -> float:
        """Predicted seconds of collective ``name`` on x elements."""
        ab = self.collectives.get(name)
        if ab is None:
            ab = {"a2a_all": self.a2a, "ag_mp": self.ag_mp, "saa": self.overlap}.get(name)
        return ab(x) if ab is not None else 0.0

    @property
    def complete(self) -> bool:
        """Whether the model can predict whole steps (every collective fitted, compute rates)."""
        return all(k in self.collectives for k in COLLECTIVES) and bool(self.flops_per_s) and bool(self.copy_bytes_per_s)


def _sizes(tokens: int, d_model: int, top_k: int, capacity_factor: Optional[float], n_esp: int):
    f = 1.0 if capacity_factor is None else float(capacity_factor)
    x = float(tokens) * d_model  # B*L*M
    y = top_k * f * tokens * d_model * n_esp  # E * T * M * N_ESP with T = k*f*B*L/E
    return x, y


def algorithm1(
    model: ParmCostModel,
    *,
    tokens: int,
    d_model: int,
    num_experts: int,
    top_k: int,
    capacity_factor: Optional[float],
    n_esp: int,
    n_mp: int,
) -> str:
    """Parm's Algorithm 1 (with the readings of the module docstring): "s1" or "s2"."""
    if n_mp == 1:
        return "s1"  # no MP: S1 and S2 are the same schedule (no MP split, no all-gather)
    x, y = _sizes(tokens, d_model, top_k, capacity_factor, n_esp)
    t_d1 = 2 * model.a2a(y / n_mp) + model.ag_mp(x)
    t_d2 = model.a2a(y / n_mp) + model.overlap(y / n_mp)
    return "s1" if t_d1 <= t_d2 else "s2"


def step_times(model: ParmCostModel, config, layout, tokens: int, *, itemsize: int = 4) -> dict[str, float]:
    """Predicted forward + backward seconds of one step of each schedule for a batch of
    ``tokens`` tokens per MP group (see the module docstring). Collectives of a group of one
    rank cost nothing; a term whose fit is missing counts 0."""
    c = config
    n_mp, n_ep, n_esp, P = layout.n_mp, layout.n_ep, layout.n_esp, layout.P
    M, E, K = c.d_model, c.num_experts, c.top_k
    f = 1.0 if c.capacity_factor is None else float(c.capacity_factor)
    T = float(tokens)
    x, y = _sizes(tokens, M, K, c.capacity_factor, n_esp)
    routed = K * f * T  # routed rows of a batch
    Fs = c.d_ffn / n_esp
    n1 = 2 * Fs if c.activation in GLU_ACTIVATIONS else Fs
    row_flops = 2.0 * M * n1 + 2.0 * Fs * M
    need_caps = c.capacity_factor is not None or c.aux_loss_coef > 0
    need_aux = c.aux_loss_coef > 0 or c.z_loss_coef > 0
    m = model

    def copies(rows: float) -> float:
        return 2.0 * rows * M * itemsize / m.copy_bytes_per_s if m.copy_bytes_per_s else 0.0

    def compute(expert_rows: float, gate_tokens: float, extra_rows: float) -> float:
        """Expert shard rows (forward, input and weight gradients), the gate on
        ``gate_tokens``, and ``extra_rows`` rows of local copies beyond the expert rows'."""
        if m.local is not None:  # measured on the layer's own local ops, by routed row
            return m.local(expert_rows) + copies(extra_rows)
        if not m.flops_per_s:
            return 0.0
        t = 3.0 * row_flops * expert_rows / m.flops_per_s + 3.0 * 2.0 * gate_tokens * M * E / m.flops_per_s
        return t + copies(4.0 * expert_rows + extra_rows)

    counts = m.c("ag_all", P * (2 + E)) if P > 1 else 0.0  # [tokens, status word, E counts] per rank
    # baseline: every MP rank processes its copy; each rank gathers its ESP group's n_esp batches
    yb = routed * n_esp * M  # per-rank EP all-to-all input
    base = counts
    if n_esp > 1:
        base += m.c("ag_esp", n_esp * x) + m.c("ag_esp", n_esp * T * K) + m.c("ar_esp", yb)
        base += m.c("ag_esp", n_esp * routed * M) + m.c("rs_esp", n_esp * x)
    if n_ep > 1:
        base += 4 * m.c("a2a_ep", yb)
    base += compute(routed * n_esp, T, 0.0)
    # S1: the slice of T / n_mp tokens
    s1 = counts + 4 * m.c("a2a_all", y / n_mp) if P > 1 else 0.0
    if n_mp > 1:
        s1 += 2 * m.c("ag_mp", x) + m.c("ar_mp", E * M)
        s1 += m.c("ag_mp", n_mp * K * E) if need_caps else 0.0
        s1 += m.c("ar_mp", E + 1) if need_aux else 0.0
    s1 += compute(routed * n_esp / n_mp, T / n_mp, 0.0)
    # S2: the gate on all T, a part of every expert's rows, SAA
    s2 = counts + (3 * m.c("a2a_all", y / n_mp) if P > 1 else 0.0)
    if n_mp > 1:
        s2 += m.c("saa", y / n_mp) + m.c("ag_mp", routed * M)
    elif P > 1:
        s2 += m.c("a2a_all", y / n_mp)
    # S2 gates, permutes, combines and unpermutes the whole batch on every MP rank
    s2 += compute(routed * n_esp / n_mp, T, routed * (1 + n_esp) * (1 - 1 / n_mp))
    out = {"baseline": base, "s1": s1, "s2": s2}
    return {s: v + float(m.startup.get(s, 0.0)) for s, v in out.items()}


def choose_schedule(model: ParmCostModel, config, layout, tokens: int, *, dtype=None) -> str:
    """The schedule ``parm_schedule="auto"`` runs for a batch of ``tokens`` tokens per MP group:
    the least predicted step (:func:`step_times`) when the model is complete, else Algorithm 1."""
    if not model.complete:
        return algorithm1(
            model, tokens=tokens, d_model=config.d_model, num_experts=config.num_experts, top_k=config.top_k,
            capacity_factor=config.capacity_factor, n_esp=layout.n_esp, n_mp=layout.n_mp,
        )
    item = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
    t = step_times(model, config, layout, tokens, itemsize=item)
    return min(("s1", "s2", "baseline"), key=lambda s: t[s])  # ties: the paper's order


# ---------------------------------------------------------------------------------------------
# Fitting on the real groups
# ---------------------------------------------------------------------------------------------


def device_sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA; a no-op on CPU): host timers measure the work,
    not its launch. A host sync, at fit time only."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time_interleaved(fns: Sequence, reps: int, device=None) -> list[float]:
    """Median seconds of each of ``fns`` over ``reps`` rounds, one call of each per round (after
    one warm-up round). Interleaving puts every size of every fit under the same load, so a
    burst of load on a shared machine shifts all of a fit's points alike (its alpha and beta
    stay), where timing one size after another lets it tilt the line. The order rotates by
    round and is the same on every rank (collectives are called in the same order). On a CUDA
    ``device`` each call is bracketed by :func:`device_sync`."""
    n = len(fns)
    for fn in fns:
        fn()
    ts = [[] for _ in range(n)]
    for rep in range(reps):
        for j in range(n):
            i = (j + rep) % n
            device_sync(device)
            t0 = time.perf_counter()
            fns[i]()
            device_sync(device)
            ts[i].append(time.perf_counter() - t0)
    return [sorted(t)[len(t) // 2] for t in ts]


def geometric_sizes(lo: int, hi: int, factor: int = 4) -> list[int]:
    """``lo, lo*factor, lo*factor^2, ...`` below ``hi``, then ``hi`` (at least two sizes)."""
    lo, hi = max(1, int(lo)), max(int(hi), int(lo) + 1)
    out = []
    v = lo
    while v < hi:
        out.append(v)
        v *= factor
    return out + [hi]


def message_elements(config, layout, tokens: int) -> float:
    """The largest message, in elements, that one step of any schedule sends for a batch of
    ``tokens`` tokens per MP group (the sizes :func:`step_times` evaluates the fits at)."""
    M, K = config.d_model, config.top_k
    f = 1.0 if config.capacity_factor is None else float(config.capacity_factor)
    x, y = _sizes(tokens, M, K, config.capacity_factor, layout.n_esp)
    routed = K * f * tokens
    return max(x * layout.n_esp, y, routed * layout.n_esp * M, float(M))


def collective_rows(config, layout, tokens: int, width: int) -> list[int]:
    """Rows of ``width`` elements per rank and peer at which :func:`measure_cost_model` times the
    collectives for a layer: from one row up to the layer's largest message of a batch of
    ``tokens`` tokens (:func:`message_elements`; split over the smallest group, 2 ranks), by
    factors of 4 -- the span the step model is evaluated on, small messages included (they
    set the startup alpha)."""
    need = message_elements(config, layout, tokens)
    return geometric_sizes(1, max(16, -(-int(need) // (2 * width))))


def local_tokens(layout, tokens: int) -> list[int]:
    """Token counts at which the layer's local work is timed: from 16 up to the most any
    schedule computes per rank (the baseline's ``n_esp`` batches), by factors of 4."""
    return geometric_sizes(16, max(64, int(tokens) * layout.n_esp))


#: tokens of the batch on which a layer's schedules are timed to measure their startup (a small
#: batch: fixed costs dominate it; :meth:`tritonmoe.experts.model_parallel.ParmExperts.fit_cost_model`)
PROBE_TOKENS = 32

#: elements per row of the collectives' timing tensors (fits are per element, whatever the layer's
#: width, so every layer of a layout can share them)
COLLECTIVE_WIDTH = 64

#: collective fits cached per process-group set (``id(ParmGroups)`` -> (groups, {key: (rows,
#: fits)})): every layer of a layout shares one fit (Parm fits once per machine and group), a
#: later layer re-measures only if it needs larger messages. The same on every rank: every
#: rank builds the same layers in the same order and agrees the batch size first.
_COLLECTIVE_FITS: dict = {}


def measure_collectives(
    groups,
    *,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
    width: int = COLLECTIVE_WIDTH,
    rows: Sequence[int] = (1, 4, 16, 64, 256, 1024),
    reps: int = 7,
    cache: bool = True,
) -> dict:
    """Alpha-beta fits of every collective of :data:`COLLECTIVES` on this rank's groups (a
    :class:`~tritonmoe.parm_layout.ParmGroups`), collective over the P ranks.

    Each collective is timed at ``rows`` rows of ``width`` elements per rank and peer, all
    sizes of all collectives interleaved (:func:`_time_interleaved`), median over ``reps``
    rounds; every measurement's median over the P ranks is what every rank fits (so every rank
    fits the same model), by least squares on the relative error (:func:`fit_alpha_beta` with
    ``relative=True``). With ``cache``, reuses the fits of an earlier call on the same groups,
    dtype and device whose sizes reach as far."""


    rows = sorted({int(r) for r in rows})
    if not rows or rows[0] < 1:
        raise ValueError(f"rows must be positive row counts, got {list(rows)}")
    lay = groups.layout
    P = lay.P
    dev = device if device is not None else comm_device(groups.ep_esp)
    key = (str(dtype), str(dev), int(width), int(reps))
    entry = _COLLECTIVE_FITS.get(id(groups))
    if cache and entry is not None and entry[0] is groups and key in entry[1]:
        have_rows, fits = entry[1][key]
        if have_rows[-1] >= rows[-1]:
            return dict(fits)
    peers = list(lay.mp_group_of(groups.rank))
    mp = groups.mp_lane if groups.mp_lane is not None else groups.mp
    spec = {  # name -> (group, group size)
        "a2a_all": (groups.ep_esp, P),
        "a2a_ep": (groups.ep, lay.n_ep),
        "ag_mp": (mp, lay.n_mp),
        "ar_mp": (mp, lay.n_mp),
        "ag_esp": (groups.esp, lay.n_esp),
        "ar_esp": (groups.esp, lay.n_esp),
        "rs_esp": (groups.esp, lay.n_esp),
        "ag_all": (groups.ep_esp, P),
        "saa": (groups.ep_esp, P),
    }
    names = list(spec)
    fns, slots, sizes = [], [], {n: [] for n in names}
    for name in names:
        g, n = spec[name]
        live = not (g is None or n < 2 or (name == "saa" and (mp is None or lay.n_mp < 2)))
        for r in rows:
            sizes[name].append(float(r * max(n, 1) * width))
            if not live:
                continue
            x = torch.randn(r * n, width, dtype=dtype, device=dev)
            op = name.split("_")[0]
            if op == "a2a":
                fn = lambda x=x, g=g: dist.all_to_all_single(torch.empty_like(x), x, group=g)  # noqa: E731
            elif op == "ag":
                fn = lambda x=x, part=x[:r], g=g: all_gather_single(torch.empty_like(x), part, group=g)  # noqa: E731
            elif op == "ar":
                fn = lambda x=x, g=g: dist.all_reduce(x.clone(), group=g)  # noqa: E731
            elif op == "rs":
                fn = lambda x=x, g=g, r=r: reduce_scatter_single(x.new_empty((r,) + x.shape[1:]), x, group=g)  # noqa: E731
            else:  # saa: the all-to-all of r rows per peer with the MP all-gather of the result
                def fn(x=x, r=r):
                    ex = RealExecutor(dev)
                    ex.wait(saa_schedule(
                        ex, x, [r] * P, [r] * P, group=groups.ep_esp, rank=groups.rank, mp_group=mp,
                        mp_peers=peers, peer_recv_splits=[[r] * P for _ in peers],
                    ))
            fns.append(fn)
            slots.append((name, len(sizes[name]) - 1))
    times = {n: [0.0] * len(rows) for n in names}
    if fns:
        with backend_errors(f"timing the Parm collectives ({len(fns)} of them)", groups.ep_esp):
            measured = _time_interleaved(fns, reps, dev)
        vals = _median_over_ranks(groups, measured)
        for (name, j), v in zip(slots, vals):
            times[name][j] = v
    fits = {n: fit_alpha_beta(sizes[n], times[n], relative=True) for n in names}
    if cache:
        _COLLECTIVE_FITS.setdefault(id(groups), (groups, {}))[1][key] = (rows, fits)
    return dict(fits)


def _median_over_ranks(groups, values: Sequence[float]) -> list[float]:
    """Each entry's median over the P ranks (every rank gets the same list; deterministic, and
    robust to one rank descheduled during a measurement). Collective over ``groups.ep_esp``."""


    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device(groups.ep_esp))
    if groups.ep_esp is not None and t.numel():
        P = groups.layout.P
        table = torch.empty(P * t.numel(), dtype=t.dtype, device=t.device)
        with backend_errors("the exchange of the Parm cost model's measurements", groups.ep_esp):
            all_gather_single(table, t, group=groups.ep_esp)
        t = table.view(P, -1).median(dim=0).values
    return t.tolist()  # host sync: the fit is a host computation


def measure_cost_model(
    groups,
    *,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
    d_model: int = 64,
    rows: Optional[Sequence[int]] = None,
    reps: int = 7,
    config=None,
    tokens: Optional[int] = None,
    collectives: Optional[dict] = None,
) -> ParmCostModel:
    """Fit a complete :class:`ParmCostModel` on this rank's groups
    (:class:`~tritonmoe.parm_layout.ParmGroups`); collective over the P ranks, and every rank
    fits the same model (each measurement's median over the ranks), so every rank takes the
    same decisions.

    * the collectives: :func:`measure_collectives` at ``rows`` rows of :data:`COLLECTIVE_WIDTH`
      elements per rank and peer (default: :func:`collective_rows` for ``config`` and ``tokens``, the
      layer's own message sizes; without them 1 to 1024 rows), shared by every layer of the
      groups; ``collectives``: fits to use instead (measured once per layout by the caller);
    * a GEMM and a row copy of width ``d_model`` for the compute rates;
    * with ``config`` (the layer's :class:`~tritonmoe.MoEConfig`): the local work of a step
      (route, permute, expert shard FFN, unpermute, forward and backward) on this layout's
      expert shard at :func:`local_tokens` token counts (up to ``tokens`` times ``n_esp``;
      ``tokens`` default 512), fitted by routed row (:attr:`ParmCostModel.local`).

    Every fit is least squares on the relative error over sizes timed interleaved, median of
    ``reps`` rounds."""
    lay = groups.layout

    dev = device if device is not None else comm_device(groups.ep_esp)
    T = 512 if tokens is None else max(1, int(tokens))
    W = COLLECTIVE_WIDTH
    if rows is None:
        rows = collective_rows(config, lay, T, W) if config is not None else geometric_sizes(1, 1024)
    rows = sorted({int(r) for r in rows})
    t0 = time.perf_counter()
    fits = dict(collectives) if collectives is not None else measure_collectives(
        groups, dtype=dtype, device=dev, width=W, rows=rows, reps=reps,
    )
    # compute rates: a GEMM of this layer's width and a row gather
    a = torch.randn(512, d_model, dtype=dtype, device=dev)
    b = torch.randn(d_model, 2 * d_model, dtype=dtype, device=dev)
    idx = torch.randperm(4096, device=dev)
    big = torch.randn(4096, d_model, dtype=dtype, device=dev)
    local_rows, fns = [], [lambda: a @ b, lambda: big.index_select(0, idx)]
    if config is not None:
        local_rows, steps = _local_steps(config, lay, dtype, dev, local_tokens(lay, T))
        fns += steps
    vals = _median_over_ranks(groups, _time_interleaved(fns, reps, dev))
    item = torch.empty((), dtype=dtype).element_size()
    local = fit_alpha_beta(local_rows, vals[2:], relative=True) if local_rows else None
    return ParmCostModel(
        ag_mp=fits["ag_mp"], a2a=fits["a2a_all"], overlap=fits["saa"], collectives=fits,
        flops_per_s=2.0 * 512 * d_model * 2 * d_model / max(vals[0], 1e-9),
        copy_bytes_per_s=2.0 * 4096 * d_model * item / max(vals[1], 1e-9), local=local,
        source=(f"measured on {lay.describe()} ({dtype}, collectives at rows {list(rows)} x {W}, "
                f"local work at tokens {local_tokens(lay, T) if config is not None else []}, "
                f"{reps} rounds interleaved, relative least squares; "
                f"{time.perf_counter() - t0:.2f} s{' after the shared collective fits' if collectives else ''})"),
    )


def _local_steps(config, layout, dtype, device, token_counts: Sequence[int]) -> tuple[list[float], list]:
    """(routed rows, step callables) of this rank's local work of a step at each token count --
    route and permute over the E experts, the grouped FFN of this rank's expert shards (its
    ``E / n_ep`` experts, ``d_ffn / n_esp`` wide, the routed rows spread evenly over them),
    unpermute, forward and backward -- with the implementations the layer runs (its backend,
    device and dtype). No communication."""

    c = config
    Fs = c.d_ffn // layout.n_esp
    n1 = 2 * Fs if c.activation in GLU_ACTIVATIONS else Fs
    E = c.num_experts
    L = max(1, E // layout.n_ep)
    route, permute, ffn, unpermute = (implementation(op, c.backend, torch.device(device), dtype)
                                      for op in ("route", "permute", "grouped_ffn", "unpermute"))
    opts = ffn_options(c)
    out_rows, steps = [], []
    for T in token_counts:
        g = torch.Generator(device="cpu").manual_seed(int(T))
        x = torch.randn(T, c.d_model, generator=g, dtype=dtype).to(device)
        wr = torch.randn(E, c.d_model, generator=g, dtype=dtype).to(device)
        w1 = (torch.randn(L, c.d_model, n1, generator=g, dtype=dtype) * 0.1).to(device).requires_grad_()
        w2 = (torch.randn(L, Fs, c.d_model, generator=g, dtype=dtype) * 0.1).to(device).requires_grad_()
        R = T * c.top_k
        offs = torch.tensor([R * e // L for e in range(L + 1)], dtype=torch.int64, device=device)

        def step(x=x, wr=wr, w1=w1, w2=w2, offs=offs):
            xi = x.clone().requires_grad_()
            r = route(xi @ wr.t(), c.top_k)
            xp, info = permute(xi, r.topk_ids, E)
            y = ffn(xp, offs, w1, w2, c.activation, **opts)
            unpermute(y, info, r.topk_weights).sum().backward()
            w1.grad = w2.grad = None

        steps.append(step)
        out_rows.append(float(T * c.top_k))
    return out_rows, steps


# ---------------------------------------------------------------------------------------------
# The run-time policy of an expert path
# ---------------------------------------------------------------------------------------------


class ParmSchedulePolicy:
    """``parm_schedule`` at run time for one layer on one rank's groups: the schedule of each
    forward, and for ``"auto"`` the fitted step model it decides with.

    The policy never sees the expert path: to measure the schedules' startup it is handed a
    callable that runs one schedule (:meth:`fit`), so the policy floor stays below the paths.

    Attributes:
        config: the layer's :class:`~tritonmoe.MoEConfig`.
        groups: this rank's :class:`~tritonmoe.parm_layout.ParmGroups`.
        cost_model: the fitted :class:`ParmCostModel` ``auto`` decides with (fitted at the first
            ``auto`` decision when None; set one to skip the measurement).
    """

    def __init__(self, config, groups) -> None:
        self.config = config
        self.groups = groups
        self.layout = groups.layout
        self.cost_model: Optional[ParmCostModel] = None

    def agreed_tokens(self, tokens: int, refused: Optional[BaseException] = None) -> int:
        """The batch size every rank decides for: the maximum of ``tokens`` over the P ranks
        (ragged batches differ in T; one all-reduce over ``groups.ep_esp``).

        The same all-reduce carries every rank's status word (docs/rank-input.md): the vector is
        ``[tokens, s_0, ..., s_{P-1}]`` with this rank's :func:`~tritonmoe.comm.errors.input_status`
        of ``refused`` in its own slot and zeros elsewhere, so the MAX gives every rank every
        rank's word. When any word is set every rank raises the same
        :class:`~tritonmoe.comm.errors.RankInputError` here, before the fit's probes or any
        schedule's exchange (the healthy path: P more int64 in a message already sent)."""
        g = self.groups.ep_esp
        if g is None:
            if refused is not None:
                raise refused
            return int(tokens)
        P, me = self.layout.P, dist.get_rank(g)
        vec = [0] * (1 + P)
        vec[0], vec[1 + me] = int(tokens), input_status(refused)
        # host sync: the decision must be the same on every rank (ragged batches differ in T)
        t = torch.tensor(vec, dtype=torch.int64, device=comm_device(g))
        with backend_errors("the Parm schedule agreement (allreduce MAX of the token count)", g):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        agreed = t.tolist()
        raise_rank_input_error(agreed[1:], refused, g, "the Parm schedule agreement (parm_schedule='auto')")
        return int(agreed[0])

    def choose(self, x_TD: torch.Tensor, fit: Optional[Callable[[torch.Tensor, int], ParmCostModel]] = None,
               refused: Optional[BaseException] = None) -> str:
        """The schedule of this forward ("baseline", "s1" or "s2"). For ``"auto"``: the tokens
        agreed over the ranks (:meth:`agreed_tokens`, which raises every rank's
        :class:`~tritonmoe.comm.errors.RankInputError` when a rank ``refused`` its input, before
        the fit), the cost model fitted at the first call (``fit(x_TD, tokens)``, default
        :meth:`fit` without a probe), then :func:`choose_schedule` (every rank decides from the
        same agreed inputs)."""
        c = self.config
        if c.parm_schedule != "auto":
            return c.parm_schedule
        T = self.agreed_tokens(x_TD.shape[0], refused)
        if self.cost_model is None:
            self.cost_model = (fit or self.fit)(x_TD, T)
        return choose_schedule(self.cost_model, c, self.layout, T, dtype=x_TD.dtype)

    def fit(self, x_TD: torch.Tensor, tokens: int, run: Optional[Callable[[torch.Tensor, str], None]] = None,
            *, reps: int = 9) -> ParmCostModel:
        """The step model ``auto`` decides with (collective over the P ranks; every rank gets the
        same model): :func:`measure_cost_model` on the groups, spanning the message sizes of a
        batch of ``tokens`` (the agreed batch size; the collectives' fits are shared by every
        layer of these groups), then, with ``run`` and autograd enabled, each schedule's startup:
        :meth:`time_schedules` on a small batch (the first :data:`PROBE_TOKENS` rows of
        ``x_TD``), minus what the fitted terms predict for it (:attr:`ParmCostModel.startup`).

        ``run(x, schedule)``: the layer's forward + backward under ``schedule`` on ``x`` (a leaf
        that requires grad), gradients returned, not accumulated."""
        c = self.config
        model = measure_cost_model(self.groups, dtype=x_TD.dtype, device=x_TD.device, d_model=c.d_model, config=c,
                                   tokens=tokens)
        if run is None or not torch.is_grad_enabled():
            return model
        T0 = min(int(tokens), PROBE_TOKENS)
        measured = self.time_schedules(run, x_TD[: min(T0, x_TD.shape[0])], reps)
        item = x_TD.element_size()
        pred = step_times(model, c, self.layout, T0, itemsize=item)
        startup = {s: measured[s] - pred[s] for s in measured}
        return dataclasses.replace(model, startup=startup, source=model.source + (
            f"; startup measured on the layer at {T0} tokens: "
            + ", ".join(f"{s} {measured[s] * 1e3:.2f} ms (model {pred[s] * 1e3:.2f})" for s in measured)))

    def time_schedules(self, run: Callable[[torch.Tensor, str], None], x_TD: torch.Tensor, reps: int) -> dict[str, float]:
        """Seconds of ``run(x, schedule)`` (one forward + backward) under each schedule on
        ``x_TD``: per round, each schedule once (the order rotating); a round's time is the
        maximum over the P ranks (a step ends when its last rank does); the median over ``reps``
        rounds after one warm-up round. Collective; the same result on every rank."""
        scheds = ("baseline", "s1", "s2")
        rows = []
        for rep in range(1 + reps):
            ts = [0.0] * len(scheds)
            for j in range(len(scheds)):
                k = (j + rep) % len(scheds)
                xi = x_TD.detach().clone().requires_grad_()
                device_sync(xi.device)  # host sync (fit time only): time the work, not its launch
                t0 = time.perf_counter()
                run(xi, scheds[k])
                device_sync(xi.device)
                ts[k] = time.perf_counter() - t0
            if rep:
                rows.append(ts)
        t = torch.tensor(rows, dtype=torch.float64)
        g = self.groups.ep_esp
        if g is not None:
            dev = comm_device(g)
            t = t.to(dev)
            table = torch.empty(self.layout.P * t.numel(), dtype=t.dtype, device=dev)
            with backend_errors("the exchange of the Parm schedules' probe times", g):
                all_gather_single(table, t.reshape(-1), group=g)
            t = table.view((self.layout.P,) + tuple(t.shape)).amax(0)
        med = t.median(dim=0).values.tolist()  # host sync: the fit is a host computation
        return dict(zip(scheds, med))
