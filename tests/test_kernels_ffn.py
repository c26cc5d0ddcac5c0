"""Triton grouped expert FFN (kernels/grouped_gemm.py) against tritonmoe.reference.

On CPU the kernels run in Triton's interpreter (fp16/fp32 only: the interpreter's bf16 dot is
broken), with its small 16x16x16 tiles and 3 persistent programs so that tiny shapes still span
several tiles, partial tiles, a K remainder and programs taking several work items; on CUDA the
``gpu`` tests add bf16 and larger shapes.

Tolerances are max |error| over max |reference|, per dtype: fp32 agrees to fp32 summation order
(~1e-6), fp16 to a few roundings of 2^-11. A wrong row, expert or slot is an O(1) error, which
``test_tolerance_catches_swapped_experts`` checks.

Poisoning (STYLE.md 8): inputs the kernels must not read (tokens with no routed slot, rows past
the segments, weights of unrouted slots) hold NaN, and inside :func:`poisoned` every float buffer
a kernel allocates with ``torch.empty`` starts as NaN, so an output element no program writes,
or a stale partial read back, shows up as NaN.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import tritonmoe
from tritonmoe import reference as ref
from tritonmoe.core.exact import WeightGradStore
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import _grouped_gemm_kernels as GK
from tritonmoe.kernels import grouped_ffn as KF
from tritonmoe.kernels import grouped_gemm as K

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
ACTS = ("swiglu", "swiglu_oai", "gelu", "relu")
GLUS = ("swiglu", "swiglu_oai")
# (forward, gradients): normalized max error bounds.
TOL = {
    torch.float32: (2e-5, 5e-5),
    torch.float16: (4e-3, 1.5e-2),
    torch.bfloat16: (2e-2, 5e-2),
}
CPU_DTYPES = (torch.float32, torch.float16)


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if expected.numel() == 0:
        return 0.0
    e = expected.double()
    scale = max(e.abs().max().item(), 1e-3)
    return (actual.double() - e).abs().max().item() / scale


def assert_close(actual, expected, dtype, grad=False, what=""):
    tol = TOL[dtype][1 if grad else 0]
    err = _err(actual, expected)
    assert err <= tol, f"{what}: normalized max error {err:.3g} > {tol:.3g}"


def _offsets(counts, dtype=torch.int64, device=DEV):
    o = torch.zeros(len(counts) + 1, dtype=torch.int64)
    o[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return o.to(device=device, dtype=dtype)


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def _weights(E, d, f, activation, dtype, gen, layout="contiguous"):
    """w1 [E, d, n1], w2 [E, f, d] scaled like nn.Linear, in one of several memory layouts
    (built in ``dtype``: a dtype cast would make them contiguous again)."""
    n1 = 2 * f if activation in GLUS else f
    w1 = _randn((E, d, n1), dtype, gen, d**-0.5)
    w2 = _randn((E, f, d), dtype, gen, f**-0.5)
    if layout == "transposed":  # [E, n1, d] storage viewed as [E, d, n1]
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "sliced":  # every other expert / a column window of bigger NaN-filled tensors
        big1 = torch.full((2 * E, d, n1 + 3), float("nan"), device=DEV, dtype=dtype)
        big1[::2, :, 1 : n1 + 1] = w1
        w1 = big1[::2, :, 1 : n1 + 1]
        big2 = torch.full((E, f + 5, 2 * d), float("nan"), device=DEV, dtype=dtype)
        big2[:, 2 : f + 2, ::2] = w2
        w2 = big2[:, 2 : f + 2, ::2]
    if layout != "contiguous" and d > 1 and n1 > 1:
        assert not w1.is_contiguous()
    return w1, w2


def _biases(E, n1, d, dtype, gen):
    """b1 [E, n1], b2 [E, d] (b1 large enough that GPT-OSS's clamps at 0.75 are hit)."""
    return _randn((E, n1), dtype, gen, 0.5), _randn((E, d), dtype, gen, 0.5)


def _act_kw(activation, limit):
    return dict(swiglu_limit=limit) if activation == "swiglu_oai" else {}


def _leaf(t):
    """A leaf that requires grad, with t's strides (the tests' tensors are fresh, nothing aliases)."""
    return None if t is None else t.detach().requires_grad_(True)


def _grad(out, inputs, g):
    """Gradients of <out, g>; an input the graph never used (every slot dropped) gets zeros."""
    inputs = tuple(t for t in inputs if t is not None)
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    return tuple(torch.zeros_like(t) if d is None else d for t, d in zip(inputs, grads))


@contextlib.contextmanager
def poisoned():
    """Float tensors made by ``torch.empty`` / ``torch.empty_like`` inside the block start as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **kw: fill(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(real_empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def _routing(T, E, k, gen, drop_frac=0.0, poison_dropped=True):
    """Reference routing of random logits; a fraction of slots dropped (id -1) as capacity would,
    their weights NaN (poison: an unrouted slot adds nothing whatever its weight) or 0, counts
    recomputed; differentiable weights."""
    logits = torch.randn(T, E, generator=gen).to(DEV)
    r = ref.route(logits, k)
    if drop_frac and T:
        drop = (torch.rand(T, k, generator=gen) < drop_frac).to(DEV)
        r.topk_ids = torch.where(drop, torch.full_like(r.topk_ids, -1), r.topk_ids)
        fill = float("nan") if poison_dropped else 0.0
        r.topk_weights = torch.where(drop, torch.full_like(r.topk_weights, fill), r.topk_weights)
        r.counts = ref._scatter_count(r.topk_ids, E)
    r.topk_weights = r.topk_weights.detach().requires_grad_(True)
    return r


def _set_ids(r, ids):
    r.topk_ids = ids.to(torch.int32)
    r.counts = ref._scatter_count(r.topk_ids, r.num_experts)


# ---------------------------------------------------------------------------------------------
# Hypothesis: grouped_gemm, grouped_ffn, moe_ffn against the reference
# ---------------------------------------------------------------------------------------------


@st.composite
def ragged_counts(draw, max_rows=64):
    """Per-expert row counts: random, one expert with every row, many empty experts, segments
    shorter than a 16-row tile, or no rows at all."""
    E = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["random", "one_expert", "sparse", "short", "none"]))
    if mode == "one_expert":
        counts = [0] * E
        counts[draw(st.integers(0, E - 1))] = draw(st.integers(1, max_rows))
    elif mode == "sparse":
        counts = [draw(st.sampled_from([0, 0, 0, 17, 33])) for _ in range(E)]
    elif mode == "short":
        counts = [draw(st.integers(0, 5)) for _ in range(E)]
    elif mode == "none":
        counts = [0] * E
    else:
        counts = [draw(st.integers(0, 24)) for _ in range(E)]
    while sum(counts) > max_rows:
        i = max(range(E), key=lambda j: counts[j])
        counts[i] //= 2
    return counts


@settings(max_examples=14)
@given(
    counts=ragged_counts(),
    k=st.integers(1, 48),
    n=st.integers(1, 48),
    dtype=st.sampled_from(CPU_DTYPES),
    off_dtype=st.sampled_from([torch.int32, torch.int64]),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_matches_reference(counts, k, n, dtype, off_dtype, layout, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts, off_dtype)
    x = _leaf(_randn((R, k), dtype, gen))
    w, _ = _weights(E, k, n, "relu", dtype, gen, layout)
    w = _leaf(w)
    b = _leaf(_randn((E, n), dtype, gen)) if bias else None
    with poisoned():
        y = tritonmoe.grouped_gemm(x, offs, w, b, backend="triton")
    y_ref = ref.grouped_gemm(x, offs, w, b)
    assert_close(y, y_ref, dtype, what="y")
    if R:
        g = _randn(y.shape, dtype, gen)
        with poisoned():
            got = _grad(y, (x, w, b), g)
        for name, a, c in zip(("dx", "dw", "db"), got, _grad(y_ref, (x, w, b), g)):
            assert_close(a, c, dtype, True, name)


@settings(max_examples=20)
@given(
    counts=ragged_counts(),
    d=st.integers(1, 40),
    f=st.integers(1, 24),
    activation=st.sampled_from(ACTS),
    limit=st.sampled_from([7.0, 0.75]),
    bias=st.booleans(),
    dtype=st.sampled_from(CPU_DTYPES),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    mode=st.sampled_from(C.PREACT_MODES),
    seed=st.integers(0, 2**16),
)
def test_grouped_ffn_matches_reference(counts, d, f, activation, limit, bias, dtype, layout, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, layout))
    b1, b2 = (_leaf(b) for b in _biases(E, w1.shape[2], d, dtype, gen)) if bias else (None, None)
    kw = _act_kw(activation, limit)
    with CF.override("ffn.preact", mode):
        with poisoned():
            y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, b1, b2, backend="triton", **kw)
        y_ref = ref.grouped_ffn(x, offs, w1, w2, activation, b1, b2, **kw)
        assert_close(y, y_ref, dtype, what="y")
        if R:
            g = _randn(y.shape, dtype, gen)
            inputs = (x, w1, w2, b1, b2)
            with poisoned():
                got = _grad(y, inputs, g)
            for name, a, c in zip(("dx", "dw1", "dw2", "db1", "db2"), got, _grad(y_ref, inputs, g)):
                assert_close(a, c, dtype, True, name)


@settings(max_examples=18)
@given(
    T=st.integers(0, 20),
    E=st.integers(1, 7),
    kk=st.integers(1, 7),
    d=st.integers(1, 40),
    f=st.integers(1, 24),
    activation=st.sampled_from(ACTS),
    limit=st.sampled_from([7.0, 0.75]),
    bias=st.booleans(),
    decode=st.booleans(),
    dtype=st.sampled_from(CPU_DTYPES),
    drop=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_moe_ffn_matches_reference_and_unfused(T, E, kk, d, f, activation, limit, bias, decode, dtype, drop, layout,
                                               seed):
    """The fused path (decode or not) against the reference and against the unfused Triton path
    (permute -> grouped_ffn -> unpermute), outputs and all gradients."""
    gen = torch.Generator().manual_seed(seed)
    k = min(kk, E)
    r = _routing(T, E, k, gen, drop)
    x = _randn((T, d), dtype, gen)
    # Poison: tokens with no routed slot are never read, so NaN there must not leak anywhere.
    unrouted_T = (r.topk_ids < 0).all(dim=1)
    x[unrouted_T] = float("nan")
    x = _leaf(x)
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, layout))
    b1, b2 = (_leaf(b) for b in _biases(E, w1.shape[2], d, dtype, gen)) if bias else (None, None)
    kw = _act_kw(activation, limit)
    with CF.override("ffn.decode", decode), poisoned():
        out = tritonmoe.moe_ffn(x, r, w1, w2, activation, b1, b2, backend="triton", **kw)
    out_ref = ref.moe_ffn(x, r, w1, w2, activation, b1, b2, **kw)
    assert_close(out, out_ref, dtype, what="out")
    assert not out[unrouted_T].any()

    x_perm, info = ref.permute(x, r.topk_ids, E)
    y_perm = tritonmoe.grouped_ffn(x_perm, info.expert_offsets, w1, w2, activation, b1, b2, backend="triton", **kw)
    out_unfused = ref.unpermute(y_perm, info, r.topk_weights)
    assert_close(out, out_unfused, dtype, what="fused vs unfused")

    if T:
        g = _randn(out.shape, dtype, gen)
        inputs = (x, r.topk_weights, w1, w2, b1, b2)
        with CF.override("ffn.decode", decode), poisoned():
            got = _grad(out, inputs, g)
        want = _grad(out_ref, inputs, g)
        unfused = _grad(out_unfused, inputs, g)
        for name, a, b, c in zip(("dx", "dgate", "dw1", "dw2", "db1", "db2"), got, want, unfused):
            assert_close(a, b, dtype, True, name)
            assert_close(a, c, dtype, True, name + " fused vs unfused")
        assert not got[0][unrouted_T].any()
        assert not got[1][r.topk_ids < 0].any()  # an unrouted slot's weight gets no gradient


# ---------------------------------------------------------------------------------------------
# Named edge cases
# ---------------------------------------------------------------------------------------------

# (why, counts, d, f, activation, bias): each exercises one corner of the tile map or epilogue.
EDGE_CASES = [
    ("R=0: no rows at all", [0, 0, 0], 16, 8, "swiglu", True),
    ("one expert holds every row", [0, 45, 0, 0], 20, 12, "swiglu_oai", True),
    ("empty experts between full ones", [17, 0, 0, 16, 0], 16, 16, "swiglu", False),
    ("prime E, segments shorter than a tile", [1, 2, 0, 3, 5, 1, 0], 24, 10, "gelu", True),
    ("single row", [0, 1], 7, 5, "swiglu_oai", False),
    ("K and N not multiples of the tile", [19, 23], 33, 17, "swiglu", True),
]


@pytest.mark.parametrize("why,counts,d,f,activation,bias", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_grouped_ffn_edge_cases(why, counts, d, f, activation, bias, dtype):
    gen = torch.Generator().manual_seed(len(counts) * 100 + d)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen))
    b1, b2 = (_leaf(b) for b in _biases(E, w1.shape[2], d, dtype, gen)) if bias else (None, None)
    kw = _act_kw(activation, 0.75)
    with poisoned():
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, b1, b2, backend="triton", **kw)
    y_ref = ref.grouped_ffn(x, offs, w1, w2, activation, b1, b2, **kw)
    assert_close(y, y_ref, dtype, what="y")
    g = _randn(y.shape, dtype, gen)
    inputs = (x, w1, w2, b1, b2)
    with poisoned():
        got = _grad(y, inputs, g)
    for name, a, b in zip(("dx", "dw1", "dw2", "db1", "db2"), got, _grad(y_ref, inputs, g)):
        assert_close(a, b, dtype, True, name)
    for e, c in enumerate(counts):  # an empty expert's weight and bias gradients are exactly zero
        if c == 0:
            assert all(not t[e].any() for t in got[1:])


# (why, T, E, k, d, decode): the fused path's corners, on both sides of the decode switch.
MOE_CASES = [
    ("zero tokens", 0, 4, 2, 12, None),
    ("T=1 decode", 1, 6, 2, 12, True),
    ("T=1 not decode", 1, 6, 2, 12, False),
    ("k = E", 9, 3, 3, 12, None),
    ("k = E decode", 9, 3, 3, 12, True),
    ("prime E, k=1 (direct weighted write)", 11, 5, 1, 12, False),
    ("prime E, k=1 decode (split-K combine)", 11, 5, 1, 40, True),
    ("all tokens on one expert", 13, 4, 2, 12, False),
    ("all tokens on one expert, decode", 13, 4, 2, 12, True),
    ("one expert past the decode row tile (20 rows, BM 16)", 20, 16, 1, 12, True),
    ("unaligned d (33)", 7, 5, 2, 33, True),
    ("every slot dropped", 5, 3, 2, 12, True),
]


@pytest.mark.parametrize("why,T,E,k,d,decode", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_ffn_edge_cases(why, T, E, k, d, decode):
    dtype = torch.float32
    gen = torch.Generator().manual_seed(T * 7 + E + d)
    r = _routing(T, E, k, gen, 1.0 if "dropped" in why else 0.0)
    if "one expert" in why:
        ids = torch.full_like(r.topk_ids, -1)
        ids[:, 0] = 2
        _set_ids(r, ids)
    x = _leaf(_randn((T, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, 20, "swiglu_oai", dtype, gen))  # f = 20: decode splits K
    b1, b2 = (_leaf(b) for b in _biases(E, w1.shape[2], d, dtype, gen))
    kw = dict(swiglu_limit=0.75)

    def path():
        return CF.override("ffn.decode", decode) if decode is not None else contextlib.nullcontext()

    with path(), poisoned():
        out = tritonmoe.moe_ffn(x, r, w1, w2, "swiglu_oai", b1, b2, backend="triton", **kw)
    out_ref = ref.moe_ffn(x, r, w1, w2, "swiglu_oai", b1, b2, **kw)
    assert_close(out, out_ref, dtype, what="out")
    if T:
        g = _randn(out.shape, dtype, gen)
        inputs = (x, r.topk_weights, w1, w2, b1, b2)
        with path(), poisoned():
            got = _grad(out, inputs, g)
        for name, a, b in zip(("dx", "dgate", "dw1", "dw2", "db1", "db2"), got, _grad(out_ref, inputs, g)):
            assert_close(a, b, dtype, True, name)


def test_rows_past_offsets_end_are_zero():
    """Rows outside the segments (allowed with validation off) come out zero, even when x holds
    NaN there, and get zero gradient; biases are not added to them."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32
    counts = [5, 0, 12]
    R = sum(counts) + 21
    offs = _offsets(counts)
    x = _randn((R, 20), dtype, gen)
    x[sum(counts):] = float("nan")
    x = _leaf(x)
    w1, w2 = (_leaf(w) for w in _weights(3, 20, 10, "gelu", dtype, gen))
    b1, b2 = _biases(3, 10, 20, dtype, gen)
    with tritonmoe.validation(False), poisoned():
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, "gelu", b1, b2, backend="triton")
        z = tritonmoe.grouped_gemm(x, offs, w1, b1, backend="triton")
    assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))
    assert torch.equal(z[sum(counts):], torch.zeros_like(z[sum(counts):]))
    x_ok = x[: sum(counts)].detach()
    assert_close(y[: sum(counts)], ref.grouped_ffn(x_ok, offs, w1, w2, "gelu", b1, b2), dtype, what="y")
    (dx,) = _grad(y, (x,), torch.ones_like(y))
    assert not dx[sum(counts):].any()


