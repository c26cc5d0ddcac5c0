"""Fused Triton router: ``route`` with the signature and contract of :func:`tritonmoe.reference.route`.

Forward (no host synchronization; launches in stream order):

* dropless: ``_route_fwd_kernel`` (one read of the logits; ids, weights, integer-atomic counts,
  and with ``with_aux`` per-block score sums + per-token logsumexp), then, with ``with_aux``, a
  fixed-order sum of the per-block score sums.
* with ``capacity`` (``drop_policy="slot"``): the same kernel also writes per-block, per-slot
  expert histograms; ``_capacity_scan_kernel`` turns them into exclusive offsets in priority
  order (slot j, then token t); ``_capacity_keep_kernel`` drops the slots past capacity.
* ``drop_policy="position"``: per-block histograms (all slots together), the same scan with one
  slot row (token order), then ``_position_keep_kernel`` (ranks inside a block by a cumulative
  sum of the block's occupancy tile).
* ``drop_policy="probs"``: the kernel also writes each slot's canonical weight (the priority);
  a device sort pass after it keeps each expert's highest (:func:`_drop_pass`; no host sync).

Backward: ``_route_bwd_kernel`` maps d(topk_weights), d(score_sum) and d(logsumexp) to
d(logits) in one pass (it re-reads the logits instead of saving the [T, E] scores).

Tile and warp choices live in :func:`route_config` (keyed by the padded expert tile), unless the
running device's tuned table has an entry for the shape (target ``route``, keyed by E, groups and
tokens); tests override them with ``tritonmoe.kernels.config.override("route", cfg)`` (old
spelling: :func:`config_override`). There is no autotuning, so ``TRITONMOE_AUTOTUNE``
does not apply here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from tritonmoe.core import validation as V
from tritonmoe.core.autograd import first_order
from tritonmoe.core.types import Routing

from . import config as CF
from ._host import cdiv, device_ctx, next_power_of_2
from ._routing_kernels import (
    _balance_sums_bwd_kernel,
    _balance_sums_fwd_kernel,
    _capacity_keep_kernel,
    _position_keep_kernel,
    _capacity_scan_kernel,
    _route_bwd_kernel,
    _route_fwd_kernel,
)

__all__ = ["route", "balance_score_sums", "RouteConfig", "route_config", "route_key", "config_override", "MAX_TILE_LANES",
           "FWD_COMPILE_OPTIONS"]

#: Compile options of the forward kernel. No FMA contraction: the canonical selection values
#: (see ``_routing_kernels``) must round every multiply and every add on its own, as the
#: reference does, to be bit-identical to it.
FWD_COMPILE_OPTIONS = {"enable_fp_fusion": False}

#: Largest register tile of expert lanes (next_pow2(n_groups) * next_pow2(E / n_groups)) one
#: program holds. 8192 keeps a row's int64 keys in registers with 16 warps.
MAX_TILE_LANES = 8192


@dataclass(frozen=True)
class RouteConfig:
    """Launch parameters of the routing kernels.

    block_t / num_warps: tokens per program and warps of the forward kernel (and of the capacity
    keep pass, which works on the same token blocks). bwd_block_t / bwd_num_warps: the same for
    the backward kernel. Capacity scan: scan_block_r x scan_block_e tiles (rows of the [K*NB, E]
    histograms x experts); scan_split_slots runs one program per slot j (parallel; the forward
    then also keeps per-slot totals with integer atomics) instead of one program down all slots.
    """

    block_t: int
    num_warps: int
    bwd_block_t: int
    bwd_num_warps: int
    scan_block_r: int = 128
    scan_block_e: int = 32
    scan_split_slots: bool = True

    def __post_init__(self) -> None:
        for name in ("block_t", "bwd_block_t", "scan_block_r", "scan_block_e"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"RouteConfig.{name}={v!r} must be a power of two >= 1")
        for name in ("num_warps", "bwd_num_warps"):
            v = getattr(self, name)
            if v not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"RouteConfig.{name}={v!r} must be a power of two in [1, 32]")
        if not isinstance(self.scan_split_slots, bool):
            raise TypeError(f"RouteConfig.scan_split_slots={self.scan_split_slots!r} must be a bool")


CF.register("route", RouteConfig, probe=RouteConfig(1, 1, 1, 1), doc="the routing kernels (route_config)")


@contextlib.contextmanager
def config_override(config: RouteConfig) -> Iterator[None]:
    """Use ``config`` for every route launch in this block (tests use it to force several token
    blocks, so the capacity scan crosses blocks, on small inputs). Deprecated spelling of
    ``tritonmoe.kernels.config.override("route", config)``."""
    CF.deprecated("routing.config_override(cfg)", 'override("route", cfg)')
    if not isinstance(config, RouteConfig):
        raise TypeError(f"config must be a RouteConfig, got {type(config).__name__}")
    with CF.override("route", config):
        yield


def route_key(num_experts: int, n_groups: int) -> dict:
    """Exact fields of a ``route`` table key (the bucket is T, tokens)."""
    return {"E": int(num_experts), "G": int(n_groups)}


#: (problem, device, TRITONMOE_CONFIG_TABLE) -> the chosen problem, filled only while no override
#: or recording is active (CF.quiet()), so a call pays one dict lookup, not the table lookup.
_CHOSEN: dict = {}


def _choose(prob: "_Problem", device: torch.device) -> "_Problem":
    """The tuned table's config for this problem (else the cached heuristic one), then an
    override; noted for recordings. Without an override or recording: cached per (problem,
    device), one dict lookup per call."""
    if not CF.quiet():
        return _choose_now(prob, device)
    # keyed by identity (``_problem`` hands out one object per problem; hashing the dataclass
    # would hash its 19 fields on every call), the entry holding the problem it was made for
    key = (id(prob), device, os.environ.get("TRITONMOE_CONFIG_TABLE"))
    hit = _CHOSEN.get(key)
    if hit is None or hit[0] is not prob:
        if len(_CHOSEN) >= 4096:  # bounded, like _problem's cache
            _CHOSEN.clear()
        hit = _CHOSEN[key] = (prob, _choose_now(prob, device))
    return hit[1]


def _choose_now(prob: "_Problem", device: torch.device) -> "_Problem":
    tbl = CF.table_for(device)
    cfg, source = prob.config, "heuristic"
    if tbl is not None:
        hit = tbl.lookup("route", route_key(prob.E, prob.G), prob.T)
        if hit is not None:
            cfg, source = hit, "table"
    cfg, forced = CF.resolve("route", cfg)
    if forced:
        source = "override"
    CF.note("route", route_key(prob.E, prob.G), cfg, source, bucket=prob.T)
    return prob if cfg is prob.config else dataclasses.replace(prob, config=cfg)


@functools.lru_cache(maxsize=None)  # a few (lanes, interpret) pairs; the config is immutable
def route_config(lanes: int, interpret: bool = False) -> RouteConfig:
    """Launch parameters for a tile of ``lanes`` padded expert lanes per token.

    On the GPU a program holds about 2048 (token, expert) elements with 4 warps (16 per thread,
    the int64 keys included, stay in registers): E=128 gives 16 tokens per program, so T=4096
    makes 256 programs, about two per SM of an H100/H200. Wider rows get one token and more
    warps. In the interpreter programs run one after another and each op is vectorized, so fewer,
    larger programs are faster.
    """
    if interpret:
        bt = max(1, min(16, 4096 // lanes))
        return RouteConfig(block_t=bt, num_warps=4, bwd_block_t=bt, bwd_num_warps=4, scan_block_r=256,
                           scan_block_e=max(16, min(128, lanes)), scan_split_slots=False)
    bt = max(1, min(64, 2048 // lanes))
    warps = max(4, min(16, bt * lanes // 512))
    return RouteConfig(block_t=bt, num_warps=warps, bwd_block_t=bt, bwd_num_warps=warps)


@dataclass(frozen=True)
class _Problem:
    """Static description of one route call (what the kernels are specialized on)."""

    T: int
    E: int
    K: int
    G: int
    S: int
    topk_groups: int
    softmax: bool
    renormalize: bool
    capacity: Optional[int]
    with_aux: bool
    group_max: bool
    scale: float
    sqrtsp: bool
    group_topn: int
    drop_policy: str
    block_g: int
    block_s: int
    block_k: int
    config: RouteConfig


@functools.lru_cache(maxsize=1024)
def _problem(T: int, E: int, top_k: int, n_groups, topk_groups, score_func: str, renormalize: bool, capacity,
             with_aux: bool, group_score: str, scale: float, interpret: bool, drop_policy: str = "slot") -> _Problem:
    """The static description of a route call, cached: the launcher's host work per call is the
    launch, not rebuilding (and re-validating) the same problem and tile config for every batch.
    Keyed by the validated arguments (bools and ints already normalized by the caller)."""
    G = n_groups if n_groups is not None and n_groups > 1 else 1
    S = E // G
    block_g = next_power_of_2(G)
    block_s = next_power_of_2(S)
    lanes = block_g * block_s
    if lanes > MAX_TILE_LANES:
        raise ValueError(
            f"num_experts={E} (n_groups={n_groups}) needs a tile of {lanes} expert lanes, above the "
            f"Triton router's limit of {MAX_TILE_LANES}; use backend='torch' for this router"
        )
    return _Problem(
        T=T,
        E=E,
        K=top_k,
        G=G,
        S=S,
        topk_groups=topk_groups if G > 1 else 1,
        softmax=score_func == "softmax",
        renormalize=renormalize,
        capacity=capacity,
        with_aux=with_aux,
        group_max=group_score == "max",
        scale=scale,
        sqrtsp=score_func == "sqrtsoftplus",
        group_topn=top_k // topk_groups if group_score == "sum_topn" and G > 1 else 0,
        drop_policy=drop_policy if capacity is not None else "slot",
        block_g=block_g,
        block_s=block_s,
        block_k=next_power_of_2(top_k),
        config=route_config(lanes, interpret=interpret),
    )


#: (id(problem), has bias, check) -> (problem, the forward kernel's constant keyword arguments)
_FWD_CONSTS: dict = {}


def _fwd_consts(prob: _Problem, has_bias: bool, check: bool) -> dict:
    """The forward kernel's specialization and launch options for a problem, built once (the
    per-call launch passes only the tensors, T, NB and the strides)."""
    key = (id(prob), has_bias, check)
    hit = _FWD_CONSTS.get(key)
    if hit is not None and hit[0] is prob:
        return hit[1]
    cfg, K = prob.config, prob.K
    has_cap = prob.capacity is not None and prob.drop_policy == "slot"
    consts = dict(
        G=prob.G, S=prob.S, TOPK_GROUPS=prob.topk_groups, K=K, SOFTMAX=prob.softmax, RENORMALIZE=prob.renormalize,
        HAS_BIAS=has_bias, HAS_CAPACITY=has_cap, SLOT_TOTALS=has_cap and cfg.scan_split_slots and K > 1,
        WITH_AUX=prob.with_aux, BLOCK_T=cfg.block_t, BLOCK_G=prob.block_g, BLOCK_S=prob.block_s,
        BLOCK_K=prob.block_k, scale=prob.scale, GROUP_MAX=prob.group_max, SQRTSP=prob.sqrtsp,
        GROUP_TOPN=prob.group_topn, WITH_PRIO=prob.capacity is not None and prob.drop_policy == "probs",
        BLOCK_HIST=prob.capacity is not None and prob.drop_policy == "position", CHECK=check,
        # the fused bias guard; with capacity the keep passes write 0 to dropped slots after it,
        # so route() applies the guard to their final weights instead
        POISON=has_bias and prob.capacity is None,
        num_warps=cfg.num_warps, **FWD_COMPILE_OPTIONS,
    )
    if len(_FWD_CONSTS) >= 4096:
        _FWD_CONSTS.clear()
    _FWD_CONSTS[key] = (prob, consts)
    return consts


def _forward(prob: _Problem, logits_TE: torch.Tensor, bias_E: Optional[torch.Tensor],
             flag: Optional[torch.Tensor] = None):
    T, E, K = prob.T, prob.E, prob.K
    dev = logits_TE.device
    cfg = prob.config
    ids_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    w_TK = torch.empty(T, K, dtype=torch.float32, device=dev)
    counts_E = torch.zeros(E, dtype=torch.int32, device=dev)
    # "position": the kernel writes per-block selection histograms, scanned in token order, then
    # _position_keep_kernel drops; "probs": the kernel routes as if dropless (counting the
    # selected slots) and writes the drop priority, then a sort pass drops (_drop_pass)
    has_cap = prob.capacity is not None and prob.drop_policy == "slot"
    with_prio = prob.capacity is not None and prob.drop_policy == "probs"
    by_position = prob.capacity is not None and prob.drop_policy == "position"
    selected_E = torch.zeros(E, dtype=torch.int32, device=dev) if has_cap or by_position else counts_E
    score_sum_E = lse_T = None
    if T == 0:  # nothing to launch; empty outputs of the right shapes
        if prob.with_aux:
            score_sum_E = torch.zeros(E, dtype=torch.float32, device=dev)
            lse_T = torch.empty(0, dtype=torch.float32, device=dev)
        return ids_TK, w_TK, counts_E, selected_E, score_sum_E, lse_T, ids_TK

    NB = cdiv(T, cfg.block_t)
    dummy_i32 = counts_E
    split = cfg.scan_split_slots and K > 1
    slot_hist = (torch.empty(K, NB, E, dtype=torch.int32, device=dev) if has_cap
                 else torch.empty(1, NB, E, dtype=torch.int32, device=dev) if by_position else dummy_i32)
    slot_tot = torch.zeros(K, E, dtype=torch.int32, device=dev) if has_cap and split else dummy_i32
    if prob.with_aux:
        part_BE = torch.empty(NB, E, dtype=torch.float32, device=dev)
        lse_T = torch.empty(T, dtype=torch.float32, device=dev)
    dummy_f32 = w_TK  # placeholder for pointers a specialization never reads
    prio_TK = torch.empty(T, K, dtype=torch.float32, device=dev) if with_prio else dummy_f32
    with device_ctx(logits_TE.device):
        _route_fwd_kernel[(NB,)](
            logits_TE,
            bias_E if bias_E is not None else dummy_f32,
            ids_TK,
            w_TK,
            counts_E,
            slot_hist,
            slot_tot,
            part_BE if prob.with_aux else dummy_f32,
            lse_T if prob.with_aux else dummy_f32,
            T,
            NB,
            logits_TE.stride(0),
            logits_TE.stride(1),
            prio_ptr=prio_TK,
            flag_ptr=flag if flag is not None else dummy_i32,
            **_fwd_consts(prob, bias_E is not None, flag is not None),
        )
        sel_ids_TK = ids_TK
        if has_cap:
            slots_per_prog = 1 if split else K
            _capacity_scan_kernel[(K // slots_per_prog, cdiv(E, cfg.scan_block_e))](
                slot_hist,
                slot_tot,
                counts_E,
                selected_E,
                NB,
                prob.capacity,
                E,
                K=K,
                SLOTS_PER_PROG=slots_per_prog,
                BLOCK_R=cfg.scan_block_r,
                BLOCK_E=cfg.scan_block_e,
                BLOCK_J=min(64, prob.block_k),
                num_warps=4,
            )
            ids_TK = torch.empty_like(sel_ids_TK)
            _capacity_keep_kernel[(NB,)](
                sel_ids_TK,
                slot_hist,
                ids_TK,
                w_TK,
                T,
                NB,
                prob.capacity,
                E,
                K=K,
                BLOCK_T=cfg.block_t,
                BLOCK_KC=max(1, min(prob.block_k, 8192 // (cfg.block_t * cfg.block_t))),
                num_warps=cfg.num_warps,
            )
        if by_position:
            ids_TK = _position_drop(prob, sel_ids_TK, w_TK, slot_hist, counts_E, selected_E, NB)
    if with_prio:
        ids_TK, w_TK, counts_E = _drop_pass(sel_ids_TK, w_TK, selected_E, prio_TK, prob.capacity)
    if prob.with_aux:
        # fixed-order reduction of the per-block partial sums (deterministic; no float atomics)
        score_sum_E = part_BE.sum(dim=0)
    return ids_TK, w_TK, counts_E, selected_E, score_sum_E, lse_T, sel_ids_TK


def _position_drop(prob: _Problem, sel_ids_TK, w_TK, hist_1BE, counts_E, selected_E, NB: int) -> torch.Tensor:
    """Drop by "position": the blocks' selection histograms scanned in token order (the scan
    kernel with one slot row; it writes the kept and selected counts), then the in-block ranks
    (``_position_keep_kernel``, which zeroes the dropped weights in place). Returns the ids."""
    cfg, E = prob.config, prob.E
    _capacity_scan_kernel[(1, cdiv(E, cfg.scan_block_e))](
        hist_1BE, hist_1BE, counts_E, selected_E, NB, prob.capacity, E, K=1, SLOTS_PER_PROG=1,
        BLOCK_R=cfg.scan_block_r, BLOCK_E=cfg.scan_block_e, BLOCK_J=1, num_warps=4,
    )
    ids_TK = torch.empty_like(sel_ids_TK)
    _position_keep_kernel[(NB,)](
        sel_ids_TK, hist_1BE, ids_TK, w_TK, prob.T, prob.capacity, E, K=prob.K, BLOCK_T=cfg.block_t,
        BLOCK_E=next_power_of_2(E), num_warps=cfg.num_warps,
    )
    return ids_TK


def _drop_pass(sel_ids_TK: torch.Tensor, w_TK: torch.Tensor, selected_E: torch.Tensor, prio_TK: torch.Tensor,
               capacity: int):
    """Capacity dropping by "probs": each expert keeps its ``capacity`` highest priorities, ties
    to the earlier token; on the device without a host sync: one sort of the slots by a
    composite int64 key (descending priority, then token) and a stable sort by expert, then each
    slot's rank on its expert against ``capacity``. Returns (ids, weights, kept counts)."""
    T, K = sel_ids_TK.shape
    E = selected_E.shape[0]
    e = sel_ids_TK.reshape(-1).long()
    tok = torch.arange(T * K, device=e.device) // K
    # the fp32 bits mapped to an order-preserving unsigned 32-bit integer, complemented (descending),
    # above the token id (T < 2^31)
    bits = prio_TK.reshape(-1).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31
    inner = ((2**32 - 1 - ordered) << 31) | tok
    order = torch.argsort(inner, stable=True)
    order = order[torch.argsort(e[order], stable=True)]  # by expert, the inner order kept
    starts = torch.cumsum(selected_E.long(), 0) - selected_E.long()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(T * K, device=e.device) - starts[e[order]]
    keep = (rank < capacity).view(T, K)
    ids = torch.where(keep, sel_ids_TK, torch.full_like(sel_ids_TK, -1))
    w = torch.where(keep, w_TK, torch.zeros_like(w_TK))
    kept = torch.zeros(E + 1, dtype=torch.int64, device=e.device)
    kept.scatter_add_(0, torch.where(keep.reshape(-1), e + 1, torch.zeros_like(e)), torch.ones_like(e))
    return ids, w, kept[1:].to(torch.int32)


