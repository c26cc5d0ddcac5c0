"""FP8 experts on the expert-parallel path (issue 36): an EP layer with expert_dtype="fp8_e4m3"
on 2 gloo ranks equals the single-process FP8 layer (bitwise: outputs and input gradients; the
weight gradients within FP8 tolerance, see tests/_fp8_ep_cases.py), the dispatched activations
travel as e4m3 plus scales (bytes counted by a wrapper around the all-to-all), and held e4m3
experts split over the ranks."""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm

from _dist import run_group
import _fp8_ep_cases


def test_fp8_expert_parallel_matches_single_process():
    results, _ = run_group(2, _fp8_ep_cases.fp8_ep_table, deadline_s=240, pg_timeout_s=60)
    for r in results:
        assert r.status == "ok", r.value
        assert r.value == [], (r.rank, '\n'.join(r.value))


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
        import dataclasses
        with pytest.raises(ValueError, match="expert_dtype"):
            tm.experts.make_expert_path(dataclasses.replace(cfg, **kw), ep_group=object())