def test_padding_rows_stay_zero():
    """Segments padded by permute(pad_to=16) (zero rows inside segments) give zero outputs
    without biases (the bias is part of every row of an expert's segment, padding included)."""
    gen = torch.Generator().manual_seed(5)
    x = _randn((10, 16), torch.float16, gen)
    ids = torch.tensor([[0], [2], [2], [0], [2], [3], [2], [0], [3], [2]], device=DEV)
    x_perm, info = ref.permute(x, ids, 4, pad_to=16)
    w1, w2 = _weights(4, 16, 8, "swiglu", torch.float16, gen)
    y = tritonmoe.grouped_ffn(x_perm, info.expert_offsets, w1, w2, backend="triton")
    pad = torch.ones(x_perm.shape[0], dtype=torch.bool, device=DEV)
    pad[info.slot_rows.reshape(-1)] = False
    assert pad.sum() > 0 and not y[pad].any()


def test_noncontiguous_x():
    gen = torch.Generator().manual_seed(9)
    counts = [7, 0, 20]
    offs = _offsets(counts, torch.int32)
    base = _randn((24, sum(counts)), torch.float32, gen)
    x = base.t().detach().requires_grad_(True)  # [R, 24] with strides (1, R)
    w1, w2 = (_leaf(w) for w in _weights(3, 24, 12, "relu", torch.float32, gen, "transposed"))
    b1, b2 = (_leaf(b.t().contiguous().t()) for b in _biases(3, 12, 24, torch.float32, gen))  # column-major biases
    y = tritonmoe.grouped_ffn(x, offs, w1, w2, "relu", b1, b2, backend="triton")
    y_ref = ref.grouped_ffn(x, offs, w1, w2, "relu", b1, b2)
    assert_close(y, y_ref, torch.float32, what="y")
    g = _randn(y.shape, torch.float32, gen).t().contiguous().t()  # non-contiguous gradient too
    inputs = (x, w1, w2, b1, b2)
    for name, a, b in zip(("dx", "dw1", "dw2", "db1", "db2"), _grad(y, inputs, g), _grad(y_ref, inputs, g)):
        assert_close(a, b, torch.float32, True, name)


