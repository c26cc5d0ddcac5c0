"""The persistent TMA grouped GEMM (kernels/_grouped_gemm_persistent*.py) against tritonmoe.reference.

Every test runs the public ops with the config policy switched to ``variant="persistent"``
(``_gemm_config.override``), on the case tables of ``test_kernels_ffn.py``, and checks through a
spy that the persistent kernel served the forward GEMMs (and the dX GEMM) and which operands went
through tensor descriptors. On CPU the kernels run in Triton's interpreter, which emulates the
descriptors (bounds, zero fill, 16-byte alignment asserts), in fp16/fp32. Case shapes mix
dimensions that are multiples of 8 (TMA-eligible in fp16: 16-byte strides) with unaligned ones
(the same kernel's pointer path).

What the TMA path must get right, and where it is tested: the M tail of each expert segment
(loads past a segment's end read the next segment's rows, stores past it must be dropped:
``test_segment_tails_and_poisoned_rows``), rows past offsets[E] (zeros, NaN input there), K and N
tails (zero fill at the tensor bounds; the SwiGLU up half must not be read as gate columns), and
weights that are strided views of NaN-filled storage.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_ffn import (
    ACTS,
    CPU_DTYPES,
    DEV,
    EDGE_CASES,
    MOE_CASES,
    _grad,
    _leaf,
    _offsets,
    _randn,
    _routing,
    _weights,
    assert_close,
    ragged_counts,
)

import tritonmoe
from tritonmoe import reference as ref
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import _grouped_gemm_persistent as P
from tritonmoe.kernels import grouped_gemm as K

#: The activations the persistent kernel has an epilogue for (swiglu_oai runs the tile kernel).
PERSISTENT_ACTS = [a for a in ACTS if a != "swiglu_oai"]
PERSISTENT = dataclasses.replace(C.INTERPRETER_CONFIG, variant="persistent") if DEV == "cpu" else None


class Spy:
    """Records every persistent launch (with its operand access) and every tile-kernel launch of
    the forward GEMM kernel."""

    def __init__(self, monkeypatch):
        self.persistent: list[P.Access] = []
        self.tile = 0
        self.wide = 0  # persistent launches with one [BM, 2*BN] SwiGLU accumulator
        real_access, real_launch = P.access, C.launch

        def access(*args, **kwargs):
            acc = real_access(*args, **kwargs)
            self.persistent.append(acc)
            return acc

        def launch(kernel, *args, **kwargs):
            if kernel is K._grouped_mm_kernel:
                self.tile += 1
            self.wide += int(bool(kwargs.get("GLU_WIDE")))
            return real_launch(kernel, *args, **kwargs)

        monkeypatch.setattr(P, "access", access)
        monkeypatch.setattr(C, "launch", launch)


@contextlib.contextmanager
def persistent(cfg=None):
    """Inside the block the policy's configs have variant="persistent" (on CPU the interpreter's
    16x16x16, or ``cfg``); yields a :class:`Spy` of the launches."""
    with pytest.MonkeyPatch.context() as mp:
        spy = Spy(mp)
        if DEV == "cpu":
            with CF.override(("gemm", "decode"), cfg or PERSISTENT):
                yield spy
        else:
            mp.setenv("TRITONMOE_GEMM_VARIANT", "persistent")
            yield spy


def _dims(draw_aligned: bool, lo: int, hi: int):
    """Sizes that are multiples of 8 (TMA-eligible) or anything."""
    if draw_aligned:
        return st.sampled_from([8 * i for i in range(max(1, lo // 8), hi // 8 + 1)])
    return st.integers(lo, hi)


# ---------------------------------------------------------------------------------------------
# Selection: policy, environment, fallbacks
# ---------------------------------------------------------------------------------------------


def test_variant_selection(monkeypatch):
    dev = torch.device(DEV)
    sel = dict(rows=64, n=32, k=32, num_experts=4, dtype=torch.float16, tf32=False, device=dev)
    monkeypatch.delenv("TRITONMOE_GEMM_VARIANT", raising=False)
    assert C.DEFAULT_VARIANT == "tile"  # unchanged until a GPU run measures the persistent variant
    assert all(C.select(k, **sel).variant == "tile" for k in C.KINDS)
    monkeypatch.setenv("TRITONMOE_GEMM_VARIANT", "persistent")
    for kind in C.KINDS:
        assert C.select(kind, **sel).variant == ("persistent" if kind in C.PERSISTENT_KINDS else "tile"), kind
    monkeypatch.setenv("TRITONMOE_GEMM_VARIANT", "wide")
    for kind in C.KINDS:
        want = "tile" if kind not in C.PERSISTENT_KINDS else ("wide" if kind in C.WIDE_KINDS else "persistent")
        assert C.select(kind, **sel).variant == want, kind
    monkeypatch.setenv("TRITONMOE_GEMM_VARIANT", " Tile ")
    assert C.select("mm", **sel).variant == "tile"
    monkeypatch.setenv("TRITONMOE_GEMM_VARIANT", "fast")
    with pytest.raises(ValueError, match="TRITONMOE_GEMM_VARIANT"):
        C.select("mm", **sel)
    # An override's config carries its own variant; kinds without a persistent kernel get "tile".
    with CF.override("gemm", dataclasses.replace(C.INTERPRETER_CONFIG, variant="persistent")):
        assert C.select("swiglu", **sel).variant == "persistent"
        assert C.select("wgrad", **sel).variant == "tile"
    with pytest.raises(ValueError, match="variant"):
        C.TileConfig(BM=16, BN=16, BK=16, variant="bogus")
    with pytest.raises(ValueError, match="epilogue_split"):
        P.PersistentOptions(epilogue_split=4)


@pytest.mark.skipif(DEV != "cpu", reason="alignment cases are built on CPU tensors")
def test_operand_access_rule():
    """TMA per operand exactly where the layout allows it (16-byte strides and bases, a unit
    last stride); everything else takes the pointer path of the same kernel."""
    h16 = torch.float16

    def acc(a, b, out, h=None, **kw):
        kw.setdefault("gather_a", False)
        kw.setdefault("scatter", False)
        return P.access(a, b, out, h, n=out.shape[1], dual=kw.pop("dual", False), **kw)

    a, b, out = torch.zeros(40, 32, dtype=h16), torch.zeros(3, 32, 24, dtype=h16), torch.zeros(40, 24, dtype=h16)
    assert acc(a, b, out) == P.Access(a=True, b=True, b_kmajor=False, c=True, h=False)
    # dX sees w^T: K-contiguous storage, read as [E, N, K] boxes.
    bt = torch.zeros(3, 24, 32, dtype=h16).transpose(1, 2)
    assert acc(a, bt, out) == P.Access(a=True, b=True, b_kmajor=True, c=True, h=False)
    # An unaligned row stride (33 halves) loses TMA for that operand only.
    assert acc(torch.zeros(40, 33, dtype=h16), torch.zeros(3, 33, 24, dtype=h16), out) == P.Access(
        a=False, b=True, b_kmajor=False, c=True, h=False)
    out33 = torch.zeros(40, 33, dtype=h16)
    assert acc(a, torch.zeros(3, 32, 33, dtype=h16), out33) == P.Access(
        a=True, b=False, b_kmajor=False, c=False, h=False)
    # A base one element off 16 bytes, a column-strided weight view: pointer path.
    assert not acc(torch.zeros(40 * 32 + 1, dtype=h16)[1:].view(40, 32), b, out).a
    assert not acc(a, torch.zeros(3, 32, 48, dtype=h16)[:, :, ::2], out).b
    # Gathered A rows and scattered C rows: pointers; the option turns TMA stores off.
    assert acc(a, b, out, gather_a=True, scatter=True) == P.Access(a=False, b=True, b_kmajor=False, c=False, h=False)
    assert not acc(a, b, out, tma_store=False).c
    # SwiGLU halves: the up half of w1 [E, K, 2N] and of H [R, 2N] start N columns in.
    w1 = torch.zeros(3, 32, 2 * 20, dtype=h16)
    hh = torch.zeros(40, 2 * 20, dtype=h16)
    o = torch.zeros(40, 20, dtype=h16)
    assert acc(a, w1, o, hh, dual=True) == P.Access(a=True, b=False, b_kmajor=False, c=False, h=False)
    w1 = torch.zeros(3, 32, 2 * 24, dtype=h16)
    hh = torch.zeros(40, 2 * 24, dtype=h16)
    assert acc(a, w1, out, hh, dual=True) == P.Access(a=True, b=True, b_kmajor=False, c=True, h=True)


# ---------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------


@settings(max_examples=7)
@given(
    counts=ragged_counts(),
    aligned=st.booleans(),
    data=st.data(),
    dtype=st.sampled_from(CPU_DTYPES),
    off_dtype=st.sampled_from([torch.int32, torch.int64]),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_matches_reference(counts, aligned, data, dtype, off_dtype, layout, seed):
    """Forward and dX (persistent, w^T K-contiguous for contiguous w) against the reference."""
    k = data.draw(_dims(aligned, 1, 48), "k")
    n = data.draw(_dims(aligned, 1, 48), "n")
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts, off_dtype)
    x = _leaf(_randn((R, k), dtype, gen))
    w, _ = _weights(E, k, n, "relu", dtype, gen, layout)
    w = _leaf(w)
    with persistent() as spy:
        y = tritonmoe.grouped_gemm(x, offs, w, backend="triton")
        y_ref = ref.grouped_gemm(x, offs, w)
        assert_close(y, y_ref, dtype, what="y")
        if R:
            g = _randn(y.shape, dtype, gen)
            dx, dw = _grad(y, (x, w), g)
            dx_ref, dw_ref = _grad(y_ref, (x, w), g)
            assert_close(dx, dx_ref, dtype, True, "dx")
            assert_close(dw, dw_ref, dtype, True, "dw")
    assert spy.tile == 0
    assert len(spy.persistent) == (2 if R else 0)
    if R and aligned and layout == "contiguous" and DEV == "cpu":
        fwd, dxa = spy.persistent
        assert fwd.a and fwd.b and fwd.c and not fwd.b_kmajor
        assert dxa.b and dxa.b_kmajor


@settings(max_examples=9)
@given(
    counts=ragged_counts(),
    aligned=st.booleans(),
    data=st.data(),
    activation=st.sampled_from(PERSISTENT_ACTS),
    dtype=st.sampled_from(CPU_DTYPES),
    layout=st.sampled_from(["contiguous", "transposed"]),
    mode=st.sampled_from(C.PREACT_MODES),
    seed=st.integers(0, 2**16),
)
def test_grouped_ffn_matches_reference(counts, aligned, data, activation, dtype, layout, mode, seed):
    """Every fused epilogue (SwiGLU / GELU / ReLU, with and without the pre-activation store)
    and the FFN's dX GEMM."""
    d = data.draw(_dims(aligned, 1, 40), "d")
    f = data.draw(_dims(aligned, 1, 24), "f")
    gen = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen, layout))
    with persistent() as spy, CF.override("ffn.preact", mode):
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, backend="triton")
        y_ref = ref.grouped_ffn(x, offs, w1, w2, activation)
        assert_close(y, y_ref, dtype, what="y")
        if R:
            g = _randn(y.shape, dtype, gen)
            for name, a, b in zip(("dx", "dw1", "dw2"), _grad(y, (x, w1, w2), g), _grad(y_ref, (x, w1, w2), g)):
                assert_close(a, b, dtype, True, name)
    assert spy.tile == 0


