"""Per-rank body of the FP8 expert-parallel checks (run inside tests/test_ep.py's spawned gloo
groups by ``_ep_cases.layer_table``: a spawn costs 5-15 s on the shared machine, the checks 0.5 s).

Every rank builds every rank's batch and the full weights from the same seeds, runs its
expert-parallel FP8 layer and the single-process FP8 layer (all E experts) on each rank's batch,
and reports what differs. The all-to-alls are counted by a wrapper around
``torch.distributed.all_to_all_single`` (bytes of every input buffer, by dtype)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.layer import hold_fp8_experts

D, F, E, K = 96, 128, 4, 2  # d_model not a multiple of 128: a partial scale block on GEMM1's K
G = 1  # cdiv(96, 128) activation scale groups per row
# per rank, per case: ranks with no tokens; ragged batches
TOKENS = {2: [(7, 0), (5, 11)], 4: [(7, 0, 3, 0), (5, 11, 0, 2)]}


class _Count:
    def __init__(self):
        self.calls: list[tuple[torch.dtype, int]] = []
        self._real = dist.all_to_all_single

    def __call__(self, out, inp, *args, **kwargs):
        self.calls.append((inp.dtype, inp.numel() * inp.element_size()))
        return self._real(out, inp, *args, **kwargs)

    def bytes(self, dtype=None) -> int:
        return sum(b for d, b in self.calls if dtype is None or d == dtype)


def _batch(rank: int, T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(100 * seed + rank))


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Bitwise in the one-micro-op case (only rank 0's tokens reach the experts of 2 ranks, or
    the ranks' rows meet no other's: the expert GEMMs see the single process's rows); otherwise
    the reference's fp32 matmuls run over other row counts, which may round a last bit
    differently (CPU BLAS blocks by M): within fp32 rounding of the output's scale."""
    a, b = a.detach(), b.detach()
    if exact:
        return torch.equal(a, b)
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(((a - b).abs() <= 1e-6 * scale + 1e-5 * b.abs()).all())


def _recv_rows(ref, P: int, rank: int, case: int) -> int:
    """The slots of every rank's batch routed to this rank's experts (its combine's rows)."""
    L, n = E // P, 0
    with torch.no_grad():
        for r in range(P):
            ids = ref.route(_batch(r, TOKENS[P][case][r], case))[1].topk_ids
            n += int(((ids >= rank * L) & (ids < (rank + 1) * L)).sum())
    return n


def _layers(P: int, rank: int, cfg: tm.MoEConfig, degree: int):
    torch.manual_seed(0)
    ref = tm.MoELayer(cfg)
    ep = tm.MoELayer(dataclasses.replace(cfg, pipeline_degree=degree), ep_group=dist.group.WORLD)
    L = E // P
    with torch.no_grad():
        ep.router.weight.copy_(ref.router.weight)
        ep.w1.copy_(ref.w1[rank * L:(rank + 1) * L])
        ep.w2.copy_(ref.w2[rank * L:(rank + 1) * L])
    return ref, ep