def test_tolerance_catches_swapped_experts():
    """The fp16/fp32 bounds are tight enough that swapping two experts' weights fails them."""
    gen = torch.Generator().manual_seed(11)
    for dtype in CPU_DTYPES:
        counts = [9, 14, 6]
        offs = _offsets(counts)
        x = _randn((sum(counts), 16), dtype, gen)
        w1, w2 = _weights(3, 16, 8, "swiglu", dtype, gen)
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
        w1s = w1[[1, 0, 2]]
        w2s = w2[[1, 0, 2]]
        assert _err(y, ref.grouped_ffn(x, offs, w1, w2)) <= TOL[dtype][0]
        assert _err(y, ref.grouped_ffn(x, offs, w1s, w2s)) > 10 * TOL[dtype][1]
        # One row shifted into the next expert also fails.
        offs_shift = _offsets([10, 13, 6])
        assert _err(y, ref.grouped_ffn(x, offs_shift, w1, w2)) > 10 * TOL[dtype][1]


def test_deterministic_and_preact_modes_agree():
    """Two runs give bitwise-equal outputs and gradients; saving or recomputing the
    pre-activation gives bitwise-equal gradients; on both sides of the decode switch."""
    gen = torch.Generator().manual_seed(13)
    T, E, k, d, f = 9, 4, 2, 16, 8
    r = _routing(T, E, k, gen, 0.2)
    x = _leaf(_randn((T, d), torch.float16, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, "swiglu_oai", torch.float16, gen))
    b1, b2 = (_leaf(b) for b in _biases(E, 2 * f, d, torch.float16, gen))
    g = _randn((T, d), torch.float16, gen)
    for decode in (False, True):
        results = []
        for mode in ("save", "save", "recompute"):
            with CF.override("ffn.preact", mode), CF.override("ffn.decode", decode):
                out = tritonmoe.moe_ffn(x, r, w1, w2, "swiglu_oai", b1, b2, backend="triton")
                results.append((out, *_grad(out, (x, r.topk_weights, w1, w2, b1, b2), g)))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert torch.equal(a, b)