def _backward(prob: _Problem, logits_TE, sel_ids_TK, ids_TK, dw_TK, dss_E, dlse_T) -> torch.Tensor:
    T = prob.T
    dlogits_TE = torch.empty(T, prob.E, dtype=logits_TE.dtype, device=logits_TE.device)
    if T == 0:
        return dlogits_TE
    cfg = prob.config
    dummy = next(g for g in (dw_TK, dss_E, dlse_T) if g is not None)  # for pointers never read
    dw = dw_TK.float() if dw_TK is not None else dummy
    dss = dss_E.float() if dss_E is not None else dummy
    dlse = dlse_T.float() if dlse_T is not None else dummy
    with device_ctx(logits_TE.device):
        _route_bwd_kernel[(cdiv(T, cfg.bwd_block_t),)](
            logits_TE,
            sel_ids_TK,
            ids_TK,
            dw,
            dss,
            dlse,
            dlogits_TE,
            T,
            logits_TE.stride(0),
            logits_TE.stride(1),
            dw.stride(0) if dw_TK is not None else 0,
            dw.stride(1) if dw_TK is not None else 0,
            dss.stride(0) if dss_E is not None else 0,
            dlse.stride(0) if dlse_T is not None else 0,
            G=prob.G,
            S=prob.S,
            K=prob.K,
            SOFTMAX=prob.softmax,
            RENORMALIZE=prob.renormalize,
            HAS_CAPACITY=prob.capacity is not None,
            HAS_DW=dw_TK is not None,
            HAS_DSS=dss_E is not None,
            HAS_DLSE=dlse_T is not None,
            BLOCK_T=cfg.bwd_block_t,
            BLOCK_G=prob.block_g,
            BLOCK_S=prob.block_s,
            BLOCK_K=prob.block_k,
            scale=prob.scale,
            SQRTSP=prob.sqrtsp,
            num_warps=cfg.bwd_num_warps,
        )
    return dlogits_TE


