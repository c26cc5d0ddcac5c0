"""The fused FP8 training epilogues (kernels/fp8_train.py, issue 36) against the plain-PyTorch
reference in Triton's interpreter:

* GEMM1 of training (one launch): the fp32 pre-activation H it stores equals deq(x) @ deq(W1)
  to fp32 summation order, and the e4m3 A it quantizes in the epilogue is SwiGLU(H) to one
  e4m3 rounding;
* dA's epilogue (``DSWIGLU``): the fp32 dH it stores equals swiglu'(H) * (deq(dY) @ deq(W2)^T)
  to fp32 rounding, and its e4m3 dH and scales are **bit for bit** the reference quantization
  (1x128, gate and up blocked separately) of that fp32 dH;
* zero rows (experts without rows, rows past offsets[E]) give zeros and scale 1.

Shapes: d not a multiple of 128 (a partial K block in both GEMMs), experts with 0 rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonmoe import fp8_reference as R
from tritonmoe.kernels import fp8_train as FT
from tritonmoe.kernels.grouped_gemm import RowSpace

FMT = "e4m3_block128"
RTOL = 1e-5  # fp32 summation order: 1e-5 * (|a| @ |w|) per element


def _case(seed: int, counts: list[int], D: int, F: int = 128, tail: int = 3):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    R_ = sum(counts) + tail
    offs = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(R_, D, generator=g)
    dy = torch.randn(R_, D, generator=g)
    w1 = torch.randn(E, D, 2 * F, generator=g) / 8
    w2 = torch.randn(E, F, D, generator=g) / 8
    q1, s1 = FT._quantize_weight(w1.transpose(1, 2))
    q2, s2 = FT._quantize_weight(w2.transpose(1, 2))
    return x, dy, offs, (q1, s1, q2, s2), RowSpace(offs, R_, E)


def _seg_mm(a, w_ENK, offs, R_):
    """Per segment a @ w[e]^T in fp32 (other rows zero)."""
    out = torch.zeros(R_, w_ENK.shape[1])
    for e in range(w_ENK.shape[0]):
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w_ENK[e].t()
    return out


def _check(seed, counts, D):
    x, dy, offs, (q1, s1, q2, s2), space = _case(seed, counts, D)
    R_, F = x.shape[0], q2.shape[2]
    end = int(offs[-1])
    # forward: H and the quantized A of one launch
    x_q, x_s = R.quantize_rows(x, FMT)
    h, a_q, a_s = FT._gemm1_train(x_q, x_s, space, q1, s1)
    xd = R.dequantize_rows(x_q, x_s, FMT)
    w1d = R.dequantize_gate_up(q1, s1, FMT)  # [E, 2F, D]
    want_h = _seg_mm(xd, w1d, offs, R_)
    bound = _seg_mm(xd.abs(), w1d.abs(), offs, R_)
    assert ((h - want_h).abs() <= RTOL * bound + 1e-30).all()
    a = R._swiglu(h)
    a_deq = R.dequantize_rows(a_q, a_s, FMT)
    # one e4m3 rounding of each 1x128 group (relative step 2^-3 of the group's scale * 448)
    assert ((a_deq - a).abs() <= a_s.repeat_interleave(128, 1)[:, :F] * 448 * 2.0 ** -4 + 1e-30).all()
    assert (h[end:] == 0).all() and (a_q[end:].float() == 0).all() and (a_s[end:] == 1).all()
    # backward: dA's epilogue -> dH fp32 and dH e4m3
    dy_q, dy_s = R.quantize_rows(dy, FMT)
    q2t, s2t = q2.transpose(1, 2).contiguous(), s2.transpose(1, 2)
    dh, dh_q, dh_s = FT._dgrad_swiglu(dy_q, dy_s, space, q2t, s2t, h)
    dyd = R.dequantize_rows(dy_q, dy_s, FMT)
    w2d = R.dequantize_weight(q2, s2, FMT)  # [E, D, F]
    da = _seg_mm(dyd, w2d.transpose(1, 2), offs, R_)
    da_bound = _seg_mm(dyd.abs(), w2d.abs().transpose(1, 2), offs, R_)
    want_dh = R.swiglu_backward(h, da)
    # |d dH| <= |swiglu'(H)| * |d dA| (+ fp32 rounding of the product, relative 1e-6)
    dprime = R.swiglu_backward(h, torch.ones_like(da)).abs()
    tol = dprime * RTOL * torch.cat([da_bound, da_bound], 1) + 1e-6 * want_dh.abs() + 1e-30
    assert ((dh - want_dh).abs() <= tol).all(), (dh - want_dh).abs().max()
    ref_q, ref_s = R.quantize_rows(torch.cat([dh[:, :F], dh[:, F:]], 1), FMT)  # F % 128 == 0: groups align
    assert torch.equal(dh_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(dh_s, ref_s)
    assert (dh[end:] == 0).all() and (dh_s[end:] == 1).all()
    for e in range(len(counts)):  # a wrong expert's weights would be far outside the tolerance
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi > lo and len(counts) > 1:
            other = (e + 1) % len(counts)
            wrong = xd[lo:hi] @ w1d[other].t()
            assert not ((h[lo:hi] - wrong).abs() <= RTOL * bound[lo:hi] + 1e-30).all()


def test_fused_training_epilogues_named_case():
    _check(0, [5, 0, 9], D=136)  # an empty expert, K = 136: a partial scale block


@settings(max_examples=3)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.integers(0, 12), min_size=1, max_size=3),
       D=st.sampled_from([40, 128, 160]))
def test_fused_training_epilogues_property(seed, counts, D):
    _check(seed, counts, D)


def test_fp8_tuned_table_hook():
    """select_fp8 reads the tuned table (targets fp8.swiglu / fp8.mm, key fp8_key, nearest
    rows-per-expert bucket) before the policy; an override still wins; the choice is recorded."""
    from tritonmoe.kernels import config as CF
    from tritonmoe.kernels._fp8_config import fp8_key, select_fp8

    dev = torch.device("cpu")
    key = CF.bucket_key(fp8_key(False, 8, 256, 384))
    doc = {"entries": {"fp8.mm": {key: {
        "64": {"config": {"BM": 32, "BN": 64, "BK": 64, "GROUP_M": 4, "num_warps": 2, "num_stages": 2}},
        "512": {"config": {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}}}}}}
    tbl = CF.Table(doc)
    kw = dict(n=256, k=384, num_experts=8, rowwise=False, device=dev)
    base = select_fp8("fp8_mm", rows=8 * 100, **kw)
    with CF.override("table", tbl), CF.recording() as ran:
        near64 = select_fp8("fp8_mm", rows=8 * 100, **kw)  # 100 rows per expert: bucket 64
        near512 = select_fp8("fp8_mm", rows=8 * 1000, **kw)
        other = select_fp8("fp8_mm", rows=8 * 100, **{**kw, "rowwise": True})  # no entry: the policy
        with CF.override("fp8.mm", BM=16):
            forced = select_fp8("fp8_mm", rows=8 * 1000, **kw)
    assert (near64.BM, near64.BN, near64.BK, near64.num_warps) == (32, 64, 64, 2) != (base.BM, base.BN, base.BK,
                                                                                      base.num_warps)
    assert (near512.BM, near512.BK, near512.num_stages) == (64, 128, 3)
    assert other == select_fp8("fp8_mm", rows=8 * 100, **{**kw, "rowwise": True})
    assert forced.BM == 16
    assert [r.source for r in ran] == ["table", "table", "heuristic", "override"]