@pytest.mark.parametrize("programs", [1, 2, 7, 10**6])
def test_results_do_not_depend_on_the_number_of_persistent_programs(monkeypatch, programs):
    """However many programs stride over the work items (one taking all, a few, one per item),
    every output element is computed the same way: bitwise-equal results."""
    gen = torch.Generator().manual_seed(15)
    counts = [9, 0, 21, 3]
    offs = _offsets(counts)
    x = _randn((sum(counts) + 2, 24), torch.float32, gen)
    w1, w2 = _weights(4, 24, 10, "swiglu", torch.float32, gen)
    with tritonmoe.validation(False):
        base = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
        monkeypatch.setattr(C, "max_programs", lambda *a: programs)
        with poisoned():
            y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
    assert torch.equal(y, base)


# ---------------------------------------------------------------------------------------------
# GPT-OSS's clamped SwiGLU and the reference's fp64 row invariance
# ---------------------------------------------------------------------------------------------


def test_swiglu_oai_is_transformers_formula():
    """The reference equals transformers' GptOssExperts activation (interleaved gate/up columns,
    our w1 holds gate columns first), values and gradients bitwise."""
    gen = torch.Generator().manual_seed(21)
    limit, alpha = 7.0, 1.702
    h_inter = torch.randn(6, 10, generator=gen, dtype=torch.float64) * 6  # [gate0, up0, gate1, up1, ...]
    h_inter[0, :4] = torch.tensor([limit, -limit, 7.5, -7.5], dtype=torch.float64)
    h_inter = h_inter.requires_grad_(True)
    gate, up = h_inter[..., ::2].clamp(min=None, max=limit), h_inter[..., 1::2].clamp(min=-limit, max=limit)
    want = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    h_ours = torch.cat([h_inter[..., ::2], h_inter[..., 1::2]], dim=-1)
    got = ref.apply_activation(h_ours, "swiglu_oai")
    assert torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(*(torch.autograd.grad(o, h_inter, g)[0] for o in (got, want)))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_swiglu_oai_clamp_boundaries_in_kernels(dtype):
    """Pre-activations exactly at the limits pass the gradient (torch.clamp's rule), beyond them
    none; gate has no lower clamp. With w1 = [I | I] the pre-activation is x itself (exact), so
    dx shows the activation's gradient per element; the kernels match the reference there."""
    limit = 2.0
    vals = torch.tensor([limit, -limit, limit + 0.5, -limit - 0.5, limit - 0.25, -limit + 0.25, -9.0, 0.0])
    f = vals.numel()
    x = _leaf(vals.repeat(3, 1).to(DEV, dtype))
    eye = torch.eye(f, dtype=dtype, device=DEV)
    w1 = torch.cat([eye, eye], dim=1)[None]  # [1, f, 2f]: gate = up = x
    w2 = eye[None]
    offs = _offsets([3])
    y = tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu_oai", backend="triton", swiglu_limit=limit)
    y_ref = ref.grouped_ffn(x, offs, w1, w2, "swiglu_oai", swiglu_limit=limit)
    assert_close(y, y_ref, dtype, what="y")
    (dx,) = _grad(y, (x,), torch.ones_like(y))
    (dx_ref,) = _grad(y_ref, (x,), torch.ones_like(y))
    assert_close(dx, dx_ref, dtype, True, "dx")
    # gate = up = v: d/dv [(clamp(v) + 1) * min(v, L) * sigmoid(a * min(v, L))]; zero exactly where
    # both clamps cut (|v| > L with v > L for the gate; the gate never cuts below).
    assert not dx[0, 2].any()  # v = L + 0.5: both gate and up are cut
    assert dx[0, 0] != 0 and dx[0, 1] != 0  # at +-L the gradient passes
    assert dx[0, 3] != 0  # v = -L - 0.5: up cut, gate not (no lower clamp): d/dv flows through the gate