@settings(max_examples=6)
@given(
    T=st.integers(0, 16),
    E=st.integers(1, 6),
    kk=st.integers(1, 4),
    d=st.sampled_from([8, 16, 24, 13]),
    f=st.sampled_from([8, 16, 11]),
    activation=st.sampled_from(PERSISTENT_ACTS),
    dtype=st.sampled_from(CPU_DTYPES),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_moe_ffn_matches_reference(T, E, kk, d, f, activation, dtype, drop, seed):
    """The fused path with the persistent variant selected: its row space (slots gathered
    through row_map, unrouted slots in a zero head before offsets[0], read from the tile map)
    runs the persistent kernel for every forward GEMM, and the results match the reference; NaN
    tokens that no slot routes must not leak."""
    gen = torch.Generator().manual_seed(seed)
    k = min(kk, E)
    r = _routing(T, E, k, gen, drop)
    x = _randn((T, d), dtype, gen)
    unrouted_T = (r.topk_ids < 0).all(dim=1)
    x[unrouted_T] = float("nan")
    x = _leaf(x)
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen))
    with persistent() as spy:
        out = tritonmoe.moe_ffn(x, r, w1, w2, activation, backend="triton")
        out_ref = ref.moe_ffn(x, r, w1, w2, activation)
        assert_close(out, out_ref, dtype, what="out")
        assert not out[unrouted_T].any()
        if T:
            g = _randn(out.shape, dtype, gen)
            inputs = (x, r.topk_weights, w1, w2)
            for name, a, b in zip(("dx", "dgate", "dw1", "dw2"), _grad(out, inputs, g), _grad(out_ref, inputs, g)):
                assert_close(a, b, dtype, True, name)
    assert spy.tile == 0 and (len(spy.persistent) >= 2 or not T)


