"""Triton grouped expert FFN (kernels/grouped_gemm.py) against tritonmoe.reference.

On CPU the kernels run in Triton's interpreter (fp16/fp32 only: the interpreter's bf16 dot is
broken), with its small 16x16x16 tiles so that tiny shapes still span several tiles, partial
tiles and a K remainder; on CUDA the ``gpu`` tests add bf16 and larger shapes.

Tolerances are max |error| over max |reference|, per dtype: fp32 agrees to fp32 summation order
(~1e-6), fp16 to a few roundings of 2^-11. A wrong row, expert or slot is an O(1) error, which
``test_tolerance_catches_swapped_experts`` checks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe
from tritonmoe import reference as ref
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import grouped_gemm as K

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
ACTS = ("swiglu", "gelu", "relu")
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
    n1 = 2 * f if activation == "swiglu" else f
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


def _leaf(t):
    """A leaf that requires grad, with t's strides (the tests' tensors are fresh, nothing aliases)."""
    return t.detach().requires_grad_(True)


def _grad(out, inputs, g):
    """Gradients of <out, g>; an input the graph never used (every slot dropped) gets zeros."""
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    return tuple(torch.zeros_like(t) if d is None else d for t, d in zip(inputs, grads))


# ---------------------------------------------------------------------------------------------
# Hypothesis: grouped_gemm, grouped_ffn, moe_ffn against the reference (>= 50 examples in all)
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


@settings(max_examples=16)
@given(
    counts=ragged_counts(),
    k=st.integers(1, 48),
    n=st.integers(1, 48),
    dtype=st.sampled_from(CPU_DTYPES),
    off_dtype=st.sampled_from([torch.int32, torch.int64]),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_matches_reference(counts, k, n, dtype, off_dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts, off_dtype)
    x = _leaf(_randn((R, k), dtype, gen))
    w, _ = _weights(E, k, n, "relu", dtype, gen, layout)
    w = _leaf(w)
    y = tritonmoe.grouped_gemm(x, offs, w, backend="triton")
    y_ref = ref.grouped_gemm(x, offs, w)
    assert_close(y, y_ref, dtype, what="y")
    if R:
        g = _randn(y.shape, dtype, gen)
        dx, dw = _grad(y, (x, w), g)
        dx_ref, dw_ref = _grad(y_ref, (x, w), g)
        assert_close(dx, dx_ref, dtype, True, "dx")
        assert_close(dw, dw_ref, dtype, True, "dw")


@settings(max_examples=26)
@given(
    counts=ragged_counts(),
    d=st.integers(1, 40),
    f=st.integers(1, 24),
    activation=st.sampled_from(ACTS),
    dtype=st.sampled_from(CPU_DTYPES),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    mode=st.sampled_from(C.PREACT_MODES),
    seed=st.integers(0, 2**16),
)
def test_grouped_ffn_matches_reference(counts, d, f, activation, dtype, layout, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, layout))
    with C.preact_mode(mode):
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, backend="triton")
        y_ref = ref.grouped_ffn(x, offs, w1, w2, activation)
        assert_close(y, y_ref, dtype, what="y")
        if R:
            g = _randn(y.shape, dtype, gen)
            got = _grad(y, (x, w1, w2), g)
            want = _grad(y_ref, (x, w1, w2), g)
            for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
                assert_close(a, b, dtype, True, name)


def _routing(T, E, k, gen, drop_frac=0.0):
    """Reference routing of random logits; a fraction of slots dropped (id -1, weight 0) as
    capacity would; differentiable weights."""
    logits = torch.randn(T, E, generator=gen).to(DEV)
    r = ref.route(logits, k)
    if drop_frac and T:
        drop = (torch.rand(T, k, generator=gen) < drop_frac).to(DEV)
        r.topk_ids = torch.where(drop, torch.full_like(r.topk_ids, -1), r.topk_ids)
        r.topk_weights = torch.where(drop, torch.zeros_like(r.topk_weights), r.topk_weights)
    r.topk_weights = r.topk_weights.detach().requires_grad_(True)
    return r


@settings(max_examples=22)
@given(
    T=st.integers(0, 20),
    E=st.integers(1, 7),
    kk=st.integers(1, 7),
    d=st.integers(1, 40),
    f=st.integers(1, 24),
    activation=st.sampled_from(ACTS),
    dtype=st.sampled_from(CPU_DTYPES),
    drop=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_moe_ffn_matches_reference_and_unfused(T, E, kk, d, f, activation, dtype, drop, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    k = min(kk, E)
    r = _routing(T, E, k, gen, drop)
    x = _randn((T, d), dtype, gen)
    # Poison: tokens with no routed slot are never read, so NaN there must not leak anywhere.
    unrouted_T = (r.topk_ids < 0).all(dim=1)
    x[unrouted_T] = float("nan")
    x = _leaf(x)
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, layout))
    out = tritonmoe.moe_ffn(x, r, w1, w2, activation, backend="triton")
    out_ref = ref.moe_ffn(x, r, w1, w2, activation)
    assert_close(out, out_ref, dtype, what="out")
    assert not out[unrouted_T].any()

    # The fused path against the unfused Triton path (permute -> grouped_ffn -> unpermute).
    x_perm, info = ref.permute(x, r.topk_ids, E)
    y_perm = tritonmoe.grouped_ffn(x_perm, info.expert_offsets, w1, w2, activation, backend="triton")
    out_unfused = ref.unpermute(y_perm, info, r.topk_weights)
    assert_close(out, out_unfused, dtype, what="fused vs unfused")

    if T:
        g = _randn(out.shape, dtype, gen)
        inputs = (x, r.topk_weights, w1, w2)
        got = _grad(out, inputs, g)
        want = _grad(out_ref, inputs, g)
        unfused = _grad(out_unfused, inputs, g)
        for name, a, b, c in zip(("dx", "dgate", "dw1", "dw2"), got, want, unfused):
            assert_close(a, b, dtype, True, name)
            assert_close(a, c, dtype, True, name + " fused vs unfused")
        assert not got[0][unrouted_T].any()


# ---------------------------------------------------------------------------------------------
# Named edge cases
# ---------------------------------------------------------------------------------------------

# (why, counts, d, f): each exercises one corner of the tile map.
EDGE_CASES = [
    ("R=0: no rows at all", [0, 0, 0], 16, 8),
    ("one expert holds every row", [0, 45, 0, 0], 20, 12),
    ("empty experts between full ones", [17, 0, 0, 16, 0], 16, 16),
    ("prime E, segments shorter than a tile", [1, 2, 0, 3, 5, 1, 0], 24, 10),
    ("single row", [0, 1], 7, 5),
    ("K and N not multiples of the tile", [19, 23], 33, 17),
]


@pytest.mark.parametrize("why,counts,d,f", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_grouped_ffn_edge_cases(why, counts, d, f, dtype):
    gen = torch.Generator().manual_seed(len(counts) * 100 + d)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, "swiglu", dtype, gen))
    y = tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", backend="triton")
    y_ref = ref.grouped_ffn(x, offs, w1, w2, "swiglu")
    assert_close(y, y_ref, dtype, what="y")
    g = _randn(y.shape, dtype, gen)
    got = _grad(y, (x, w1, w2), g)
    # The reference's output has no graph without rows (its gradients are zero).
    want = _grad(y_ref, (x, w1, w2), g) if R else tuple(torch.zeros_like(t) for t in (x, w1, w2))
    for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
        assert_close(a, b, dtype, True, name)
    for e, c in enumerate(counts):  # an empty expert's weight gradient is exactly zero
        if c == 0:
            assert not got[1][e].any() and not got[2][e].any()


MOE_CASES = [
    ("zero tokens", 0, 4, 2),
    ("one token", 1, 4, 2),
    ("k = E", 9, 3, 3),
    ("prime E, k=1 (direct weighted write)", 11, 5, 1),
    ("all tokens on one expert", 13, 4, 1),
]


@pytest.mark.parametrize("why,T,E,k", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_ffn_edge_cases(why, T, E, k):
    dtype = torch.float32
    gen = torch.Generator().manual_seed(T * 7 + E)
    r = _routing(T, E, k, gen)
    if why == "all tokens on one expert":
        r.topk_ids = torch.full_like(r.topk_ids, 2)
    x = _leaf(_randn((T, 12), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, 12, 9, "swiglu", dtype, gen))
    out = tritonmoe.moe_ffn(x, r, w1, w2, backend="triton")
    out_ref = ref.moe_ffn(x, r, w1, w2)
    assert_close(out, out_ref, dtype, what="out")
    if T:
        g = _randn(out.shape, dtype, gen)
        inputs = (x, r.topk_weights, w1, w2)
        for name, a, b in zip(("dx", "dgate", "dw1", "dw2"), _grad(out, inputs, g),
                              _grad(out_ref, inputs, g)):
            assert_close(a, b, dtype, True, name)


def test_rows_past_offsets_end_are_zero():
    """Rows at or past offsets[E] (allowed with validation off) come out zero, even when x holds
    NaN there, and get zero gradient."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32
    counts = [5, 0, 12]
    R = sum(counts) + 21
    offs = _offsets(counts)
    x = _randn((R, 20), dtype, gen)
    x[sum(counts):] = float("nan")
    x = _leaf(x)
    w1, w2 = (_leaf(w) for w in _weights(3, 20, 10, "gelu", dtype, gen))
    with tritonmoe.validation(False):
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, "gelu", backend="triton")
        z = tritonmoe.grouped_gemm(x, offs, w1, backend="triton")
    assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))
    assert torch.equal(z[sum(counts):], torch.zeros_like(z[sum(counts):]))
    x_ok = x[: sum(counts)].detach()
    assert_close(y[: sum(counts)], ref.grouped_ffn(x_ok, offs, w1, w2, "gelu"), dtype, what="y")
    (dx,) = _grad(y, (x,), torch.ones_like(y))
    assert not dx[sum(counts):].any()


