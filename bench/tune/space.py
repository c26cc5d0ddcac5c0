"""What ``python -m bench tune`` sweeps: jobs (one kernel target at one shape bucket) and each
job's candidate configs.

A :class:`Job` is one table entry to fill: a config target of :mod:`tritonmoe.kernels.config`
(``gemm.swiglu``, ``decode.mm``, ``permute.gather``, ``route``...), the layer it comes from, the
dtype, and the bucket (rows per expert for the GEMMs, tokens for decode / permute / route, slots
for the permute metadata). Its ``exact`` key is what the kernel policy looks tables up by.

Operations (``--ops``) and the targets they fill:

=========  ==============================  =========================================
op         target                          shape (n, k as ``_gemm_config.select``)
=========  ==============================  =========================================
gemm1      gemm.swiglu / gemm.mm_act        n = F, k = D (GEMM1 + activation)
gemm2      gemm.mm                          n = D, k = F
dx         gemm.mm                          n = D, k = N1 (w1 transposed, dX GEMM)
dact       gemm.dact_swiglu / gemm.dact     n = F, k = D (dH with act' in the epilogue)
wgrad1     gemm.wgrad                       n = N1, k = D (x^T dH)
wgrad2     gemm.wgrad                       n = D, k = F (A^T dY)
decode1    decode.swiglu / decode.mm_act    the decode path's GEMM1 (T <= 64)
decode2    decode.mm                        its GEMM2 (split-K)
permute    permute.metadata, permute.scatter
unpermute  permute.gather
route      route                            forward kernel
=========  ==============================  =========================================

Candidate spaces are the variant (tile / persistent where the kind has one, and wide, the one
2*BN accumulator, for the SwiGLU GEMM1), BM/BN/BK, warps,
stages, GROUP_M and the persistent epilogue split for the GEMMs; BN/BK/warps/stages/SPLIT_K for
the decode GEMMs; the tile, warps and grid split for permute and the router. Each is pruned
by shared memory and accumulator registers, then ordered nearest-first to the heuristic config
and cut to ``max_candidates`` (the heuristic itself is always measured beside them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Iterable

import torch

from tritonmoe.kernels import config as CF
from tritonmoe.kernels import gemm_kinds as GC
from tritonmoe.kernels.permute import MetadataConfig, RowsConfig, rows_key
from tritonmoe.kernels.routing import RouteConfig, route_key

from ..presets import PRESETS, Preset

__all__ = ["OPS", "GEMM_BUCKETS", "TOKEN_BUCKETS", "DECODE_BUCKETS", "Job", "jobs_for", "candidates"]

OPS = ("gemm1", "gemm2", "dx", "dact", "wgrad1", "wgrad2", "decode1", "decode2", "permute", "unpermute", "route")
#: Rows-per-expert buckets of the GEMMs (vLLM's batch keys, from 16 up).
GEMM_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Token buckets of permute / unpermute / the router.
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 32768)
#: Token buckets of the decode path (T <= 64).
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Layer:
    """The shape fields of a MoE layer a job needs (a :class:`~bench.presets.Preset`'s)."""

    name: str
    E: int
    D: int
    F: int
    topk: int
    activation: str = "swiglu"
    n_groups: int = 1
    tokens: int = 16384  # the prefill size the layer is measured at (its buckets are tuned first)

    @property
    def glu(self) -> bool:
        return self.activation in ("swiglu", "swiglu_oai")

    @property
    def n1(self) -> int:
        return 2 * self.F if self.glu else self.F

    @classmethod
    def of(cls, p: Preset) -> "Layer":
        return cls(p.name, p.num_experts, p.d_model, p.d_ffn, p.top_k, p.activation, p.n_groups or 1,
                   max(p.tokens_gpu))


@dataclasses.dataclass(frozen=True)
class Job:
    """One table entry to measure: ``target`` at ``exact`` (as a tuple of pairs) and ``bucket``,
    for ``op`` of ``layer`` in ``dtype`` ("bf16", "fp16", "fp32")."""

    op: str
    target: str
    layer: Layer
    dtype: str
    bucket: int
    exact: tuple

    @property
    def group(self) -> str:
        return CF.bucket_key(dict(self.exact))

    @property
    def id(self) -> str:
        return f"{self.target}|{self.group}|{self.bucket}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DT[self.dtype]

    @property
    def kind(self) -> str:
        return self.target.split(".", 1)[1] if "." in self.target else self.target

    def gemm_nk(self) -> tuple[int, int]:
        """(n, k) of the GEMM as ``select`` takes them."""
        L = self.layer
        return {"gemm1": (L.F, L.D), "gemm2": (L.D, L.F), "dx": (L.D, L.n1), "dact": (L.F, L.D),
                "wgrad1": (L.n1, L.D), "wgrad2": (L.D, L.F), "decode1": (L.F, L.D), "decode2": (L.D, L.F)}[self.op]


def _targets(op: str, layer: Layer) -> list[str]:
    glu = layer.glu
    return {
        "gemm1": ["gemm.swiglu" if glu else "gemm.mm_act"], "gemm2": ["gemm.mm"], "dx": ["gemm.mm"],
        "dact": ["gemm.dact_swiglu" if glu else "gemm.dact"], "wgrad1": ["gemm.wgrad"], "wgrad2": ["gemm.wgrad"],
        "decode1": ["decode.swiglu" if glu else "decode.mm_act"], "decode2": ["decode.mm"],
        "permute": ["permute.metadata", "permute.scatter"], "unpermute": ["permute.gather"], "route": ["route"],
    }[op]


def _exact(op: str, target: str, layer: Layer, dtype: str, tf32: bool) -> dict:
    tdt = _DT[dtype]
    job = Job(op, target, layer, dtype, 0, ())
    if target.startswith("gemm."):
        n, k = job.gemm_nk()
        return GC.gemm_key(tdt, tf32, layer.E, n, k)
    if target.startswith("decode."):
        n, k = job.gemm_nk()
        return GC.decode_key(tdt, tf32, layer.E, n, k, layer.topk)
    if target == "permute.metadata":
        return {"E": layer.E}
    if target in ("permute.scatter", "permute.gather"):
        return rows_key(layer.topk, layer.D, tdt.itemsize)
    return route_key(layer.E, layer.n_groups)


def _buckets(op: str, layer: Layer, chosen: Iterable[int] | None) -> list[int]:
    if op.startswith("decode"):
        base = DECODE_BUCKETS
    elif op in ("permute", "unpermute", "route"):
        base = TOKEN_BUCKETS
    else:
        base = GEMM_BUCKETS
    return sorted(set(chosen)) if chosen else list(base)


def jobs_for(presets: Iterable[str | Layer], ops: Iterable[str], dtype: str = "bf16", *, tf32: bool = False,
             buckets: dict[str, list[int]] | None = None) -> list[Job]:
    """Jobs for each layer (preset names or :class:`Layer`) and op; ``buckets`` maps an op (or
    "gemm" / "decode" / "tokens" for a family) to its bucket list."""
    out = []
    buckets = buckets or {}
    for pre in presets:
        layer = pre if isinstance(pre, Layer) else Layer.of(PRESETS[pre])
        for op in ops:
            if op not in OPS:
                raise ValueError(f"unknown tune op {op!r}; use one of {OPS}")
            fam = "decode" if op.startswith("decode") else ("tokens" if op in ("permute", "unpermute", "route") else "gemm")
            chosen = buckets.get(op) or buckets.get(fam)
            for target in _targets(op, layer):
                exact = _exact(op, target, layer, dtype, tf32)
                for b in _buckets(op, layer, chosen):
                    bucket = b * layer.topk if target == "permute.metadata" else b  # metadata is keyed by slots
                    out.append(Job(op, target, layer, dtype, bucket, tuple(exact.items())))
    seen, uniq = set(), []
    for j in out:  # two ops may fill the same entry (e.g. gemm2 and dx of square layers)
        if j.id not in seen:
            seen.add(j.id)
            uniq.append(j)
    # The most useful entries first, so that a run cut off by its budget has them: every op at
    # the bucket nearest the layer's own size (prefill rows per expert, its token count, decode
    # at T = 1), then the buckets further away.
    order = {op: i for i, op in enumerate(OPS)}
    uniq.sort(key=lambda j: (_distance_to_primary(j), order[j.op]))
    return uniq


def _distance_to_primary(job: "Job") -> float:
    L = job.layer
    if job.op.startswith("decode"):
        primary = 1
    elif job.target == "permute.metadata":
        primary = L.tokens * L.topk
    elif job.op in ("permute", "unpermute", "route"):
        primary = L.tokens
    else:
        primary = max(1, L.tokens * L.topk // L.E)
    return abs(math.log2(max(job.bucket, 1)) - math.log2(primary))


# ---------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------

#: Shared memory the operand buffers of a GEMM candidate may take (sm90 has 227 KiB per block).
SMEM_BUDGET = 220 * 1024
#: fp32 accumulator registers per thread a candidate may need (of 255).
ACC_REGS = 128


def _p2(n: int, lo: int = 16) -> int:
    v = lo
    while v < n:
        v *= 2
    return v


def _gemm_space(job: Job, interpreter: bool) -> list:
    kind = job.kind
    elem = job.torch_dtype.itemsize
    dual = kind in ("swiglu", "dact_swiglu")
    n, k = job.gemm_nk()
    if interpreter:
        axes = dict(BM=(16, 32), BN=(16, 32), BK=(16, 32), GROUP_M=(1, 2), num_warps=(1,), num_stages=(1,))
    else:
        axes = dict(BM=(64, 128), BN=(64, 128) if dual else (64, 128, 256), BK=(32, 64) if elem == 4 else (32, 64, 128),
                    GROUP_M=(1, 8), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
        if job.bucket < 64:
            axes["BM"] = (16, 32, 64)
    variants = ("tile",)
    if kind in GC.PERSISTENT_KINDS and not interpreter:
        variants = ("tile", "persistent", "wide") if kind in GC.WIDE_KINDS else ("tile", "persistent")
    out = []
    for vals in itertools.product(*axes.values()):
        f = dict(zip(axes, vals))
        if not interpreter:
            acc = f["BM"] * f["BN"] * (2 if dual else 1) // (f["num_warps"] * 32)
            smem = f["num_stages"] * (f["BM"] * f["BK"] + (2 if dual else 1) * f["BK"] * f["BN"]) * elem
            if acc > ACC_REGS or smem > SMEM_BUDGET:
                continue
            if f["BN"] > _p2(n) or f["BK"] > _p2(k if kind != "wgrad" else job.bucket):
                continue
        for v in variants:
            splits = (0,) if v == "tile" else ((1, 2) if f["BN"] >= 128 or v == "wide" else (1,))
            for s in splits:
                out.append(GC.TileConfig(**f, variant=v, EPI_SPLIT=s))
    return out


def _decode_space(job: Job, interpreter: bool) -> list:
    bm = max(16, _p2(min(job.bucket, 64)))
    if interpreter:
        axes = dict(BN=(16, 32), BK=(16,), num_warps=(1,), num_stages=(1,), SPLIT_K=(1, 2) if job.kind == "mm" else (1,))
    else:
        axes = dict(BN=(32, 64, 128), BK=(64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4),
                    SPLIT_K=(1, 2, 4, 8) if job.kind == "mm" else (1,))
    elem = job.torch_dtype.itemsize
    dual = job.kind == "swiglu"
    out = []
    for vals in itertools.product(*axes.values()):
        f = dict(zip(axes, vals))
        if not interpreter and f["num_stages"] * (bm * f["BK"] + (2 if dual else 1) * f["BK"] * f["BN"]) * elem > SMEM_BUDGET:
            continue
        out.append(GC.TileConfig(BM=bm, GROUP_M=1, **f))
    return out


def _permute_space(job: Job, interpreter: bool) -> list:
    L = job.layer
    e_pow2 = _p2(L.E, 1)
    if job.target == "permute.metadata":
        bs = (16, 64) if interpreter else (128, 256, 512)
        be = tuple(b for b in ((16, 32) if interpreter else (16, 32, 64)) if b <= max(16, e_pow2))
        warps = (1, 4) if interpreter else (4, 8)
        return [MetadataConfig(fused, s, e, 16, w) for fused, s, e, w in itertools.product((True, False), bs, be, warps)]
    d_pow2 = _p2(L.D, 1)
    bds = tuple(b for b in ((16, 32) if interpreter else (256, 512, 1024, 2048, 4096)) if b <= max(16, d_pow2))
    return [RowsConfig(bd, ns, w) for bd, ns, w in itertools.product(bds, (1, 2, 4), (1, 2, 4) if interpreter else (1, 2, 4, 8))]


def _route_space(job: Job, interpreter: bool) -> list:
    L = job.layer
    lanes = _p2(L.n_groups, 1) * _p2(L.E // L.n_groups, 1)
    out = []
    for bt in (1, 2, 4, 8, 16, 32, 64):
        if bt * lanes > (4096 if interpreter else 16384):
            continue
        for w in ((4,) if interpreter else (4, 8, 16)):
            out.append(RouteConfig(block_t=bt, num_warps=w, bwd_block_t=bt, bwd_num_warps=w,
                                   **({"scan_split_slots": False, "scan_block_r": 256} if interpreter else {})))
    return out


def _distance(a, b) -> int:
    fa, fb = CF.config_dict(a), CF.config_dict(b)
    return sum(fa[k] != fb.get(k) for k in fa)


def candidates(job: Job, heuristic, *, interpreter: bool, max_candidates: int, seed: int = 0) -> list:
    """The heuristic config first, then up to ``max_candidates - 1`` others, nearest to it first
    (fewest differing fields; ties in a seeded random order)."""
    if job.target.startswith("gemm."):
        space = _gemm_space(job, interpreter)
    elif job.target.startswith("decode."):
        space = _decode_space(job, interpreter)
    elif job.target.startswith("permute."):
        space = _permute_space(job, interpreter)
    else:
        space = _route_space(job, interpreter)
    rng = random.Random(f"{seed}|{job.id}")
    keyed = [(_distance(c, heuristic), rng.random(), c) for c in space if c != heuristic]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [heuristic] + [c for _, _, c in keyed[: max(0, max_candidates - 1)]]