@pytest.mark.parametrize("why,counts,d,f,activation,bias", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_cases(why, counts, d, f, activation, bias):
    """test_kernels_ffn's tile-map corner cases, SwiGLU forward + backward, fp16 (fp32 runs in
    the hypothesis tests); the persistent kernel has no bias or clamped-SwiGLU epilogue, so these
    run plain SwiGLU (test_epilogues_it_lacks_run_the_tile_kernel covers the others)."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(len(counts) * 100 + d)
    E, R = len(counts), sum(counts)
    offs = _offsets(counts)
    x = _leaf(_randn((R, d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, "swiglu", dtype, gen))
    with persistent() as spy:
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", backend="triton")
        y_ref = ref.grouped_ffn(x, offs, w1, w2, "swiglu")
        assert_close(y, y_ref, dtype, what="y")
        if R:
            g = _randn(y.shape, dtype, gen)
            for name, a, b in zip(("dx", "dw1", "dw2"), _grad(y, (x, w1, w2), g), _grad(y_ref, (x, w1, w2), g)):
                assert_close(a, b, dtype, True, name)
    assert spy.tile == 0


@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("swiglu_oai", False)])
def test_epilogues_it_lacks_run_the_tile_kernel(activation, bias):
    """With the persistent variant selected, a launch with a bias or the clamped SwiGLU (which the
    persistent kernel does not implement) runs the tile kernel, with the reference's result."""
    from test_kernels_ffn import _biases

    dtype = torch.float32
    gen = torch.Generator().manual_seed(31)
    counts = [5, 0, 9]
    E, R, d, f = len(counts), sum(counts), 16, 8
    offs = _offsets(counts)
    x = _randn((R, d), dtype, gen)
    w1, w2 = _weights(E, d, f, activation, dtype, gen)
    b1, b2 = _biases(E, w1.shape[2], d, dtype, gen) if bias else (None, None)
    with persistent() as spy, torch.no_grad():
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, b1, b2, backend="triton")
    assert_close(y, ref.grouped_ffn(x, offs, w1, w2, activation, b1, b2), dtype, what="y")
    assert spy.tile > 0
    if bias:
        assert spy.persistent == []


