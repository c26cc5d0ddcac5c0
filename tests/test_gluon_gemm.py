"""The warp-specialized Gluon grouped GEMM (``kernels/_gluon_grouped_gemm.py``, variant
``"warpspec"``).

On a Hopper GPU: the kernel against the reference (ragged segments, empty experts, a segment
shorter than a tile, rows past the last full tile, more work items than programs so the
persistent loop wraps, K of several stage rounds), directly and through ``grouped_gemm`` with the
variant selected (counting that the Gluon launch ran). Gluon does not run under the
interpreter; on CPU its proof is the ahead-of-time compile (``tests/test_aot_gluon.py``), and
these tests check the variant's selection and its fallback: where the kernel cannot serve a
launch (here: no sm_90 device) the persistent kernel runs it, with the same result."""

from __future__ import annotations

import pytest
import torch

from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import _gluon_grouped_gemm as G
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import grouped_gemm as gg

CASES = [
    ([300, 0, 17, 129, 1, 0, 640, 3], 512, 768),  # ragged, empty experts, tails
    ([0, 0, 0, 5], 64, 256),                      # one short segment, one K step
    ([4096, 2048], 1024, 512),                    # more items than programs: the loop wraps
]


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _reference(x, w, offsets):
    ref = torch.zeros(x.shape[0], w.shape[2], device=x.device, dtype=torch.float32)
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        ref[lo:hi] = x[lo:hi].float() @ w[e].float()
    return ref


def test_warpspec_is_a_variant_of_the_mm_kind_only():
    cfg = C.TileConfig(128, 256, 64, num_warps=8, variant="warpspec")
    sel = dict(rows=4096, n=512, k=256, num_experts=8, dtype=torch.float16, tf32=False, device=torch.device("cpu"))
    with CF.override("gemm", cfg):
        assert C.select("mm", **sel).variant == "warpspec"
        assert C.select("swiglu", **sel).variant == "persistent"  # no warp-specialized SwiGLU: the persistent one
        assert C.select("wgrad", **sel).variant == "tile"


def test_warpspec_falls_back_to_the_persistent_kernel_where_it_cannot_run(monkeypatch):
    """No sm_90 device (the interpreter): ``usable`` says why, and the launch goes to the
    persistent kernel, whose result equals the reference."""
    calls = []
    monkeypatch.setattr(G, "mm", lambda *a, **k: calls.append(1))
    counts, K, N = [5, 0, 19, 3], 32, 48
    x = torch.randn(sum(counts), K, dtype=torch.float16)
    w = torch.randn(len(counts), K, N, dtype=torch.float16) / K**0.5
    offsets = _offsets(counts, "cpu")
    assert G.usable(x, w, x.new_empty(1, N), K=K, BK=16) is not None
    with CF.override("gemm.mm", C.TileConfig(16, 16, 16, variant="warpspec")):
        out = gg.grouped_gemm(x, offsets, w)
    assert calls == []
    torch.testing.assert_close(out.float(), _reference(x, w, offsets), rtol=2e-3, atol=2e-3)


def _gpu_or_skip(K, N, E, dtype):
    dev = torch.device("cuda")
    why = G.usable(torch.empty(1, K, device=dev, dtype=dtype), torch.empty(E, K, N, device=dev, dtype=dtype),
                   torch.empty(1, N, device=dev, dtype=dtype), K=K, BK=64)
    if why is not None:
        pytest.skip(why)
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts,K,N", CASES)
def test_warp_specialized_mm_equals_the_reference(counts, K, N, dtype):
    dev = _gpu_or_skip(K, N, len(counts), dtype)
    torch.manual_seed(0)
    E, R = len(counts), sum(counts)
    x = torch.randn(R, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / K**0.5
    offsets = _offsets(counts, dev)
    tm = gg.RowSpace(offsets, R, E).tile_map(128)
    out = torch.full((R, N), float("nan"), device=dev, dtype=dtype)
    G.mm(x, w, out, tm.tiles, tm.count, num_programs=min(8, tm.bound * 3))
    torch.testing.assert_close(out.float(), _reference(x, w, offsets), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_grouped_gemm_runs_the_warp_specialized_kernel_when_selected(monkeypatch):
    counts, K, N = [300, 0, 17, 129, 1, 0, 640, 3], 512, 768
    dev = _gpu_or_skip(K, N, len(counts), torch.bfloat16)
    ran = []
    real = G.mm
    monkeypatch.setattr(G, "mm", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
    torch.manual_seed(1)
    x = torch.randn(sum(counts), K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(counts), K, N, device=dev, dtype=torch.bfloat16) / K**0.5
    offsets = _offsets(counts, dev)
    with CF.override("gemm.mm", C.TileConfig(128, 256, 64, num_warps=8, variant="warpspec")):
        out = gg.grouped_gemm(x, offsets, w)
    assert ran == [1]
    torch.testing.assert_close(out.float(), _reference(x, w, offsets), rtol=1e-2, atol=1e-2)
