"""The warp-specialized Gluon grouped GEMM (``kernels/_gluon_grouped_gemm.py``) against the
reference, on a Hopper GPU (Gluon does not run under the interpreter; on CPU its proof is the
ahead-of-time compile, ``tests/test_aot_gluon.py``). Ragged segments, empty experts, a segment
shorter than a tile, rows past the last full tile, more work items than programs (the
persistent loop wraps), and K of several stage rounds."""

from __future__ import annotations

import pytest
import torch

from tritonmoe.kernels import _gluon_grouped_gemm as G
from tritonmoe.kernels import grouped_gemm as gg

pytestmark = pytest.mark.gpu


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts,K,N", [
    ([300, 0, 17, 129, 1, 0, 640, 3], 512, 768),  # ragged, empty experts, tails
    ([0, 0, 0, 5], 64, 256),                      # one short segment, one K step
    ([4096, 2048], 1024, 512),                    # more items than programs: the loop wraps
])
def test_warp_specialized_mm_equals_the_reference(counts, K, N, dtype):
    if G.usable(torch.empty(1, K, device="cuda", dtype=dtype), torch.empty(len(counts), K, N, device="cuda", dtype=dtype),
                torch.empty(1, N, device="cuda", dtype=dtype), K=K, BK=64) is not None:
        pytest.skip("not an sm_90 device with Gluon")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, R = len(counts), sum(counts)
    x = torch.randn(R, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / K**0.5
    offsets = _offsets(counts, dev)
    tm = gg.RowSpace(offsets, R, E).tile_map(128)
    out = torch.full((R, N), float("nan"), device=dev, dtype=dtype)
    G.mm(x, w, out, tm.tiles, tm.count, num_programs=min(8, tm.bound * 3))
    ref = torch.empty(R, N, device=dev, dtype=torch.float32)
    for e in range(E):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        ref[lo:hi] = x[lo:hi].float() @ w[e].float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