def test_fp64_reference_row_invariant_and_bias_grads_deferrable():
    """fp64 grouped_ffn with biases and the clamped SwiGLU: any row partition gives bitwise-equal
    rows and input gradients, and the bias gradients deferred to a WeightGradStore over two
    micro-ops equal the unpipelined ones bitwise (what the pipelined expert-parallel tests need)."""
    gen = torch.Generator().manual_seed(23)
    E, d, f = 3, 6, 5
    c0, c1 = [4, 0, 3], [2, 5, 1]
    x0 = torch.randn(sum(c0), d, generator=gen, dtype=torch.float64)
    x1 = torch.randn(sum(c1), d, generator=gen, dtype=torch.float64)
    w1 = torch.randn(E, d, 2 * f, generator=gen, dtype=torch.float64).requires_grad_(True)
    w2 = torch.randn(E, f, d, generator=gen, dtype=torch.float64).requires_grad_(True)
    b1 = torch.randn(E, 2 * f, generator=gen, dtype=torch.float64).requires_grad_(True)
    b2 = torch.randn(E, d, generator=gen, dtype=torch.float64).requires_grad_(True)
    kw = dict(swiglu_limit=1.0)
    # Unpipelined buffer in the pipeline's order: expert-major, micro-op 0's rows then micro-op 1's.
    o0, o1 = _offsets(c0, device="cpu"), _offsets(c1, device="cpu")
    parts = []
    for e in range(E):
        parts += [x0[o0[e]:o0[e + 1]], x1[o1[e]:o1[e + 1]]]
    x_all = torch.cat(parts).requires_grad_(True)
    offs_all = _offsets([a + b for a, b in zip(c0, c1)], device="cpu")
    y_all = ref.grouped_ffn(x_all, offs_all, w1, w2, "swiglu_oai", b1, b2, **kw)
    g_all = torch.randn(y_all.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(y_all, (x_all, w1, w2, b1, b2), g_all)

    store = WeightGradStore([w1, w2, b1, b2], 2)
    for i, (xi, ci) in enumerate(((x0, c0), (x1, c1))):
        # micro-op i's rows of expert e sit after micro-op 0's in the unpipelined buffer
        rows = torch.cat([int(offs_all[e]) + (c0[e] if i else 0) + torch.arange(ci[e]) for e in range(E)])
        xi = xi.clone().requires_grad_(True)
        yi = ref.grouped_ffn(xi, _offsets(ci, device="cpu"), w1, w2, "swiglu_oai", b1, b2, wgrad=store.slot(i), **kw)
        assert torch.equal(yi, y_all[rows])  # row invariance of the forward
        (dxi,) = torch.autograd.grad(yi, xi, g_all[rows])
        assert torch.equal(dxi, want[0][rows])  # ... and of the input gradient
    flushed = store.flush([torch.tensor([c0]), torch.tensor([c1])])
    for name, got, exp in zip(("dw1", "dw2", "db1", "db2"), flushed, want[1:]):
        assert got is not None and torch.equal(got, exp), name


# ---------------------------------------------------------------------------------------------
# Metadata: tile maps, the fused row space, the decode path's launches, grids
# ---------------------------------------------------------------------------------------------


def _model_tiles(offsets, R, BM):
    """The tile map by definition (module docstring of _grouped_gemm_kernels)."""
    E = len(offsets) - 1
    bounds = [(0, offsets[0], -1)] + [(offsets[e], offsets[e + 1], e) for e in range(E)] + [(offsets[E], R, -1)]
    tiles = []
    for lo, hi, e in bounds:
        tiles += [(e, r, hi) for r in range(lo, hi, BM)]
    return tiles


@settings(max_examples=30)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=9), head=st.integers(0, 20), tail=st.integers(0, 20),
       BM=st.sampled_from([16, 32, 64]), from_counts=st.booleans())
def test_tile_map_matches_definition(counts, head, tail, BM, from_counts):
    """Every row is in exactly one tile of its segment (zero tiles for the rows outside), the
    count is on the device and within the shape bound MT."""
    E = len(counts)
    if from_counts:  # fused layout: unrouted rows first, experts end at R
        tail = 0
    offsets = [head]
    for c in counts:
        offsets.append(offsets[-1] + c)
    R = offsets[-1] + tail
    if from_counts:
        src = torch.tensor(counts, dtype=torch.int32, device=DEV)
        offs_out = torch.full((E + 1,), -5, dtype=torch.int64, device=DEV)
        tm = K._build_tile_map(src, R, E, BM, from_counts=True, offsets_out=offs_out)
        assert offs_out.tolist() == offsets
    else:
        tm = K._build_tile_map(torch.tensor(offsets, device=DEV), R, E, BM)
    want = _model_tiles(offsets, R, BM)
    assert tm.bound == K.tile_bound(R, E, BM) >= len(want)
    n = int(tm.count)
    assert [tuple(t) for t in tm.tiles[:n].tolist()] == want


def test_tile_map_of_invalid_offsets_stays_in_the_row_space():
    """Offsets that are not monotone or pass R (value checks off) give tiles inside [0, R) only."""
    offs = torch.tensor([3, 40, 10, 12, 500], device=DEV)
    R = 30
    tm = K._build_tile_map(offs, R, 4, 16)
    n = int(tm.count)
    assert 0 < n <= tm.bound
    t = tm.tiles[:n]
    assert (t[:, 1] >= 0).all() and (t[:, 1] < R).all() and (t[:, 2] <= R).all() and (t[:, 1] < t[:, 2]).all()