class _RouteFn(torch.autograd.Function):
    """Autograd wrapper: outputs (ids, weights, counts, selected_counts, score_sum, logsumexp);
    weights, score_sum and logsumexp are differentiable w.r.t. the logits."""

    @staticmethod
    def forward(ctx, logits_TE, bias_E, prob: _Problem, flag):
        ids, w, counts, selected, score_sum, lse, sel_ids = _forward(prob, logits_TE, bias_E, flag)
        ctx.prob = prob
        ctx.save_for_backward(logits_TE, sel_ids, ids)
        ctx.mark_non_differentiable(ids, counts, selected)
        ctx.set_materialize_grads(False)
        return ids, w, counts, selected, score_sum, lse

    @staticmethod
    @first_order("route (Triton)")  # the fused backward kernel is not itself differentiable: say so loudly
    def backward(ctx, _d_ids, dw_TK, _d_counts, _d_selected, dss_E, dlse_T):
        logits_TE, sel_ids, ids = ctx.saved_tensors
        if dw_TK is None and dss_E is None and dlse_T is None:
            return None, None, None, None
        dlogits = _backward(ctx.prob, logits_TE, sel_ids, ids, dw_TK, dss_E, dlse_T)
        return dlogits, None, None, None


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    n_groups: int | None = None,
    topk_groups: int | None = None,
    capacity: int | None = None,
    with_aux: bool = False,
    group_score: str = "top2sum",
    routed_scaling_factor: float = 1.0,
    drop_policy: str = "slot",
    check: bool = False,
) -> Routing:
    """Top-k routing with the fused Triton kernels; the contract of :func:`tritonmoe.route`
    (arguments already validated there). The ids equal :func:`tritonmoe.reference.route`'s bit
    for bit: both compare the canonical selection values of
    :func:`tritonmoe.reference.selection_values` (see ``_routing_kernels``).

    A non-finite ``expert_bias`` makes every weight NaN, as
    :func:`tritonmoe.reference.nan_weights_if_nonfinite` does (``route.fused_bias_guard``: the
    caller need not apply it again): dropless, inside the forward kernel (no extra launch);
    with capacity, on the final weights. ``check=True`` (``route.fused_checks``) runs the value
    checks of :func:`tritonmoe.core.validation.route_values` inside the forward kernel (one
    int32 flag, set by any program that sees a NaN logit, a +inf or an all -inf row under
    softmax, or a non-finite bias) and reads the flag back once: a host sync, so only for
    validated calls; a set flag raises that function's ``ValueError``.

    Host path (dropless, no aux): the cached problem, the outputs (ids, weights, zeroed counts)
    and one launch.

    fp16/bf16/fp32 logits only: the kernels compute in fp32, which would not meet the fp64
    contract (fp64 scores, weights and aux tensors); :mod:`tritonmoe.backends` routes fp64 logits
    to the reference.
    """
    if logits_TE.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the Triton router computes in fp32 and takes fp16/bf16/fp32 logits, got {logits_TE.dtype}; "
            "tritonmoe.backends sends fp64 to tritonmoe.reference.route"
        )
    T, E = logits_TE.shape
    prob = _problem(T, E, top_k, n_groups, topk_groups, score_func, renormalize, capacity, with_aux, group_score,
                    float(routed_scaling_factor), logits_TE.device.type != "cuda", drop_policy)
    prob = _choose(prob, logits_TE.device)
    bias_E = None
    if expert_bias is not None:
        bias_E = expert_bias.detach() if expert_bias.requires_grad else expert_bias
        if bias_E.dtype != torch.float32 or not bias_E.is_contiguous():
            bias_E = bias_E.float().contiguous()
    if check and T == 0:  # nothing launches: the checks on the host (only the bias has values)
        V.route_values(logits_TE, score_func, expert_bias)
        check = False
    flag = torch.zeros(1, dtype=torch.int32, device=logits_TE.device) if check else None
    if logits_TE.requires_grad and torch.is_grad_enabled():
        ids, w, counts, selected, score_sum, lse = _RouteFn.apply(logits_TE, bias_E, prob, flag)
    else:  # no graph to record: the launches without the autograd Function's host cost
        ids, w, counts, selected, score_sum, lse, _ = _forward(prob, logits_TE, bias_E, flag)
    if check and flag.item():  # host sync: validation on (set_validation(False) skips it); error path reads more
        V.route_values(logits_TE, score_func, expert_bias)
        raise ValueError(f"the router's value check failed (flag {int(flag)}) but route_values found nothing; "
                         "please report this")  # pragma: no cover - the kernel and route_values check the same
    if expert_bias is not None and prob.capacity is not None:
        w = _nan_if_nonfinite(w, bias_E)
    return Routing(
        topk_ids=ids,
        topk_weights=w,
        counts=counts,
        selected_counts=selected,
        score_func=score_func,
        score_sum=score_sum,
        logsumexp=lse,
    )


