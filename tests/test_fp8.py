"""FP8 (e4m3) experts: the reference formats, quantize_experts, the FP8 checkpoint loader, and the
Triton kernels (kernels/fp8_gemm.py) against tritonmoe.fp8_reference.

On CPU the kernels run in Triton's interpreter (e4m3 tl.dot works there; outputs fp32 / fp16).

What is exact and what is not:
* quantization (alone and fused into the permute) equals the reference bit for bit, including
  rounding ties, subnormals and the 448 clamp (the kernels round in fp32 before the cast);
* GEMMs equal the reference to fp32 summation order: the kernel sums a fp32 partial per K step
  times its scales, the reference multiplies dequantized fp32 matrices. The tolerance is
  ``1e-5 * (|deq a| @ |deq w|)`` per element (``GEMM_RTOL``: looser on a GPU, whose FP8 tensor
  cores sum each K step in reduced precision), and the scales vary per 128-block by powers of two
  up to 2^12, so reading a neighbouring block's scale is an error of at least ~2x.
  ``test_tolerance_catches_a_wrong_scale_block`` checks that the tolerance rejects it.
* Poisoning: scale tensors are strided views into buffers whose other entries are NaN, so a
  wrong scale stride or index reads NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import fp8_reference as R
from tritonmoe import reference as ref
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import fp8_gemm as K8
from tritonmoe.types import Routing

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
FP8 = torch.float8_e4m3fn
BLOCK = "e4m3_block128"
ROW = "e4m3_rowwise"
#: GEMM tolerance relative to |a| @ |w|: fp32 summation order in the interpreter; on sm90 the
#: FP8 tensor cores add each K step's <= 128 products with ~14 mantissa bits before the fp32
#: promotion (DeepSeek-V3's report), so a few 2**-14 of the bound (not measured: no GPU yet).
GEMM_RTOL = 2e-3 if HAS_CUDA else 1e-5
#: FFN / moe_ffn tolerance relative to the row maximum: the activation is requantized between the
#: GEMMs, so a rounding difference can move one e4m3 step in a rare element (more often on GPU).
FFN_RTOL = 1e-2 if HAS_CUDA else 1e-3


def _routing(ids: torch.Tensor, weights: torch.Tensor, E: int) -> Routing:
    ok = (ids >= 0) & (ids < E)
    counts = torch.stack([((ids == e) & ok).sum() for e in range(E)]).to(torch.int32) if E else torch.zeros(0)
    return Routing(topk_weights=weights, topk_ids=ids.to(torch.int32), counts=counts, selected_counts=counts)


def _group_scaled(shape, g: torch.Generator, spread: int = 12) -> torch.Tensor:
    """Random values whose 128-column groups (and 128-row groups) differ by powers of two up to
    2**spread, so that per-block scales differ a lot."""
    x = torch.randn(*shape, generator=g)
    cols = -(-shape[-1] // 128)
    ex = torch.randint(-spread // 2, spread // 2 + 1, (cols,), generator=g).float()
    x = x * torch.exp2(ex).repeat_interleave(128)[: shape[-1]]
    if len(shape) >= 2:
        rows = -(-shape[-2] // 128)
        ex = torch.randint(-spread // 2, spread // 2 + 1, (rows,), generator=g).float()
        x = x * torch.exp2(ex).repeat_interleave(128)[: shape[-2], None]
    return x


def _poison_view(s: torch.Tensor) -> torch.Tensor:
    """``s`` as a view with a NaN gap after every element of its last dim and each row (a wrong
    stride or index reads NaN)."""
    buf = torch.full((*s.shape[:-1], 2 * s.shape[-1] + 1), float("nan"), dtype=s.dtype, device=s.device)
    view = buf[..., 1::2]
    view.copy_(s)
    return view


def _poison_experts(ex: R.FP8Experts) -> R.FP8Experts:
    return R.FP8Experts(ex.w1, _poison_view(ex.w1_scale), ex.w2, _poison_view(ex.w2_scale), ex.format)


def _bound(a_abs: torch.Tensor, w_abs_EKN: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """|a| @ |w| per segment (the scale of the fp32 summation error)."""
    out = torch.zeros(a_abs.shape[0], w_abs_EKN.shape[2], dtype=torch.float64)
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        out[lo:hi] = a_abs[lo:hi].double() @ w_abs_EKN[e].double()
    return out


def _close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, rtol: float = GEMM_RTOL) -> bool:
    err = (got.double().cpu() - want.double().cpu()).abs()
    return bool(torch.isfinite(got).all()) and bool((err <= rtol * bound + 1e-30).all())


# ---------------------------------------------------------------------------------------------
# Formats (reference)
# ---------------------------------------------------------------------------------------------


def test_block_quantization_by_hand():
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 1], x[0, 129] = 448.0 * 3, -3.0, 1.0
    q, s = R.quantize_rows(x, BLOCK)
    assert s.tolist() == [[3.0, torch.tensor(1.0 / 448).item()], [1.0, 1.0]]  # all-zero groups get scale 1
    assert q[0, :2].float().tolist() == [448.0, -1.0] and q[0, 129].float().item() == 448.0
    assert q[1].float().abs().sum() == 0
    q, s = R.quantize_rows(x, ROW)
    assert s.tolist() == [[3.0], [1.0]]
    assert q[0, 129].float() == (torch.tensor(1.0) / 3).to(FP8).float()


def test_weight_block_scales_by_hand():
    g = torch.Generator().manual_seed(1)
    w = _group_scaled((2, 300, 200), g)
    q, s = R.quantize_weight(w, BLOCK)
    assert s.shape == (2, 3, 2)
    for e in range(2):
        for i in range(3):
            for j in range(2):
                blk = w[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                sc = blk.abs().max() / 448
                assert s[e, i, j] == sc
                got = q[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
                assert torch.equal(got, (blk / sc).to(FP8).float())
    q, s = R.quantize_weight(w, ROW)
    assert torch.equal(s, w.abs().amax(-1) / 448)


@given(M=st.integers(0, 5), K=st.integers(1, 300), fmt=st.sampled_from(R.FORMATS), seed=st.integers(0, 2**16))
@settings(max_examples=25)
def test_quantize_roundtrip_error(M, K, fmt, seed):
    """|deq(q) - x| <= half an e4m3 step at the value's binade times the scale (<= 16 s at the
    top binade; 2**-10 s for subnormals) and the scales are amax / 448."""
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((M, K), g)
    q, s = R.quantize_rows(x, fmt)
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32
    assert s.shape == (M, -(-K // 128) if fmt == BLOCK else 1)
    d = R.dequantize_rows(q, s, fmt)
    full = s.repeat_interleave(128, 1)[:, :K] if fmt == BLOCK else s.expand(M, K)
    step = torch.exp2(torch.floor(torch.log2((x / full).abs().clamp_min(2.0**-6)))) * 2.0**-3
    assert ((d - x).abs() <= 0.5 * step * full * (1 + 1e-6)).all()


def test_quantize_experts_layout_and_errors():
    g = torch.Generator().manual_seed(2)
    E, D, F = 3, 200, 136  # F not a multiple of 128: gate and up are blocked separately
    w1, w2 = _group_scaled((E, D, 2 * F), g), _group_scaled((E, F, D), g)
    ex = tm.quantize_experts(w1, w2, format=BLOCK)
    assert ex.w1.shape == (E, 2 * F, D) and ex.w1_scale.shape == (E, 4, 2)
    assert ex.w2.shape == (E, D, F) and ex.w2_scale.shape == (E, 2, 2)
    qg, sg = R.quantize_weight(w1[:, :, :F].transpose(1, 2), BLOCK)
    qu, su = R.quantize_weight(w1[:, :, F:].transpose(1, 2), BLOCK)
    assert torch.equal(ex.w1[:, F:].float(), qu.float()) and torch.equal(ex.w1_scale[:, 2:], su)
    assert torch.equal(ex.w1[:, :F].float(), qg.float()) and torch.equal(ex.w1_scale[:, :2], sg)
    d1, d2 = ex.dequantize()
    assert d1.shape == w1.shape and d2.shape == w2.shape
    assert ((d1 - w1).abs() <= 0.07 * w1.abs() + 1e-3 * w1.abs().amax()).float().mean() > 0.99
    exr = tm.quantize_experts(w1, w2, format=ROW)
    assert exr.w1_scale.shape == (E, 2 * F) and exr.w2_scale.shape == (E, D)
    with pytest.raises(ValueError, match="not an FP8 format"):
        tm.quantize_experts(w1, w2, format="e5m2")
    with pytest.raises(ValueError, match="SwiGLU"):
        tm.quantize_experts(w1[:, :, :F], w2)
    with pytest.raises(TypeError):
        tm.quantize_experts(w1.int(), w2)
    bad = w1.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        tm.quantize_experts(bad, w2)


# ---------------------------------------------------------------------------------------------
# Checkpoint loader
# ---------------------------------------------------------------------------------------------


def _fp8_state_dict(w1, w2, fmt, prefix="model.layers.1.mlp.experts."):
    """An HF-style FP8 state dict (DeepSeek-V3 layout) of SwiGLU experts w1 [E, D, 2F], w2 [E, F, D]."""
    F = w2.shape[1]
    sd = {}
    for j in range(w1.shape[0]):
        for proj, w in (("gate_proj", w1[j, :, :F].T), ("up_proj", w1[j, :, F:].T), ("down_proj", w2[j].T)):
            q, s = R.quantize_weight(w, fmt)
            sd[f"{prefix}{j}.{proj}.weight"] = q
            if fmt == BLOCK:
                sd[f"{prefix}{j}.{proj}.weight_scale_inv"] = s
            else:
                sd[f"{prefix}{j}.{proj}.weight_scale"] = s[:, None]
    sd["model.layers.1.mlp.gate.weight"] = torch.zeros(1)  # other keys are ignored
    return sd


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_loader_keeps_fp8_and_matches_quantize_experts(fmt):
    g = torch.Generator().manual_seed(3)
    E, D, F = 3, 160, 200
    w1, w2 = _group_scaled((E, D, 2 * F), g, 4), _group_scaled((E, F, D), g, 4)
    sd = _fp8_state_dict(w1, w2, fmt)
    ex = tm.load_fp8_experts(sd, "model.layers.1.mlp.experts.", E)
    want = tm.quantize_experts(w1, w2, format=fmt)
    assert ex.format == fmt and ex.w1.dtype == FP8 and ex.w2.dtype == FP8
    for name in ("w1", "w1_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(ex, name).float(), getattr(want, name).float()), name
    # the loaded block runs without dequantizing, within the FP8 tolerance of the dequantized model
    x = torch.randn(9, D, generator=g)
    ids = torch.randint(0, E, (9, 2), generator=g)
    routing = _routing(ids, torch.rand(9, 2, generator=g), E)
    out = tm.fp8_moe_ffn(x, routing, ex, backend="torch")
    d1, d2 = ex.dequantize()
    dense = ref.moe_ffn(x, routing, d1, d2, "swiglu")
    rel = (out - dense).norm() / dense.norm()
    assert rel < 0.08, rel  # activation quantization error (two e4m3 roundings)


def test_loader_errors():
    g = torch.Generator().manual_seed(4)
    w1, w2 = torch.randn(2, 128, 256, generator=g), torch.randn(2, 128, 128, generator=g)
    sd = _fp8_state_dict(w1, w2, BLOCK, prefix="p.")
    with pytest.raises(ValueError, match="p.2.gate_proj.weight"):
        tm.load_fp8_experts(sd, "p.", 3)
    bad = dict(sd)
    bad["p.1.up_proj.weight"] = bad["p.1.up_proj.weight"].float()
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        tm.load_fp8_experts(bad, "p.", 2)
    bad = dict(sd)
    bad["p.0.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(ValueError, match="scale has shape"):
        tm.load_fp8_experts(bad, "p.", 2)
    bad = dict(sd)
    del bad["p.1.down_proj.weight_scale_inv"]
    bad["p.1.down_proj.weight_scale"] = torch.ones(128)
    with pytest.raises(ValueError, match="mix scale formats"):
        tm.load_fp8_experts(bad, "p.", 2)
    with pytest.raises(ValueError):
        tm.load_fp8_experts(sd, "p.", 0)


# ---------------------------------------------------------------------------------------------
# Kernels: quantization
# ---------------------------------------------------------------------------------------------


def _e4m3_edge_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties), values just around them,
    subnormals, +-0 and values past 448."""
    allv = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    pos = torch.unique(allv[torch.isfinite(allv) & (allv >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    v = torch.cat([pos, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([460.0, 464.0, 1e4, 2.0**-12])])
    return torch.cat([v, -v])


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_quantize_kernel_rounds_like_torch(fmt):
    """Ties to even, subnormals and the clamp: the row holds 448 exactly (scale 1), so every value
    is quantized as itself."""
    v = _e4m3_edge_values()
    n = 128 * 2
    rows = []
    for i in range(0, v.numel(), n - 1):
        chunk = v[i:i + n - 1]
        row = torch.zeros(n)
        row[: chunk.numel()] = chunk.clamp(-448, 448)
        row[-1] = 448.0
        if fmt == BLOCK:
            row[127] = 448.0
        rows.append(row)
    x = torch.stack(rows).to(DEV)
    q, s = K8.fp8_quantize(x, fmt)
    rq, rs = R.quantize_rows(x.cpu(), fmt)
    assert (rs == 1).all()
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().float(), rq.float())


@given(M=st.integers(0, 6), K=st.integers(1, 400), fmt=st.sampled_from(R.FORMATS),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
@settings(max_examples=12)
def test_quantize_kernel_bitwise(M, K, fmt, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((M, K), g, 8).to(dtype)
    if M > 1:
        x[1] = 0  # an all-zero row: scale 1
    q, s = K8.fp8_quantize(x.to(DEV), fmt)
    rq, rs = R.quantize_rows(x, fmt)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu().float(), rq.float())


@given(T=st.integers(0, 7), k=st.integers(1, 3), E=st.integers(1, 4), D=st.sampled_from([40, 128, 200]),
       pad_to=st.sampled_from([1, 4]), extra=st.sampled_from([None, 0, 5]), fmt=st.sampled_from(R.FORMATS),
       seed=st.integers(0, 2**16))
@settings(max_examples=12)
def test_fp8_permute_bitwise(T, k, E, D, pad_to, extra, fmt, seed):
    """The quantization fused into the permute: the reference's permute then quantize, bit for
    bit (padding rows and rows past R: zeros, scale 1), metadata equal; with and without
    num_rows; -1 ids and experts with no rows included."""
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((T, D), g, 8)
    ids = torch.randint(-1, E, (T, k), generator=g)
    num_rows = None if extra is None else ref.max_permuted_rows(T, k, E, pad_to) + extra
    q, s, info = tm.fp8.fp8_permute(x.to(DEV), ids.to(DEV), E, fmt, pad_to=pad_to, num_rows=num_rows,
                                    backend="triton")
    rq, rs, rinfo = R.fp8_permute(x, ids, E, fmt, pad_to=pad_to, num_rows=num_rows)
    assert torch.equal(info.expert_offsets.cpu(), rinfo.expert_offsets)
    assert torch.equal(info.slot_rows.cpu(), rinfo.slot_rows)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu().float(), rq.float())


# ---------------------------------------------------------------------------------------------
# Kernels: GEMMs
# ---------------------------------------------------------------------------------------------


def _gemm_case(seed, R_rows, E, D, F, fmt, empty_expert=True):
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((R_rows, D), g, 8)
    w1, w2 = _group_scaled((E, D, 2 * F), g, 12) / 8, _group_scaled((E, F, D), g, 12) / 8
    ex = tm.quantize_experts(w1, w2, format=fmt)
    cuts = sorted(torch.randint(0, R_rows + 1, (E - 1,), generator=g).tolist())
    if empty_expert and E > 2:
        cuts[1] = cuts[0]  # expert 1 has no rows
    tail = min(3, R_rows - cuts[-1]) if cuts else 0
    offs = [0, *cuts, R_rows - tail]
    xq, xs = R.quantize_rows(x, fmt)
    return xq, xs, torch.tensor(offs), ex


def _check_mm(xq, xs, offs, ex, fmt, swiglu):
    w, ws = (ex.w1, ex.w1_scale) if swiglu else (ex.w2.transpose(1, 2).contiguous(), None)
    if not swiglu:  # a plain grouped GEMM over D: use w1's gate half as an [E, N, D] weight
        F = ex.d_ffn
        w = ex.w1[:, :F]
        ws = ex.w1_scale[:, : (-(-F // 128) if fmt == BLOCK else F)]
    pw = _poison_view(ws)
    got = K8.fp8_grouped_mm(xq.to(DEV), _poison_view(xs).to(DEV), offs.to(DEV), w.to(DEV), pw.to(DEV), fmt,
                            torch.float32, swiglu=swiglu)
    want = R.fp8_grouped_mm(xq, xs, offs, w, ws, fmt, torch.float32, swiglu=swiglu)
    return got.cpu(), want


@pytest.mark.parametrize("fmt", R.FORMATS)
@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_grouped_mm_matches_reference(fmt, swiglu):
    """fp32 output against the dequantized reference: K = 200 (two scale blocks, the second
    partial; four K steps per block in the interpreter), an expert with no rows, tail rows zero."""
    xq, xs, offs, ex = _gemm_case(5, 37, 4, 200, 136, fmt)
    got, want = _check_mm(xq, xs, offs, ex, fmt, swiglu)
    assert torch.isfinite(got).all()
    tail = int(offs[-1])
    assert (got[tail:] == 0).all()
    if swiglu:  # the error bound of SwiGLU: compare the pre-activations' bounds loosely
        assert torch.allclose(got, want, rtol=10 * GEMM_RTOL, atol=GEMM_RTOL * float(want.abs().max()))
    else:
        wd = R.dequantize_weight(ex.w1[:, : ex.d_ffn], ex.w1_scale[:, : (2 if fmt == BLOCK else ex.d_ffn)], fmt)
        bound = _bound(R.dequantize_rows(xq, xs, fmt).abs(), wd.abs().transpose(1, 2), offs.tolist())
        assert _close(got, want, bound)


def test_tolerance_catches_a_wrong_scale_block():
    """The GEMM tolerance rejects a result computed with a neighbouring K block's activation
    scale (what a wrong scale index would give)."""
    xq, xs, offs, ex = _gemm_case(6, 20, 2, 256, 128, BLOCK, empty_expert=False)
    w, ws = ex.w1[:, :128], ex.w1_scale[:, :1]
    want = R.fp8_grouped_mm(xq, xs, offs, w, ws, BLOCK, torch.float32)
    wrong = R.fp8_grouped_mm(xq, xs[:, [1, 0]].contiguous(), offs, w, ws, BLOCK, torch.float32)
    wd = R.dequantize_weight(w, ws, BLOCK)
    bound = _bound(R.dequantize_rows(xq, xs, BLOCK).abs(), wd.abs().transpose(1, 2), offs.tolist())
    assert _close(want, want, bound) and not _close(wrong, want, bound, rtol=2e-3)  # not even GPU's


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_gemm1_quantizing_epilogue_is_quantize_of_its_fp32_output(fmt):
    """GEMM1's epilogue quantization (block: in registers; rowwise: the separate pass) gives
    exactly fp8_quantize of the fp32 SwiGLU output the same kernel computes."""
    xq, xs, offs, ex = _gemm_case(7, 30, 3, 200, 256, fmt)
    a32 = K8.fp8_grouped_mm(xq.to(DEV), xs.to(DEV), offs.to(DEV), ex.w1.to(DEV), ex.w1_scale.to(DEV), fmt,
                            torch.float32, swiglu=True)
    space = K8.RowSpace(offs.to(DEV), 30, 3)
    aq, as_ = K8._gemm1(xq.to(DEV), xs.to(DEV), space, ex.w1.to(DEV), ex.w1_scale.to(DEV), fmt, ex.d_ffn)
    rq, rs = R.quantize_rows(a32.cpu(), fmt)
    assert torch.equal(as_.cpu(), rs) and torch.equal(aq.cpu().float(), rq.float())


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_fp8_grouped_ffn_matches_reference(fmt):
    xq, xs, offs, ex = _gemm_case(8, 33, 4, 200, 136, fmt)
    pex = _poison_experts(ex)
    got = tm.fp8.fp8_grouped_ffn(xq.to(DEV), xs.to(DEV), offs.to(DEV), R.FP8Experts(*(t.to(DEV) for t in (
        pex.w1, pex.w1_scale, pex.w2, pex.w2_scale)), fmt), out_dtype=torch.float32, backend="triton").cpu()
    want = tm.fp8.fp8_grouped_ffn(xq, xs, offs, ex, out_dtype=torch.float32, backend="torch")
    assert torch.isfinite(got).all() and (got[int(offs[-1]):] == 0).all()
    # A is requantized between the GEMMs: an fp32 rounding difference may move one e4m3 step
    # in rare elements, far below a wrong scale's factor >= 2
    err = (got - want).abs().amax(1)
    assert (err <= FFN_RTOL * want.abs().amax(1) + 1e-6).all(), err.max()


@pytest.mark.parametrize("fmt", R.FORMATS)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype,decode", [(torch.float32, False), (torch.float16, False), (torch.float32, True)])
def test_fp8_moe_ffn_matches_reference(fmt, k, dtype, decode):
    """Both metadata paths: the decode kernel (T <= 64 by default) and the sort + tile map."""
    g = torch.Generator().manual_seed(9 + k)
    T, E, D, F = 11, 4, 136, 128
    x = _group_scaled((T, D), g, 6).to(dtype)
    w1, w2 = _group_scaled((E, D, 2 * F), g, 8) / 8, _group_scaled((E, F, D), g, 8) / 8
    ex = tm.quantize_experts(w1, w2, format=fmt)
    ids = torch.randint(0, E - 1, (T, k), generator=g)  # expert E-1 gets no rows
    ids[0, 0] = -1  # a dropped slot
    if k == 2:
        ids[:, 1] = (ids[:, 0] + 1) % (E - 1)
        ids[0, 1] = 0
    routing = _routing(ids, torch.rand(T, k, generator=g), E)
    rd = Routing(*(t.to(DEV) for t in (routing.topk_ids, routing.topk_weights, routing.counts, routing.counts)))
    exd = R.FP8Experts(*(t.to(DEV) for t in (ex.w1, ex.w1_scale, ex.w2, ex.w2_scale)), fmt)
    with C.force_decode(decode):
        got = tm.fp8_moe_ffn(x.to(DEV), rd, exd, backend="triton").cpu()
    want = tm.fp8_moe_ffn(x, routing, ex, backend="torch")
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = FFN_RTOL if dtype == torch.float32 else FFN_RTOL + 3e-3
    err = (got.float() - want.float()).abs().amax(1)
    assert (err <= tol * want.float().abs().amax(1) + 1e-6).all(), err.max()


@given(T=st.integers(0, 9), k=st.integers(1, 2), E=st.integers(1, 4), D=st.sampled_from([32, 136, 256]),
       F=st.sampled_from([64, 136]), fmt=st.sampled_from(R.FORMATS), seed=st.integers(0, 2**16))
@settings(max_examples=8)
def test_fp8_moe_ffn_property(T, k, E, D, F, fmt, seed):
    """Over shapes: T = 0, one expert, K (= D for GEMM1, F for GEMM2) below, at and past 128 and
    not a multiple of it, dropped slots and experts with no rows: the kernel path equals the
    reference within the requantization tolerance, and tokens with no routed slot are zero."""
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((T, D), g, 6)
    ex = tm.quantize_experts(_group_scaled((E, D, 2 * F), g, 6) / 8, _group_scaled((E, F, D), g, 6) / 8, format=fmt)
    ids = torch.randint(-1, E, (T, k), generator=g)
    if k == 2:  # distinct experts per token (what a router gives)
        ids[:, 1] = torch.where((ids[:, 1] == ids[:, 0]) & (ids[:, 0] >= 0), -1, ids[:, 1])
    routing = _routing(ids, torch.rand(T, k, generator=g), E)
    rd = Routing(*(t.to(DEV) for t in (routing.topk_ids, routing.topk_weights, routing.counts, routing.counts)))
    exd = R.FP8Experts(*(t.to(DEV) for t in (ex.w1, ex.w1_scale, ex.w2, ex.w2_scale)), fmt)
    got = tm.fp8_moe_ffn(x.to(DEV), rd, exd, backend="triton").cpu()
    want = tm.fp8_moe_ffn(x, routing, ex, backend="torch")
    assert got.shape == (T, D) and torch.isfinite(got).all()
    err = (got - want).abs().amax(1) if T else torch.zeros(0)
    assert (err <= FFN_RTOL * want.abs().amax(1) + 1e-6).all(), err.max()
    unrouted = (ids < 0).all(1)
    assert (got[unrouted] == 0).all()


def test_hand_built_experts_are_checked():
    g = torch.Generator().manual_seed(11)
    ex = tm.quantize_experts(torch.randn(2, 64, 64, generator=g), torch.randn(2, 32, 64, generator=g))
    x = torch.randn(3, 64)
    r = _routing(torch.tensor([[0], [1], [0]]), torch.ones(3, 1), 2)
    bad = (R.FP8Experts(ex.w1, ex.w1_scale[:, :1], ex.w2, ex.w2_scale, ex.format),
           R.FP8Experts(ex.w1.float(), ex.w1_scale, ex.w2, ex.w2_scale, ex.format),
           R.FP8Experts(ex.w1, ex.w1_scale, ex.w2[:, :, :16], ex.w2_scale, ex.format),
           R.FP8Experts(ex.w1, ex.w1_scale, ex.w2, ex.w2_scale, "e4m3_rowwise"),
           R.FP8Experts(ex.w1, ex.w1_scale, ex.w2, ex.w2_scale.double(), ex.format))
    for b in bad:
        with pytest.raises((TypeError, ValueError), match="experts"):
            tm.fp8_moe_ffn(x, r, b)


def test_public_api_errors():
    g = torch.Generator().manual_seed(10)
    ex = tm.quantize_experts(torch.randn(2, 64, 64, generator=g), torch.randn(2, 32, 64, generator=g))
    x = torch.randn(3, 64)
    r = _routing(torch.tensor([[0], [1], [0]]), torch.ones(3, 1), 2)
    with pytest.raises(ValueError, match="d_model"):
        tm.fp8_moe_ffn(torch.randn(3, 32), r, ex)
    with pytest.raises(TypeError, match="FP8Experts"):
        tm.fp8_moe_ffn(x, r, (ex.w1, ex.w2))
    with pytest.raises(ValueError, match="over 3 experts"):
        tm.fp8_moe_ffn(x, _routing(torch.tensor([[0], [1], [0]]), torch.ones(3, 1), 3), ex)
    with pytest.raises(IndexError):
        tm.fp8_moe_ffn(x, Routing(torch.tensor([[0], [5], [0]], dtype=torch.int32), torch.ones(3, 1),
                                  r.counts, r.counts), ex)
    with pytest.raises(ValueError, match="inference-only"):
        tm.fp8_moe_ffn(x.requires_grad_(), r, ex)
    xq, xs = tm.fp8.fp8_quantize(torch.randn(3, 64))
    with pytest.raises(ValueError, match="x_scale"):
        tm.fp8.fp8_grouped_ffn(xq, xs[:, :0], torch.tensor([0, 1, 3]), ex)
    with pytest.raises(TypeError, match="float8"):
        tm.fp8.fp8_grouped_ffn(xq.float(), xs, torch.tensor([0, 1, 3]), ex)
    with pytest.raises(ValueError, match="not an FP8 format"):
        tm.fp8.fp8_quantize(torch.randn(3, 64), "int8")


# ---------------------------------------------------------------------------------------------
# Training (DeepSeek-V3's recipe, block-128)
# ---------------------------------------------------------------------------------------------


def test_fp8_wgrad_kernel_matches_reference():
    """The weight-gradient kernel over 128x1 blocks: segments not aligned to 128 (a step's
    128-row block spans two experts), an empty expert, tail rows, row blocks whose magnitudes
    differ by up to 2**12; against the reference to fp32 summation order."""
    from tritonmoe.kernels import fp8_train as FT

    g = torch.Generator().manual_seed(12)
    Rr, M, N = 300, 40, 72
    a = _group_scaled((Rr, M), g, 12).t().contiguous().t()  # rows in 128-blocks of different scales
    b = _group_scaled((Rr, N), g, 12)
    offs = torch.tensor([0, 100, 100, 290])
    got = FT._wgrad(a.to(DEV), b.to(DEV), offs.to(DEV), 3, torch.float32).cpu()
    segs = [(0, 100), (100, 100), (100, 290)]
    at, bt = R._deq_t(a), R._deq_t(b)
    want = R._wgrad(at, bt, segs, torch.float32)
    bound = R._wgrad(at.abs(), bt.abs(), segs, torch.float32).double()
    assert (got[1] == 0).all()
    assert torch.isfinite(got).all() and ((got - want).abs() <= GEMM_RTOL * bound + 1e-30).all()
    q, s = R.quantize_rows(a.t(), BLOCK)
    wrong = R._wgrad(R.dequantize_rows(q, s.roll(1, 1), BLOCK), bt, segs, torch.float32)
    assert not ((wrong - want).abs() <= GEMM_RTOL * bound + 1e-30).all()  # the neighbouring row block's scale


def _train_case(seed, Rr=40, E=3, D=136, F=128, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = _group_scaled((Rr, D), g, 4).to(dtype)
    w1 = (_group_scaled((E, D, 2 * F), g, 4) / 16).to(dtype)
    w2 = (_group_scaled((E, F, D), g, 4) / 16).to(dtype)
    dy = torch.randn(Rr, D, generator=g).to(dtype)
    return x, w1, w2, dy, torch.tensor([0, 15, 15, Rr - 3])


def _train_grads(x, offs, w1, w2, dy, backend):
    xs, w1s, w2s = (t.detach().to(DEV).requires_grad_() for t in (x, w1, w2))
    y = tm.fp8.fp8_grouped_ffn_train(xs, offs.to(DEV), w1s, w2s, backend=backend)
    return [t.detach().cpu() for t in (y, *torch.autograd.grad(y, (xs, w1s, w2s), dy.to(DEV)))]


def test_fp8_training_kernels_match_reference():
    """Forward, dX, dW1, dW2 of the Triton path against the reference (the same quantizations in
    plain PyTorch): equal up to a requantized element's e4m3 step (H and dH are fp32 sums in a
    different order); rows past offsets[E] give zero output and zero dX."""
    x, w1, w2, dy, offs = _train_case(13)
    got = _train_grads(x, offs, w1, w2, dy, "triton")
    want = _train_grads(x, offs, w1, w2, dy, "torch")
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.isfinite(a).all(), name
        assert (a - b).abs().max() <= FFN_RTOL * b.abs().max(), (name, (a - b).abs().max(), b.abs().max())
    assert (got[0][-3:] == 0).all() and (got[1][-3:] == 0).all() and (got[2][1] == 0).all()


def test_fp8_training_close_to_fp32_autograd():
    """The FP8 recipe's gradients against fp32 autograd of the same FFN: relative errors of a few
    e4m3 roundings (measured ~0.06 at these shapes), far from a wrong gradient (O(1))."""
    x, w1, w2, dy, offs = _train_case(14)
    fp8 = _train_grads(x, offs, w1, w2, dy, "torch")
    xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))
    y = ref.grouped_ffn(xs, offs, w1s, w2s, "swiglu")
    exact = [y.detach(), *torch.autograd.grad(y, (xs, w1s, w2s), dy)]
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), fp8, exact):
        rel = float((a - b).norm() / b.norm())
        assert rel < 0.12, (name, rel)


def test_fp8_training_errors():
    x, w1, w2, dy, offs = _train_case(15, F=64)
    with pytest.raises(ValueError, match="multiple of 128"):
        tm.fp8.fp8_grouped_ffn_train(x, offs, w1, w2)
    x, w1, w2, dy, offs = _train_case(15)
    with pytest.raises(ValueError, match="SwiGLU"):
        tm.fp8.fp8_grouped_ffn_train(x[:, :64], offs, w1, w2)
    with pytest.raises(TypeError):
        tm.fp8.fp8_grouped_ffn_train(x.int(), offs, w1, w2)


def _student_losses(fp8: bool, steps: int, seed: int = 0) -> list[float]:
    """Adam on a SwiGLU MoE FFN fitting a fixed random teacher (E=4, d=f=128, 32 tokens top-2 a
    step), loss normalized by the target's power; master weights fp32; FP8 through the
    reference of the recipe (the kernels' arithmetic) on CPU."""
    g = torch.Generator().manual_seed(seed)
    E, D, F, T, k = 4, 128, 128, 32, 2
    tw1, tw2 = torch.randn(E, D, 2 * F, generator=g) * D**-0.5, torch.randn(E, F, D, generator=g) * F**-0.5
    w1 = (torch.randn(E, D, 2 * F, generator=g) * D**-0.5).requires_grad_()
    w2 = (torch.randn(E, F, D, generator=g) * F**-0.5).requires_grad_()
    opt = torch.optim.Adam([w1, w2], lr=3e-3)
    losses = []
    for _ in range(steps):
        xp, info = ref.permute(torch.randn(T, D, generator=g), torch.randint(0, E, (T, k), generator=g), E)
        with torch.no_grad():
            target = ref.grouped_ffn(xp, info.expert_offsets, tw1, tw2, "swiglu")
        if fp8:
            y = tm.fp8.fp8_grouped_ffn_train(xp, info.expert_offsets, w1, w2, backend="torch")
        else:
            y = ref.grouped_ffn(xp, info.expert_offsets, w1, w2, "swiglu")
        loss = ((y - target) ** 2).mean() / (target**2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp8_training_loss_curve_tracks_fp32():
    """A short training run: the FP8 recipe's loss curve stays within 2% of fp32's at every one
    of 40 steps (same data, same init) while the loss falls by a quarter (docs/fp8.md has a
    300-step run)."""
    a, b = _student_losses(False, 40), _student_losses(True, 40)
    assert a[-1] < 0.75 * a[0]
    assert all(abs(x - y) <= 0.02 * x for x, y in zip(a, b)), max(abs(x - y) / x for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# MoELayer(expert_dtype="fp8_e4m3")
# ---------------------------------------------------------------------------------------------


def _fp8_layers(recipe="block128", **kw):
    torch.manual_seed(16)
    cfg = dict(d_model=64, d_ffn=128, num_experts=4, top_k=2, **kw)
    dense = tm.MoELayer(tm.MoEConfig(**cfg), dtype=torch.float32)
    fp8 = tm.MoELayer(tm.MoEConfig(**cfg, expert_dtype="fp8_e4m3", fp8_recipe=recipe), dtype=torch.float32)
    fp8.load_state_dict(dense.state_dict())  # the same master weights; the state dict is the 16/32-bit one
    return dense, fp8


@pytest.mark.parametrize("recipe", ["block128", "rowwise"])
def test_layer_fp8_inference(recipe):
    """Under no_grad the layer runs fp8_moe_ffn on its routing with its weights quantized: equal
    to that op called by hand (bitwise: the same reference arithmetic on CPU), a few percent from
    the fp32 layer."""
    dense, fp8 = _fp8_layers(recipe)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        out, want = fp8(x), dense(x)
        routing = fp8.last_routing
    assert fp8.ffn_path_used == "fp8"
    rel = float((out - want).norm() / want.norm())
    assert 1e-3 < rel < 0.1, rel
    ex = R.quantize_experts(fp8.w1.detach(), fp8.w2.detach(), "e4m3_" + recipe)
    with torch.no_grad():
        by_hand = tm.fp8_moe_ffn(x.reshape(-1, 64), routing, ex).reshape(x.shape)
    assert torch.equal(out, by_hand)


def test_layer_fp8_training():
    """With a backward: permute -> fp8_grouped_ffn_train -> unpermute; gradients of x, the expert
    weights and the router within FP8 error of the fp32 layer's; master weights stay fp32."""
    dense, fp8 = _fp8_layers()
    x = torch.randn(12, 64)
    grads = []
    for layer in (dense, fp8):
        xs = x.clone().requires_grad_()
        out = layer(xs)
        out.square().sum().backward()
        grads.append([xs.grad] + [p.grad for p in (layer.w1, layer.w2)])
    assert fp8.ffn_path_used == "fp8_train" and fp8.w1.dtype == torch.float32
    for name, a, b in zip(("x", "w1", "w2"), grads[1], grads[0]):
        rel = float((a - b).norm() / b.norm())
        assert 1e-4 < rel < 0.15, (name, rel)


def test_layer_fp8_config_errors():
    with pytest.raises(ValueError, match="SwiGLU"):
        tm.MoEConfig(d_model=64, d_ffn=128, num_experts=4, top_k=2, activation="gelu", expert_dtype="fp8_e4m3")
    with pytest.raises(ValueError):
        tm.MoEConfig(d_model=64, d_ffn=128, num_experts=4, top_k=2, expert_dtype="fp8_e5m2")
    with pytest.raises(ValueError):
        tm.MoEConfig(d_model=64, d_ffn=128, num_experts=4, top_k=2, expert_dtype="fp8_e4m3", fp8_recipe="tensor")
    _, fp8 = _fp8_layers("rowwise")
    with pytest.raises(ValueError, match="FP8 training"):
        fp8(torch.randn(3, 64, requires_grad=True))