@pytest.mark.parametrize("decode", [False, True])
def test_route_rows_example_and_reference_order(decode):
    ids = torch.tensor([[1, 0], [1, 2], [-1, 1]], device=DEV, dtype=torch.int32)
    counts = torch.tensor([1, 3, 1], device=DEV, dtype=torch.int32)
    space = K.route_rows(ids, counts, 3, 16, decode=decode)
    assert space.offsets.tolist() == [1, 2, 5, 6]
    assert space.row_map.tolist() == [4, 1, 0, 2, 5, 3]
    assert [tuple(t) for t in space.maps[16].tiles[: int(space.maps[16].count)].tolist()] == \
        [(-1, 0, 1), (0, 1, 2), (1, 2, 5), (2, 5, 6)]
    # Inside each expert, the order of the reference's permute (token, then slot).
    gen = torch.Generator().manual_seed(19)
    r = _routing(23, 6, 3, gen, 0.25)
    space = K.route_rows(r.topk_ids, r.counts, 6, 32, decode=decode)
    _, info = ref.permute(torch.zeros(23, 1, device=DEV), r.topk_ids, 6)
    head = int(space.offsets[0])
    assert head == int((r.topk_ids < 0).sum())
    assert torch.equal(space.offsets - head, info.expert_offsets)
    rows_of_slot = torch.empty_like(space.row_map)
    rows_of_slot[space.row_map] = torch.arange(space.row_map.numel(), device=DEV)
    routed = info.slot_rows.reshape(-1) >= 0
    assert torch.equal(rows_of_slot[routed] - head, info.slot_rows.reshape(-1)[routed])
    assert (rows_of_slot[~routed] < head).all()


# Aten ops that move no data (allocation, views): anything else would be a launch on a GPU.
_FREE_OPS = {"empty", "empty_strided", "view", "_reshape_alias", "as_strided", "alias", "detach", "t", "transpose",
             "select", "slice", "expand", "unsqueeze", "squeeze", "permute", "_unsafe_view", "lift_fresh"}


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_launches(monkeypatch):
    """(Triton launches by kernel name, aten ops that move data) inside the block."""
    launches = []
    for name in dir(GK):
        fn = getattr(GK, name)
        if name.endswith("_kernel") and hasattr(fn, "run"):
            monkeypatch.setattr(fn, "run", _counting(fn.run, name, launches))
    log = _OpLog()
    with log:
        yield launches, log.ops