@pytest.mark.parametrize("why,T,E,k,d,decode", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_edge_cases(why, T, E, k, d, decode):
    """test_kernels_ffn's fused-path corner cases (unrouted head rows, dropped slots, one expert)
    with the persistent variant selected: they run the persistent kernel (see
    test_moe_ffn_matches_reference) and match the reference."""
    from test_kernels_ffn import _set_ids

    dtype = torch.float32
    gen = torch.Generator().manual_seed(T * 7 + E + d)
    r = _routing(T, E, k, gen, 1.0 if "dropped" in why else 0.0)
    if "one expert" in why:
        ids = torch.full_like(r.topk_ids, -1)
        ids[:, 0] = 2
        _set_ids(r, ids)
    x = _randn((T, d), dtype, gen)
    w1, w2 = _weights(E, d, 8, "swiglu", dtype, gen)
    path = CF.override("ffn.decode", decode) if decode is not None else contextlib.nullcontext()
    with path, persistent() as spy, torch.no_grad():
        out = tritonmoe.moe_ffn(x, r, w1, w2, backend="triton")
    assert_close(out, ref.moe_ffn(x, r, w1, w2), dtype, what="out")
    assert spy.tile == 0 and (len(spy.persistent) == 2 or not T)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_segment_tails_and_poisoned_rows(dtype):
    """TMA on every operand (aligned fp16/fp32 shapes): segments shorter than a tile and
    segments ending mid-tile next to a NaN-poisoned neighbour (a padding row inside a segment is
    zero, a row past offsets[E] is NaN), K and N tails inside a tile, an empty expert, and
    weights that are aligned views of NaN-filled storage. Nothing of the neighbours may reach
    an output row; rows past offsets[E] come out zero; the pre-activation store (training)
    writes only its own rows."""
    gen = torch.Generator().manual_seed(41)
    counts = [3, 17, 0, 16, 1]  # 16-row tiles: 3 | 16+1 | - | 16 | 1
    d, f = 24, 40  # K tail (24 = 16 + 8), N tail (40 = 2*16 + 8)
    E, R0 = len(counts), sum(counts)
    R = R0 + 11
    offs = _offsets(counts)
    x = _randn((R, d), dtype, gen)
    x[R0:] = float("nan")
    store1 = torch.full((E + 1, d + 8, 2 * f + 16), float("nan"), dtype=dtype, device=DEV)
    store2 = torch.full((E, f + 8, d + 8), float("nan"), dtype=dtype, device=DEV)
    w1r, w2r = _weights(E, d, f, "swiglu", dtype, gen)
    store1[1:, :d, :2 * f] = w1r
    store2[:, :f, :d] = w2r
    w1, w2 = store1[1:, :d, :2 * f], store2[:, :f, :d]  # aligned views: TMA, bounds at d and 2f
    x_ok = x[:R0]
    with persistent() as spy, tritonmoe.validation(False):
        y = tritonmoe.grouped_ffn(_leaf(x), offs, _leaf(w1), _leaf(w2), "swiglu", backend="triton")
        h = torch.full((R, 2 * f), float("nan"), dtype=dtype, device=DEV)
        a = torch.full((R, f), float("nan"), dtype=dtype, device=DEV)
        K._mm(x, K.RowSpace(offs, R, E), w1, a, act=K._act("swiglu", 7.0, 1.702), h=h)
    assert all(acc.a and acc.b and acc.c for acc in spy.persistent), spy.persistent
    assert spy.persistent[-1].h
    assert torch.equal(y[R0:], torch.zeros_like(y[R0:]))
    assert_close(y[:R0], ref.grouped_ffn(x_ok, offs, w1, w2, "swiglu"), dtype, what="y")
    h_ref = ref.grouped_gemm(x_ok, offs, w1)
    assert_close(h[:R0], h_ref, dtype, what="h")
    assert torch.equal(h[R0:], torch.zeros_like(h[R0:])) and torch.equal(a[R0:], torch.zeros_like(a[R0:]))
    a_ref = ref.apply_activation(ref._grouped_gemm_acc(x_ok, offs, w1), "swiglu").to(dtype)
    assert_close(a[:R0], a_ref, dtype, what="a")


def test_schedule_options_do_not_change_bits():
    """Flattening the loops, the number of programs, TMA vs pointer stores and the epilogue's
    column slicing change the schedule, never the bits; every run is deterministic."""
    gen = torch.Generator().manual_seed(43)
    counts = [21, 0, 34, 5]
    offs = _offsets(counts)
    x = _randn((sum(counts), 32), torch.float16, gen)
    w1, w2 = _weights(4, 32, 32, "swiglu", torch.float16, gen)
    cfg = dataclasses.replace(C.INTERPRETER_CONFIG, BN=32, variant="persistent") if DEV == "cpu" else None
    results = []
    variants = [dict(), dict(flatten=False), dict(tma_store=False), dict(epilogue_split=2),
                dict(epilogue_split=2, tma_store=False)]
    for opts in variants:
        with persistent(cfg) as spy, CF.override("persistent", **opts), torch.no_grad():
            results.append(tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton"))
        assert spy.tile == 0 and len(spy.persistent) == 2
    with persistent(cfg), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "num_programs", lambda device, max_tiles: 1)  # one program owns every tile
        results.append(tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton"))
    for r in results[1:]:
        assert torch.equal(r, results[0])
    assert_close(results[0], ref.grouped_ffn(x, offs, w1, w2), torch.float16, what="y")


# ---------------------------------------------------------------------------------------------
# The "wide" SwiGLU (one [BM, 2*BN] accumulator) and the tuned table's variant choice
# ---------------------------------------------------------------------------------------------

WIDE = dataclasses.replace(C.INTERPRETER_CONFIG, variant="wide") if DEV == "cpu" else None
WIDE_CASES = [
    ("ragged, empty experts, K and N tails", [5, 0, 17, 0, 3], 24, 24, torch.float32),
    ("first and last experts empty", [0, 9, 16, 0], 16, 16, torch.float16),
    ("one row", [0, 1], 8, 24, torch.float32),
    ("no rows", [0, 0, 0], 16, 16, torch.float16),
]


@pytest.mark.parametrize("why,counts,d,f,dtype", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
def test_wide_swiglu_matches_reference(why, counts, d, f, dtype):
    """variant="wide": the gate and up tiles of each K step load as one [BK, 2*BN] tile into one
    accumulator, whose halves the SwiGLU epilogue reads; forward (inference, then training with
    the pre-activation stored) and backward against the reference, with experts of 0 rows,
    ragged counts, N tails inside a tile and rows past offsets[E] (zeros, NaN input there)."""
    gen = torch.Generator().manual_seed(sum(counts) * 13 + d + f)
    E, R0 = len(counts), sum(counts)
    R = R0 + 5
    offs = _offsets(counts)
    x = _randn((R, d), dtype, gen)
    x[R0:] = float("nan")
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, "swiglu", dtype, gen))
    y_ref = ref.grouped_ffn(x[:R0], offs, w1, w2, "swiglu")
    with persistent(WIDE) as spy, torch.no_grad():
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, "swiglu", backend="triton")
    assert torch.equal(y[R0:], torch.zeros_like(y[R0:]))
    assert_close(y[:R0], y_ref, dtype, what="y (inference)")
    assert spy.tile == 0 and spy.wide == 1
    xl = _leaf(x[:R0].clone())
    with persistent(WIDE) as spy:
        y = tritonmoe.grouped_ffn(xl, offs, w1, w2, "swiglu", backend="triton")
        y_ref = ref.grouped_ffn(xl, offs, w1, w2, "swiglu")
        assert_close(y, y_ref, dtype, what="y (training)")
        if R0:
            g = _randn(y.shape, dtype, gen)
            for name, a, b in zip(("dx", "dw1", "dw2"), _grad(y, (xl, w1, w2), g), _grad(y_ref, (xl, w1, w2), g)):
                assert_close(a, b, dtype, True, name)
    assert spy.tile == 0 and spy.wide == (1 if R0 else 0)