def fp8_ep_table(rank: int, P: int) -> list[str]:
    bad: list[str] = []
    L = E // P
    mine = slice(rank * L, (rank + 1) * L)
    cfg = tm.MoEConfig(D, F, E, K, expert_dtype="fp8_e4m3", backend="torch")
    counter = _Count()
    dist.all_to_all_single = counter
    try:
        for case, tokens in enumerate(TOKENS[P]):
            degree = 1 + case  # 1, then 2 micro-ops
            T = tokens[rank]
            exact = degree == 1 and P == 2  # rank 0's rows alone reach the experts: the reference's order
            for recipe in ("block128", "rowwise"):
                c = dataclasses.replace(cfg, fp8_recipe=recipe)
                ref, ep = _layers(P, rank, c, degree)
                x = _batch(rank, T, case)
                counter.calls.clear()
                with torch.no_grad():
                    got, want = ep(x), ref(x)
                if not _same(got, want, exact=exact):
                    bad.append(f"case {case} {recipe} inference: max diff {(got - want).abs().max().item()}")
                g = 1 if recipe == "rowwise" else G
                # dispatch in e4m3 + scales, packed (uint8), combine in fp32; T*K slots, no drops
                recv = _recv_rows(ref, P, rank, case)
                want_bytes = {torch.uint8: T * K * (D + 4 * g), torch.float32: recv * D * 4}
                have = {dt: counter.bytes(dt) for dt in (torch.uint8, torch.float32)}
                if have != want_bytes:
                    bad.append(f"case {case} {recipe}: all-to-all bytes {have}, expected {want_bytes}")
            # the 16-bit layer's dispatch, for the byte ratio: T*K rows of D fp32 values each way
            ref16, ep16 = _layers(P, rank, dataclasses.replace(cfg, expert_dtype=None), degree)
            counter.calls.clear()
            with torch.no_grad():
                ep16(x)
            if counter.bytes(torch.float32) != (T * K + recv) * D * 4 or counter.bytes(torch.uint8):
                bad.append(f"case {case}: 16-bit all-to-all bytes {counter.calls}")

            # held e4m3 experts (an FP8 checkpoint's): each rank keeps its slice of all E
            ref, ep = _layers(P, rank, cfg, degree)
            experts = tm.quantize_experts(ref.w1.detach(), ref.w2.detach())
            hold_fp8_experts(ref, experts)
            hold_fp8_experts(ep, experts)
            if not torch.equal(ep.fp8_experts.w1.view(torch.uint8), experts.w1[mine].view(torch.uint8)):
                bad.append(f"case {case}: held experts are not this rank's slice")
            with torch.no_grad():
                if not _same(ep(x), ref(x), exact=exact):
                    bad.append(f"case {case}: held experts differ")

            # training: forward and dX per row (1x128 groups) -> bitwise; dW quantizes its
            # operands in 128-row blocks of the buffer the GEMM sees (rows of other ranks and
            # micro-ops there): within the FP8 tolerance of the single-process gradient
            ref, ep = _layers(P, rank, cfg, degree)
            xs = [_batch(r, TOKENS[P][case][r], case) for r in range(P)]
            gys = [torch.randn(t.shape, generator=torch.Generator().manual_seed(7 + r)) for r, t in enumerate(xs)]
            xe = xs[rank].clone().requires_grad_()
            ye = ep(xe)
            (ye * gys[rank]).sum().backward()
            xr = [t.clone().requires_grad_() for t in xs]
            yr = [ref(t) for t in xr]
            sum((y * gy).sum() for y, gy in zip(yr, gys)).backward()
            if ep.ffn_path_used != "expert_parallel" or ref.ffn_path_used != "fp8_train":
                bad.append(f"paths {ep.ffn_path_used} {ref.ffn_path_used}")
            if not _same(ye, yr[rank], exact=exact):
                bad.append(f"case {case} train: output max diff {(ye - yr[rank]).abs().max().item()}")
            if not _same(xe.grad, xr[rank].grad, exact=exact):
                bad.append(f"case {case} train: dX max diff {(xe.grad - xr[rank].grad).abs().max().item()}")
            for name in ("w1", "w2"):
                ge, gr = getattr(ep, name).grad, getattr(ref, name).grad[mine]
                rel = float((ge - gr).norm() / gr.norm().clamp_min(1e-30))
                other = getattr(ref, name).grad[[(e + L) % E for e in range(mine.start, mine.stop)]]
                wrong = float((ge - other).norm() / other.norm().clamp_min(1e-30))
                if not (rel < 0.08 and wrong > 0.5):  # a neighbouring expert's gradient is far off
                    bad.append(f"case {case} train: d{name} relative error {rel} (other experts' {wrong})")
    finally:
        dist.all_to_all_single = counter._real
    return bad