def test_padding_rows_stay_zero():
    """Segments padded by permute(pad_to=16) (zero rows inside segments) give zero outputs."""
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
    x = base.t().requires_grad_(False)  # [R, 24] with strides (1, R)
    x = x.detach().requires_grad_(True)
    w1, w2 = (_leaf(w) for w in _weights(3, 24, 12, "relu", torch.float32, gen, "transposed"))
    y = tritonmoe.grouped_ffn(x, offs, w1, w2, "relu", backend="triton")
    y_ref = ref.grouped_ffn(x, offs, w1, w2, "relu")
    assert_close(y, y_ref, torch.float32, what="y")
    g = _randn(y.shape, torch.float32, gen).t().contiguous().t()  # non-contiguous gradient too
    for name, a, b in zip(("dx", "dw1", "dw2"), _grad(y, (x, w1, w2), g),
                          _grad(y_ref, (x, w1, w2), g)):
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
    pre-activation gives bitwise-equal gradients."""
    gen = torch.Generator().manual_seed(13)
    T, E, k = 17, 5, 2
    r = _routing(T, E, k, gen, 0.2)
    x = _leaf(_randn((T, 20), torch.float16, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, 20, 12, "swiglu", torch.float16, gen))
    g = _randn((T, 20), torch.float16, gen)
    results = []
    for mode in ("save", "save", "recompute"):
        with C.preact_mode(mode):
            out = tritonmoe.moe_ffn(x, r, w1, w2, backend="triton")
            results.append((out, *_grad(out, (x, r.topk_weights, w1, w2), g)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_config_override_changes_tiles_not_results():
    gen = torch.Generator().manual_seed(17)
    counts = [30, 3, 0, 31]
    offs = _offsets(counts)
    x = _randn((sum(counts), 40), torch.float32, gen)
    w1, w2 = _weights(4, 40, 24, "swiglu", torch.float32, gen)
    y_ref = ref.grouped_ffn(x, offs, w1, w2)
    with C.override(C.TileConfig(BM=32, BN=32, BK=32, GROUP_M=1)):
        cfg = C.select("mm", rows=64, n=48, k=40, num_experts=4, dtype=torch.float32, tf32=False,
                       device=torch.device(DEV))
        assert (cfg.BM, cfg.BN, cfg.BK) == (16, 32, 32)  # BM clamped to the rows per expert
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
    assert_close(y, y_ref, torch.float32, what="y")
    with pytest.raises(ValueError, match="power of two"):
        C.TileConfig(BM=48, BN=16, BK=16)
    with pytest.raises(ValueError, match="unknown GEMM kind"):
        with C.override(bogus=C.TileConfig(16, 16, 16)):
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


def test_route_rows_matches_reference_permute():
    ids = torch.tensor([[1, 0], [1, 2], [-1, 1]], device=DEV)
    offs, row_map = K.route_rows(ids, 3)
    assert offs.tolist() == [0, 1, 4, 5]
    assert row_map.tolist() == [1, 0, 2, 5, 3, 4]
    gen = torch.Generator().manual_seed(19)
    r = _routing(23, 6, 3, gen, 0.25)
    offs, row_map = K.route_rows(r.topk_ids, 6)
    _, info = ref.permute(torch.zeros(23, 1, device=DEV), r.topk_ids, 6)
    assert torch.equal(offs, info.expert_offsets)
    routed = info.slot_rows.reshape(-1) >= 0
    rows_of_slot = torch.empty_like(row_map)
    rows_of_slot[row_map] = torch.arange(row_map.numel(), device=DEV)
    assert torch.equal(rows_of_slot[routed], info.slot_rows.reshape(-1)[routed])


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
        ("offsets[E] != R", (x, _offsets([2, 3]), w), ValueError, r"offsets\[E\]"),
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

    for name in ("_mm", "_dact", "_wgrad", "_combine"):
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
    bad = ref.route(torch.randn(5, 4, device=DEV), 2)
    bad.topk_ids[1, 0] = 4
    with pytest.raises(IndexError, match="outside"):
        tritonmoe.moe_ffn(x, bad, w1, w2, backend="triton")
    with pytest.raises(TypeError, match="Routing"):
        tritonmoe.moe_ffn(x, (r.topk_ids, r.topk_weights), w1, w2, backend="triton")


# ---------------------------------------------------------------------------------------------
# GPU (bf16, real tiles, autotuning)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_moe_ffn_matches_reference(dtype, activation):
    gen = torch.Generator().manual_seed(29)
    T, E, k, d, f = 700, 8, 2, 256, 352
    r = _routing(T, E, k, gen, 0.05)
    x = _leaf(_randn((T, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, "transposed"))
    out = tritonmoe.moe_ffn(x, r, w1, w2, activation, backend="triton")
    out_ref = ref.moe_ffn(x, r, w1, w2, activation)
    assert_close(out, out_ref, dtype, what="out")
    g = _randn(out.shape, dtype, gen)
    inputs = (x, r.topk_weights, w1, w2)
    for name, a, b in zip(("dx", "dgate", "dw1", "dw2"), _grad(out, inputs, g),
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