def test_wide_swiglu_fused_path_and_bits():
    """The wide accumulator on the fused path (gathered token rows, unrouted head) matches the
    reference, and gives the same bits as the two-accumulator persistent kernel (the same MMA
    sums per output element)."""
    dtype = torch.float32
    gen = torch.Generator().manual_seed(53)
    T, E, k, d, f = 11, 5, 2, 24, 40
    r = _routing(T, E, k, gen, 0.3)
    x = _randn((T, d), dtype, gen)
    w1, w2 = _weights(E, d, f, "swiglu", dtype, gen)
    outs = []
    for cfg in (WIDE, PERSISTENT):
        with persistent(cfg) as spy, CF.override("ffn.decode", False), torch.no_grad():
            outs.append(tritonmoe.moe_ffn(x, r, w1, w2, backend="triton"))
        assert spy.tile == 0 and spy.wide == (1 if cfg is WIDE else 0)
    assert_close(outs[0], ref.moe_ffn(x, r, w1, w2), dtype, what="out")
    assert torch.equal(outs[0], outs[1])


def _table(rows: dict) -> CF.Table:
    """A tuned table (format 1) with one bucket (256 rows per expert) per (target, exact key)."""
    entries = {}
    for (target, exact), cfg in rows.items():
        entries.setdefault(target, {})[CF.bucket_key(dict(exact))] = {"256": {"config": cfg, "us": 1.0}}
    return CF.Table({"format": 1, "device": "synthetic", "entries": entries})


