"""FP8 experts on the expert-parallel path (issue 36). The distributed equality (an EP layer with
expert_dtype="fp8_e4m3" on 2 and 4 gloo ranks against the single-process FP8 layer, dispatch
bytes counted) runs inside tests/test_ep.py's groups (tests/_fp8_ep_cases.py); here the packing
of FP8 rows for the all-to-all and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tritonmoe as tm



def test_fp8_pack_rows_round_trip():
    x = torch.randn(5, 200) * 3
    q, s = tm.fp8.fp8_quantize(x)
    p = tm.fp8.pack_fp8_rows(q, s)
    assert p.dtype == torch.uint8 and tuple(p.shape) == (5, 200 + 4 * 2)  # half of bf16's 400 bytes, plus 8
    q2, s2 = tm.fp8.unpack_fp8_rows(p, 200)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError, match="uint8"):
        tm.fp8.unpack_fp8_rows(p.float(), 200)
    with pytest.raises(TypeError, match="e4m3"):
        tm.fp8.pack_fp8_rows(x, s)


def test_fp8_expert_parallel_refusals():
    cfg = tm.MoEConfig(16, 128, 4, 2, expert_dtype="fp8_e4m3")
    for kw in (dict(ep_capacity=4), dict(memory_strategy="keep")):
        with pytest.raises(ValueError, match="expert_dtype"):
            tm.experts.make_expert_path(dataclasses.replace(cfg, **kw), ep_group=object())


def test_packed_fp8_rows_relayout_on_triton():
    """The expert-major re-layout of received packed rows (uint8) on the Triton copy kernel
    equals the reference's (the dispatcher runs it on the packed FP8 rows)."""
    from tritonmoe.comm.partition import transpose_chunks_unchecked

    q, s = tm.fp8.fp8_quantize(torch.randn(10, 40))
    x = tm.fp8.pack_fp8_rows(q, s)
    counts = torch.tensor([[2, 1], [3, 4]])
    got = transpose_chunks_unchecked(x, counts, "triton")
    assert got.dtype == torch.uint8 and torch.equal(got, transpose_chunks_unchecked(x, counts, "torch"))
    assert not torch.equal(got, x)