route.fused_bias_guard = True  # type: ignore[attr-defined]
route.fused_checks = True  # type: ignore[attr-defined]


def _nan_if_nonfinite(w_TK: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor:
    """:func:`tritonmoe.reference.nan_weights_if_nonfinite` (w + 0, or w + NaN; no host sync),
    for the capacity paths, whose keep passes write the dropped slots after the forward kernel."""
    poison = torch.where(torch.isfinite(bias_E).all(), torch.zeros((), dtype=w_TK.dtype, device=w_TK.device),
                         torch.full((), float("nan"), dtype=w_TK.dtype, device=w_TK.device))
    return w_TK + poison


class _BalanceSumsFn(torch.autograd.Function):
    """Autograd wrapper of the balance-score sums: [B, E] fp32 from the logits."""

    @staticmethod
    def forward(ctx, logits_TE, mask_T, B: int, S: int, softmax: bool, sqrtsp: bool):
        T, E = logits_TE.shape
        dev = logits_TE.device
        block_e = next_power_of_2(E)
        bt = max(1, min(64, 4096 // block_e))
        ctx.cfg = (S, softmax, sqrtsp, bt, block_e)
        ctx.save_for_backward(logits_TE, mask_T)
        if B == 0 or T == 0:
            return torch.zeros(B, E, dtype=torch.float32, device=dev)
        nc = cdiv(S, bt)
        part = torch.empty(B, nc, E, dtype=torch.float32, device=dev)
        with device_ctx(logits_TE.device):
            _balance_sums_fwd_kernel[(B, nc)](
                logits_TE, mask_T if mask_T is not None else part, part, T, S, nc, logits_TE.stride(0),
                logits_TE.stride(1), E=E, SOFTMAX=softmax, SQRTSP=sqrtsp, HAS_MASK=mask_T is not None, BLOCK_T=bt,
                BLOCK_E=block_e, num_warps=4,
            )
        return part.sum(dim=1)  # fixed-order reduction of the chunks (no float atomics)

    @staticmethod
    @first_order("balance_score_sums (Triton)")
    def backward(ctx, g_BE):
        logits_TE, mask_T = ctx.saved_tensors
        S, softmax, sqrtsp, bt, block_e = ctx.cfg
        T, E = logits_TE.shape
        dl = torch.zeros(T, E, dtype=logits_TE.dtype, device=logits_TE.device)
        if T == 0 or g_BE is None or g_BE.shape[0] == 0:
            return dl, None, None, None, None, None
        g = g_BE.float().contiguous()
        with device_ctx(logits_TE.device):
            _balance_sums_bwd_kernel[(cdiv(T, bt),)](
                logits_TE, mask_T if mask_T is not None else g, g, dl, T, S, logits_TE.stride(0), logits_TE.stride(1),
                E=E, SOFTMAX=softmax, SQRTSP=sqrtsp, HAS_MASK=mask_T is not None, BLOCK_T=bt, BLOCK_E=block_e,
                num_warps=4,
            )
        return dl, None, None, None, None, None


def balance_score_sums(logits_TE: torch.Tensor, score_func: str, padding_mask: torch.Tensor | None = None,
                       sequence_length: int | None = None) -> torch.Tensor:
    """:func:`tritonmoe.reference.balance_score_sums` with the Triton kernels (fp16/bf16/fp32
    logits): fp32 [B, E], differentiable w.r.t. the logits; chunk sums added in a fixed order."""
    if logits_TE.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the balance-score kernel takes fp16/bf16/fp32 logits, got {logits_TE.dtype}")
    T, E = logits_TE.shape
    if next_power_of_2(E) > MAX_TILE_LANES:
        raise ValueError(f"num_experts={E} is above the kernel's {MAX_TILE_LANES} lanes; use backend='torch'")
    if sequence_length is None:
        B, S = 1, max(T, 1)
    else:
        B, S = T // sequence_length, sequence_length
    mask = padding_mask.to(torch.int8).contiguous() if padding_mask is not None else None
    return _BalanceSumsFn.apply(logits_TE, mask, B, S, score_func == "softmax", score_func == "sqrtsoftplus")