def test_tuned_table_selects_the_variant(monkeypatch):
    """The variant is table-driven: a table row's variant (and tiles) wins for its shape, any
    shape without a row keeps the policy's default ("tile"), the kinds without a persistent
    kernel (dact, wgrad) take the row's tiles with the tile kernel, and "wide" means
    "persistent" for kinds without a GLU."""
    monkeypatch.delenv("TRITONMOE_GEMM_VARIANT", raising=False)
    dev = torch.device(DEV)
    dt, E, n, k = torch.float16, 8, 64, 32
    exact = C.gemm_key(dt, False, E, n, k)
    base = dict(BM=16, BN=32, BK=16, GROUP_M=1, num_warps=1, num_stages=1)
    tbl = _table({
        ("gemm.mm", tuple(exact.items())): {**base, "variant": "persistent"},
        ("gemm.swiglu", tuple(exact.items())): {**base, "variant": "wide"},
        ("gemm.mm_act", tuple(exact.items())): {**base, "variant": "wide"},
        ("gemm.dact", tuple(exact.items())): {**base, "BN": 64, "variant": "persistent"},
        ("gemm.wgrad", tuple(exact.items())): {**base, "BM": 16, "BN": 64},
    })
    sel = dict(rows=E * 256, n=n, k=k, num_experts=E, dtype=dt, tf32=False, device=dev)
    with CF.override("table", tbl):
        got = {kind: C.select(kind, **sel) for kind in C.KINDS}
        other = C.select("mm", **{**sel, "n": 2 * n})  # no row for this N
    assert (got["mm"].variant, got["mm"].source) == ("persistent", "table")
    assert got["swiglu"].variant == "wide" and got["mm_act"].variant == "persistent"
    assert (got["dact"].variant, got["dact"].BN, got["dact"].source) == ("tile", 64, "table")
    assert (got["wgrad"].variant, got["wgrad"].BN, got["wgrad"].source) == ("tile", 64, "table")
    assert (got["dact_swiglu"].source, got["dact_swiglu"].variant) == ("heuristic", "tile")
    assert (other.variant, other.source) == (C.DEFAULT_VARIANT, "heuristic") == ("tile", "heuristic")