def _counting(run, name, launches):
    def wrapped(*args, **kwargs):
        launches.append(name)
        with _disable_current_modes():  # the interpreter's own host copies are not the op's
            return run(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("k,decode,want", [
    (4, True, ["_decode_meta_kernel", "_grouped_mm_kernel", "_grouped_mm_kernel", "_combine_kernel"]),
    (4, False, ["_tile_map_kernel", "_grouped_mm_kernel", "_grouped_mm_kernel", "_combine_kernel"]),
])
def test_moe_ffn_forward_launches(monkeypatch, k, decode, want):
    """The fused forward is its kernels and nothing else: the decode path four Triton launches and
    no torch op that moves data (it was ~15 small torch ops besides the GEMMs); the prefill path
    one stable sort more. Inference with biases and the clamped SwiGLU, T = 3."""
    gen = torch.Generator().manual_seed(25)
    E, d, f = 8, 32, 16
    r = _routing(3, E, k, gen)
    x = _randn((3, d), torch.float32, gen)
    w1, w2 = _weights(E, d, f, "swiglu_oai", torch.float32, gen)
    b1, b2 = _biases(E, 2 * f, d, torch.float32, gen)
    with torch.no_grad(), CF.override("ffn.decode", decode), _count_launches(monkeypatch) as (launches, ops):
        KF.moe_ffn(x, r, w1, w2, "swiglu_oai", b1, b2)
    moving = [op for op in ops if op not in _FREE_OPS]
    assert launches == want
    assert moving == ([] if decode else ["sort"]), moving


def test_grid_covers_active_experts_only(monkeypatch):
    """Decode with many experts: the GEMM grids are sized by the experts that can be active
    (min(E, T*k)), not E x N tiles of programs that exit at once."""
    grids = []
    orig = C.launch

    def record(kernel, grid, cfg, *a, **kw):
        grids.append((kernel.__name__ if hasattr(kernel, "__name__") else str(kernel), grid[0], cfg))
        return orig(kernel, grid, cfg, *a, **kw)

    monkeypatch.setattr(C, "launch", record)
    monkeypatch.setattr(C, "max_programs", lambda *a: 10**9)  # no cap: the bound alone
    gen = torch.Generator().manual_seed(27)
    E, T, k, d, f = 64, 2, 2, 32, 48
    r = _routing(T, E, k, gen)
    x = _randn((T, d), torch.float32, gen)
    w1, w2 = _weights(E, d, f, "swiglu", torch.float32, gen)
    with torch.no_grad(), CF.override("ffn.decode", True):
        KF.moe_ffn(x, r, w1, w2)
    assert len(grids) == 2
    assert grids[1][2].SPLIT_K == 2  # the interpreter's decode config splits GEMM2's 48-deep K
    for (_, grid, cfg), n in zip(grids, (f, d)):
        items_per_tile = triton.cdiv(n, cfg.BN) * cfg.SPLIT_K
        assert grid <= min(E, T * k) * items_per_tile, (grid, cfg)  # was (cdiv(T*k, BM) + E) x N tiles


def test_decode_policy_on_sm90(monkeypatch):
    """select_decode's documented choices for an H100/H200 (132 SMs): an expert's rows in one M
    tile; K split for Mixtral-like T=1 (2 active experts), not for DeepSeek-V3-like T=1."""
    monkeypatch.setattr(C, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(C, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    bf16 = torch.bfloat16
    sel = dict(dtype=bf16, tf32=False, device=dev)
    mix = C.select_decode("mm", tokens=1, top_k=2, n=4096, k=14336, num_experts=8, **sel)
    assert (mix.BM, mix.BN, mix.SPLIT_K) == (16, 64, 4)
    ds = C.select_decode("mm", tokens=1, top_k=8, n=7168, k=2048, num_experts=256, **sel)
    assert ds.SPLIT_K == 1 and 8 * math.ceil(7168 / ds.BN) >= 2 * 132
    g1 = C.select_decode("swiglu", tokens=64, top_k=8, n=2048, k=7168, num_experts=256, **sel)
    # 2 rows per expert on average: 16-row tiles (4x skew fits one tile), not 64
    assert g1.BM == 16 and g1.SPLIT_K == 1 and C._smem_bytes(g1, g1.num_stages, 2, True) <= 160 * 1024
    for T in (1, 8, 64):  # Qwen3-30B-A3B-like (E=128, k=8, d=2048, f=768): about T/16 rows per expert
        for kind, n, kk in (("swiglu", 768, 2048), ("mm", 2048, 768)):
            q = C.select_decode(kind, tokens=T, top_k=8, n=n, k=kk, num_experts=128, **sel)
            assert q.BM == 16 and C._smem_bytes(q, q.num_stages, 2, kind == "swiglu") <= 160 * 1024, (T, q)
    # Mixtral-like at T=64: 16 rows per expert on average, a 64-row tile covers the skew
    assert C.select_decode("swiglu", tokens=64, top_k=2, n=14336, k=4096, num_experts=8, **sel).BM == 64
    assert [C.decode_bm(T, 2, 8) for T in (1, 8, 16, 32, 64)] == [16, 16, 16, 32, 64]
    assert C.decode_path(64, 8) and not C.decode_path(65, 8) and not C.decode_path(0, 8)
    with CF.override("ffn.decode", True):
        assert C.decode_path(500, 8) and not C.decode_path(600, 8)  # 4800 slots: more than one program sorts


def test_config_override_changes_tiles_not_results():
    gen = torch.Generator().manual_seed(17)
    counts = [30, 3, 0, 31]
    offs = _offsets(counts)
    x = _randn((sum(counts), 40), torch.float32, gen)
    w1, w2 = _weights(4, 40, 24, "swiglu", torch.float32, gen)
    y_ref = ref.grouped_ffn(x, offs, w1, w2)
    with CF.override("gemm", C.TileConfig(BM=32, BN=32, BK=32, GROUP_M=1)):
        cfg = C.select("mm", rows=64, n=48, k=40, num_experts=4, dtype=torch.float32, tf32=False,
                       device=torch.device(DEV))
        assert (cfg.BM, cfg.BN, cfg.BK) == (16, 32, 32)  # BM clamped to the rows per expert
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
    assert_close(y, y_ref, torch.float32, what="y")
    with pytest.raises(ValueError, match="power of two"):
        C.TileConfig(BM=48, BN=16, BK=16)
    with pytest.raises(ValueError, match="SPLIT_K"):
        C.TileConfig(BM=16, BN=16, BK=16, SPLIT_K=0)
    with pytest.raises(ValueError, match="unknown config target 'gemm.bogus'"):
        with CF.override("gemm.bogus", C.TileConfig(16, 16, 16)):
            pass
    with pytest.raises(TypeError, match="bool"):
        with CF.override("ffn.decode", 1):
            pass


def test_autotune_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert not C.autotune_enabled(cpu)  # never in the interpreter
    if HAS_CUDA:
        cuda = torch.device("cuda")
        monkeypatch.setenv("TRITONMOE_AUTOTUNE", "0")
        assert not C.autotune_enabled(cuda)
        monkeypatch.setenv("TRITONMOE_AUTOTUNE", "1")
        assert C.autotune_enabled(cuda)
    monkeypatch.setenv("TRITONMOE_AUTOTUNE", "maybe")
    if HAS_CUDA:
        with pytest.raises(ValueError, match="TRITONMOE_AUTOTUNE"):
            C.autotune_enabled(torch.device("cuda"))


# ---------------------------------------------------------------------------------------------
# MoELayer path choice
# ---------------------------------------------------------------------------------------------


def test_layer_ffn_path_is_visible_and_paths_agree():
    cfg_f = tritonmoe.MoEConfig(d_model=16, d_ffn=8, num_experts=4, top_k=2, backend="triton", ffn_path="auto")
    layer_f = tritonmoe.MoELayer(cfg_f, device=DEV)
    assert layer_f.ffn_path_used is None
    cfg_u = tritonmoe.MoEConfig(d_model=16, d_ffn=8, num_experts=4, top_k=2, backend="torch", ffn_path="auto")
    layer_u = tritonmoe.MoELayer(cfg_u, device=DEV)
    layer_u.load_state_dict(layer_f.state_dict())
    x = torch.randn(11, 16, device=DEV)
    routing = ref.route(layer_f.router(x), 2)
    out_f = layer_f.expert_path(x, routing, layer_f.expert_weights())
    out_u = layer_u.expert_path(x, routing, layer_u.expert_weights())
    assert layer_f.ffn_path_used == "fused" and layer_u.ffn_path_used == "unfused"
    assert_close(out_f, out_u, torch.float32, what="layer fused vs unfused")
    forced = tritonmoe.MoELayer(
        tritonmoe.MoEConfig(d_model=16, d_ffn=8, num_experts=4, top_k=2, backend="torch", ffn_path="fused"), device=DEV
    )
    forced.load_state_dict(layer_f.state_dict())
    assert_close(forced(x), layer_u(x), torch.float32, what="layer forced fused")
    assert forced.ffn_path_used == "fused"
    with pytest.raises(ValueError, match="ffn_path"):
        tritonmoe.MoEConfig(d_model=16, d_ffn=8, num_experts=4, top_k=2, ffn_path="fast")


# ---------------------------------------------------------------------------------------------
# Validation before launch
# ---------------------------------------------------------------------------------------------


def _bad_gemm_cases():
    x = torch.zeros(6, 8, device=DEV)
    w = torch.zeros(2, 8, 4, device=DEV)
    good = _offsets([2, 4])
    return [
        ("offsets not monotone", (x, torch.tensor([0, 7, 6], device=DEV), w), ValueError, "not monotone"),
        ("offsets[E] > R", (x, _offsets([2, 5]), w), ValueError, r"offsets\[E\]"),
        ("expert count != E", (x, good, torch.zeros(3, 8, 4, device=DEV)), ValueError, "E\\+1"),
        ("K mismatch", (x, good, torch.zeros(2, 9, 4, device=DEV)), ValueError, "inner dimensions"),
        ("dtype mix", (x, good, w.half()), TypeError, "one dtype"),
        ("float offsets", (x, good.float(), w), TypeError, "integer"),
    ]


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test: errors must come from validation, before launching."""

    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid inputs")

    for name in ("_mm", "_dact", "_wgrad", "_combine", "_colsum", "_dgate", "route_rows", "_build_tile_map"):
        monkeypatch.setattr(K, name, boom)


@pytest.mark.parametrize("case", _bad_gemm_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise_before_launch(case, no_launch):
    _, args, exc, match = case
    with pytest.raises(exc, match=match):
        tritonmoe.grouped_gemm(*args, backend="triton")
    x, offs, w = args
    w2 = torch.zeros(w.shape[0], w.shape[2], x.shape[1], device=DEV, dtype=w.dtype)
    with pytest.raises(exc, match=match):
        tritonmoe.grouped_ffn(x, offs, w, w2, "relu", backend="triton")


def test_bad_biases_and_activation_options_raise_before_launch(no_launch):
    x = torch.zeros(6, 8, device=DEV)
    offs = _offsets([2, 4])
    w1 = torch.zeros(2, 8, 10, device=DEV)
    w2 = torch.zeros(2, 5, 8, device=DEV)
    with pytest.raises(ValueError, match=r"bias has shape \(2, 3\); expected \[2, 10\]"):
        tritonmoe.grouped_gemm(x, offs, w1, torch.zeros(2, 3, device=DEV), backend="triton")
    with pytest.raises(TypeError, match="bias is torch.float16"):
        tritonmoe.grouped_gemm(x, offs, w1, torch.zeros(2, 10, device=DEV).half(), backend="triton")
    with pytest.raises(ValueError, match=r"b1 has shape \(2, 5\); expected \[2, 10\]"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", torch.zeros(2, 5, device=DEV), backend="triton")
    with pytest.raises(ValueError, match=r"b2 has shape \(3, 8\); expected \[2, 8\]"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu_oai", None, torch.zeros(3, 8, device=DEV), backend="triton")
    with pytest.raises(TypeError, match="b1 must be a torch.Tensor"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", [0.0], backend="triton")
    with pytest.raises(TypeError, match="swiglu_limit must be a real number"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu_oai", swiglu_limit="7", backend="triton")
    with pytest.raises(ValueError, match="swiglu_alpha=nan must be finite"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu_oai", swiglu_alpha=float("nan"), backend="triton")
    with pytest.raises(ValueError, match="swiglu_limit=0.0 must be > 0"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu_oai", swiglu_limit=0.0, backend="triton")
    with pytest.raises(ValueError, match="only apply to activation='swiglu_oai'"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", swiglu_limit=3.0, backend="triton")
    with pytest.raises(ValueError, match="'swiglu_oai'"):
        tritonmoe.grouped_ffn(x, offs, w1, w2, "silu", backend="triton")


def test_bad_moe_inputs_raise_before_launch(no_launch):
    gen = torch.Generator().manual_seed(23)
    r = _routing(5, 4, 2, gen)
    x = torch.zeros(5, 8, device=DEV)
    w1, w2 = _weights(4, 8, 6, "swiglu", torch.float32, gen)
    with pytest.raises(ValueError, match="num_experts=4"):
        tritonmoe.moe_ffn(x, r, w1[:3], w2[:3], backend="triton")
    with pytest.raises(ValueError, match="tokens"):
        tritonmoe.moe_ffn(x[:4], r, w1, w2, backend="triton")
    with pytest.raises(ValueError, match="d=7"):
        tritonmoe.moe_ffn(torch.zeros(5, 7, device=DEV), r, w1, w2, backend="triton")
    with pytest.raises(TypeError, match="one dtype"):
        tritonmoe.moe_ffn(x.half(), r, w1, w2, backend="triton")
    with pytest.raises(ValueError, match="output columns"):
        tritonmoe.moe_ffn(x, r, w1, w2, "gelu", backend="triton")
    with pytest.raises(ValueError, match=r"b2 has shape \(4, 7\)"):
        tritonmoe.moe_ffn(x, r, w1, w2, "swiglu", None, torch.zeros(4, 7, device=DEV), backend="triton")
    bad = ref.route(torch.randn(5, 4, device=DEV), 2)
    bad.topk_ids[1, 0] = 4
    with pytest.raises(IndexError, match="outside"):
        tritonmoe.moe_ffn(x, bad, w1, w2, backend="triton")
    stale = ref.route(torch.randn(5, 4, device=DEV), 2)
    stale.topk_ids[0, 0] = -1  # dropped without updating the counts
    with pytest.raises(ValueError, match=r"routing.counts\[\d\]=\d but \d slots"):
        tritonmoe.moe_ffn(x, stale, w1, w2, backend="triton")
    with pytest.raises(TypeError, match="Routing"):
        tritonmoe.moe_ffn(x, (r.topk_ids, r.topk_weights), w1, w2, backend="triton")


# ---------------------------------------------------------------------------------------------
# GPU (bf16, real tiles, autotuning)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("T", [700, 40])  # prefill-like and the decode path
def test_gpu_moe_ffn_matches_reference(dtype, activation, T):
    gen = torch.Generator().manual_seed(29)
    E, k, d, f = 8, 2, 256, 352
    r = _routing(T, E, k, gen, 0.05)
    x = _leaf(_randn((T, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, "transposed"))
    b1, b2 = (_leaf(b) for b in _biases(E, w1.shape[2], d, dtype, gen))
    out = tritonmoe.moe_ffn(x, r, w1, w2, activation, b1, b2, backend="triton")
    out_ref = ref.moe_ffn(x, r, w1, w2, activation, b1, b2)
    assert_close(out, out_ref, dtype, what="out")
    g = _randn(out.shape, dtype, gen)
    inputs = (x, r.topk_weights, w1, w2, b1, b2)
    for name, a, b in zip(("dx", "dgate", "dw1", "dw2", "db1", "db2"), _grad(out, inputs, g),
                          _grad(out_ref, inputs, g)):
        assert_close(a, b, dtype, True, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows_per_expert", [4, 96, 600])
def test_gpu_grouped_ffn_configs(dtype, rows_per_expert):
    """The sm90 decode / mid / large configs (and their autotuned schedules) against the
    reference, with Zipf-like skew."""
    gen = torch.Generator().manual_seed(31)
    E, d, f = 8, 512, 768
    counts = [max(0, int(rows_per_expert * E / (i + 1) / 2.7)) for i in range(E)]
    counts[3] = 0
    offs = _offsets(counts)
    x = _leaf(_randn((sum(counts), d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, "swiglu", dtype, gen))
    y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
    y_ref = ref.grouped_ffn(x, offs, w1, w2)
    assert_close(y, y_ref, dtype, what="y")
    g = _randn(y.shape, dtype, gen)
    for name, a, b in zip(("dx", "dw1", "dw2"), _grad(y, (x, w1, w2), g),
                          _grad(y_ref, (x, w1, w2), g)):
        assert_close(a, b, dtype, True, name)


def test_weight_grad_store_flush_without_deferred_rows_reads_no_counts():
    """The W step of a pass whose GEMMs computed their own weight gradients (the kernels' path:
    nothing deferred) reads no counts back: on a GPU, reading them is a host sync per micro-op."""
    from tritonmoe.core.exact import WeightGradStore

    class NoRead:
        def tolist(self):
            raise AssertionError("flush read the counts although nothing was deferred")

    w = torch.zeros(2, 3, 4, requires_grad=True)
    store = WeightGradStore([w], 3)
    assert store.flush([NoRead()] * 3) == [None]