# ---------------------------------------------------------------------------------------------
# GPU (bf16, the policy's real tiles, both variants)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_expert", [5, 96, 700])
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_persistent_matches_reference_and_tile(monkeypatch, rows_per_expert, activation):
    """bf16 on the GPU with the policy's sm90 tiles (decode, mid, large): the persistent variant
    against the reference and against the tile variant, forward and backward."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(47)
    E, d, f = 8, 512, 768
    counts = [max(0, int(rows_per_expert * E / (i + 1) / 2.7)) for i in range(E)]
    counts[3] = 0
    offs = _offsets(counts)
    x = _leaf(_randn((sum(counts), d), dtype, gen))
    w1, w2 = (_leaf(w) for w in _weights(E, d, f, activation, dtype, gen))
    g = _randn((sum(counts), d), dtype, gen)
    outs = {}
    for variant in ("tile", "persistent"):
        monkeypatch.setenv("TRITONMOE_GEMM_VARIANT", variant)
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, activation, backend="triton")
        outs[variant] = (y, *_grad(y, (x, w1, w2), g))
    y_ref = ref.grouped_ffn(x, offs, w1, w2, activation)
    want = (y_ref, *_grad(y_ref, (x, w1, w2), g))
    for name, a, b, c in zip(("y", "dx", "dw1", "dw2"), outs["persistent"], want, outs["tile"]):
        assert_close(a, b, dtype, name != "y", name)
        assert_close(a, c, dtype, name != "y", name + " vs tile")
