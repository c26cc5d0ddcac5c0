"""Triton permute / unpermute (kernels/permute.py) against tritonmoe.reference.

On CPU the kernels run in Triton's interpreter (conftest switches it on), on CUDA when present.
Metadata (counts, offsets, slot rows) and permuted rows are compared exactly (atol = 0); the fp32
weighted combine with per-dtype tolerances of about one output ulp, far below what a wrong row or
weight would give. Shapes are small: the interpreter runs one program at a time.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import reference as ref
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import permute as kp
from tritonmoe.kernels._permute_kernels import row_offset
from tritonmoe.core.types import PermuteInfo

from strategies import permute_cases

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")

# (rtol, atol) of the fp32-accumulated combine after rounding to the output dtype: ~1 ulp.
TOL = {
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 8e-3),
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-12, 1e-12),
}

# Config variants: the defaults, and small tiles that force every loop and split to run: the
# three-kernel block metadata with several blocks and expert chunks, d done in several chunks by
# several programs per row, tail programs a few rows wide.
CONFIGS = {
    "default": {},
    "blocks": dict(
        metadata={"fused": False, "block_s": 8, "block_e": 4, "block_b": 2, "scan_e": 4},
        scatter={"block_d": 4, "nsplit": 2, "tail_rows": 4},
        gather={"block_d": 4, "nsplit": 2},
    ),
    "fused-tiny": dict(
        metadata={"fused": True, "block_s": 4, "block_e": 2},
        scatter={"block_d": 8, "nsplit": 1, "tail_rows": 3},
        gather={"block_d": 8, "nsplit": 3},
    ),
}


def _ids(rows, dtype=torch.int64):
    return torch.tensor(rows, dtype=dtype, device=DEV).reshape(len(rows), -1)


def _x(T, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g).to(dtype).to(DEV)


def check_metadata(info: PermuteInfo, rinfo: PermuteInfo) -> None:
    assert info.counts.dtype == torch.int32 and info.expert_offsets.dtype == torch.int64
    assert info.slot_rows.dtype == torch.int64
    assert torch.equal(info.counts, rinfo.counts), (info.counts, rinfo.counts)
    assert torch.equal(info.expert_offsets, rinfo.expert_offsets), (info.expert_offsets, rinfo.expert_offsets)
    assert torch.equal(info.slot_rows, rinfo.slot_rows), (info.slot_rows, rinfo.slot_rows)
    assert info.num_tokens == rinfo.num_tokens and info.pad_to == rinfo.pad_to


def check_invariants(x, ids, E, pad_to, x_perm, info) -> None:
    """The contract's properties, independent of the reference."""
    T, K = ids.shape
    counts = info.counts.long().cpu()
    offs = info.expert_offsets.cpu()
    rows = info.slot_rows.cpu()
    ids_c = ids.long().cpu()
    R = int(offs[-1])
    assert x_perm.shape == (R, x.shape[1])
    padded = (counts + pad_to - 1) // pad_to * pad_to
    assert int(offs[0]) == 0 and torch.equal(offs[1:] - offs[:-1], padded)  # diffs == padded counts
    assert int(counts.sum()) == int((ids_c >= 0).sum())  # counts sum to the routed slots
    assert torch.equal(rows < 0, ids_c < 0)  # -1 exactly for unrouted slots
    routed = rows[rows >= 0]
    assert routed.unique().numel() == routed.numel()  # every row owned by at most one slot
    # each slot's row lies in its expert's unpadded segment, in token-then-slot order
    for e in range(E):
        mine = rows[ids_c == e]  # row-major: token, then slot
        expect = torch.arange(int(offs[e]), int(offs[e]) + int(counts[e]))
        assert torch.equal(mine, expect)
    xp = x_perm.cpu()
    xc = x.cpu()
    for t in range(T):
        for j in range(K):
            if rows[t, j] >= 0:
                assert torch.equal(xp[rows[t, j]], xc[t])  # exact copy
    owned = torch.zeros(R, dtype=torch.bool)
    owned[routed] = True
    assert not xp[~owned].any()  # padding rows are zero (and not NaN)


def run_both(x, ids, E, pad_to=1, config="default"):
    with _configs(config):
        xp, info = tm.permute(x, ids, E, pad_to=pad_to, backend="triton")
    rxp, rinfo = ref.permute(x, ids, E, pad_to=pad_to)
    return xp, info, rxp, rinfo


def _configs(name):
    """Overrides of the permute targets for the named CONFIGS entry."""
    stack = contextlib.ExitStack()
    for kind, fields in CONFIGS[name].items():
        stack.enter_context(CF.override(f"permute.{kind}", **fields))
    return stack


def check_unpermute(y, info, w, config="default"):
    with _configs(config):
        out = tm.unpermute(y, info, w, backend="triton")
    expect = ref.unpermute(y, info, w)
    assert out.dtype == y.dtype and out.shape == expect.shape
    rtol, atol = TOL[y.dtype]
    torch.testing.assert_close(out, expect, rtol=rtol, atol=atol)
    return out


def test_registered():
    from tritonmoe.backends import implementation as select_impl

    assert select_impl("permute", "triton", DEV) is kp.permute
    assert select_impl("unpermute", "triton", DEV) is kp.unpermute
    assert select_impl("permute", "auto", torch.device("cuda")) is kp.permute  # CUDA -> kernels
    assert select_impl("permute_metadata", "triton", DEV) is kp.permute_metadata
    assert select_impl("permute", "triton", DEV, torch.float64) is kp.permute  # row movers: any dtype


# --------------------------------------------------------------------------------------------
# Named edge cases
# --------------------------------------------------------------------------------------------

# name -> (ids rows, E, pad_to, d, why the case exists)
CASES = {
    "docstring": ([[1, 0], [1, 2], [-1, 1]], 3, 1, 5, "the worked example of PermuteInfo"),
    "T=0": ([], 4, 16, 3, "no tokens: empty buffer, zero offsets, no launch of the movers"),
    "T=1": ([[2, 0, 1]], 4, 1, 6, "one token"),
    "k=E": ([[0, 1, 2], [2, 1, 0], [1, 0, 2]], 3, 1, 4, "every expert in every token"),
    "all -1": ([[-1, -1], [-1, -1], [-1, -1]], 3, 16, 4, "nothing routed: R = 0"),
    "empty expert": ([[0, 2], [2, 0], [0, 4], [4, 2]], 5, 1, 3, "experts 1 and 3 get no rows"),
    "one expert": ([[3], [3], [3], [3], [3], [3]], 5, 1, 7, "all tokens on one expert"),
    "pad 16": ([[0, 1], [1, 2], [2, 0], [1, -1]], 3, 16, 5, "padding rows in every segment"),
    "pad 128": ([[0, 4], [4, 5], [6, -1]], 7, 128, 3, "wide padding, prime E, empty experts padded to 0"),
    "duplicate ids": ([[1, 1], [0, 1]], 2, 2, 3, "an expert twice in one token: slot order breaks the tie"),
    "wide d": ([[0, 1], [1, 0], [1, -1]], 2, 1, 37, "d not a power of two, several d chunks"),
    "prime E": ([[6, 0, 3], [2, 5, 6], [1, 3, 4], [0, 6, 5]], 7, 4, 3, "prime E with padding"),
}


@pytest.mark.parametrize("config", ["default", "blocks", "fused-tiny"])
@pytest.mark.parametrize("case", list(CASES))
def test_cases_match_reference(case, config):
    rows, E, pad_to, d, _why = CASES[case]
    K = len(rows[0]) if rows else 2
    ids = torch.tensor(rows, dtype=torch.int64, device=DEV).reshape(len(rows), K)
    x = _x(len(rows), d)
    xp, info, rxp, rinfo = run_both(x, ids, E, pad_to, config)
    check_metadata(info, rinfo)
    assert torch.equal(xp, rxp)
    check_invariants(x, ids, E, pad_to, xp, info)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    check_unpermute(_x(xp.shape[0], d, seed=2), info, w, config)


@pytest.mark.parametrize("ids_dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_id_dtypes(ids_dtype):
    ids = _ids([[1, 0], [2, 1], [0, 2]], ids_dtype)
    x = _x(3, 4)
    xp, info, rxp, rinfo = run_both(x, ids, 3, 2)
    check_metadata(info, rinfo)
    assert torch.equal(xp, rxp)


def test_non_contiguous_inputs():
    base = _x(6, 20)
    x = base[:, 1::3]  # strided columns
    xt = _x(7, 6).t()  # [6, 7] with stride (1, 6)
    ids = _ids([[0, 2], [1, 2], [2, 0], [1, 0], [2, 1], [0, 1]]).t().contiguous().t()  # [6, 2], strides (1, 6)
    assert not x.is_contiguous() and not xt.is_contiguous() and not ids.is_contiguous()
    for xx in (x, xt):
        for config in ("default", "blocks"):
            xp, info, rxp, rinfo = run_both(xx, ids, 3, 4, config)
            check_metadata(info, rinfo)
            assert torch.equal(xp, rxp)
            y = _x(xp.shape[0] * 2, xx.shape[1])[::2]  # strided rows
            w = torch.rand(6, 4, device=DEV)[:, ::2]  # strided weights
            check_unpermute(y, info, w, config)


def test_deterministic():
    ids = _ids([[1, 0, 2], [0, 2, 1], [2, 2, 0], [1, -1, 0]])
    x = _x(4, 9)
    w = torch.rand(4, 3, device=DEV)
    with _configs("blocks"):
        a, ia = kp.permute(x, ids, 3, pad_to=4)
        b, ib = kp.permute(x, ids, 3, pad_to=4)
        assert torch.equal(a, b) and torch.equal(ia.slot_rows, ib.slot_rows)
        assert torch.equal(kp.unpermute(a, ia, w), kp.unpermute(b, ib, w))


# --------------------------------------------------------------------------------------------
# Properties (hypothesis): 120 + 80 examples
# --------------------------------------------------------------------------------------------


@settings(max_examples=120)
@given(case=permute_cases(max_tokens=12, max_d=9), config=st.sampled_from(list(CONFIGS)), dup=st.booleans())
def test_permute_properties(case, config, dup):
    ids = case.ids
    if dup and ids.shape[0] and ids.shape[1] > 1:
        ids = ids.clone()
        ids[:, 1] = ids[:, 0]  # repeated experts inside a token (allowed by the contract)
    x, ids = case.x.to(DEV), ids.to(DEV)
    xp, info, rxp, rinfo = run_both(x, ids, case.num_experts, case.pad_to, config)
    check_metadata(info, rinfo)
    assert torch.equal(xp, rxp)
    check_invariants(x, ids, case.num_experts, case.pad_to, xp, info)


@settings(max_examples=80)
@given(
    case=permute_cases(max_tokens=10, max_d=11),
    config=st.sampled_from(list(CONFIGS)),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
)
def test_unpermute_properties(case, config, dtype):
    _, rinfo = ref.permute(case.x, case.ids, case.num_experts, pad_to=case.pad_to)
    info = PermuteInfo(**{f: (getattr(rinfo, f).to(DEV) if torch.is_tensor(getattr(rinfo, f)) else getattr(rinfo, f))
                          for f in ("expert_offsets", "slot_rows", "counts", "num_tokens", "pad_to")})
    R = int(rinfo.expert_offsets[-1])
    y = _x(R, case.x.shape[1], dtype, seed=R)
    owned = torch.zeros(R, dtype=torch.bool, device=DEV)
    owned[info.slot_rows[info.slot_rows >= 0]] = True
    y[~owned] = float("nan")  # padding rows poisoned: the combine must never read them
    out = check_unpermute(y, info, case.weights.to(DEV), config)
    assert not out.isnan().any()


# --------------------------------------------------------------------------------------------
# Poisoned buffers: every row of the outputs is written
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["default", "blocks"])
def test_poisoned_outputs_are_fully_written(config):
    ids = _ids([[0, 2], [2, -1], [0, 4], [4, 2], [-1, -1]])
    E, pad_to, d = 5, 4, 6
    x = _x(5, d)
    w = torch.rand(5, 2, device=DEV)
    rxp, rinfo = ref.permute(x, ids, E, pad_to=pad_to)
    with _configs(config):
        info = kp.permute_metadata(ids, E, pad_to)
        check_metadata(info, rinfo)
        R = rxp.shape[0]
        # permute forward: padding rows must be written as zeros
        out = torch.full((R, d), float("nan"), device=DEV)
        assert kp.scatter_rows(x, info, out=out) is out
        assert torch.equal(out, rxp)
        # rows past R (a buffer of the static bound) are zeros too
        big = torch.full((kp.max_permuted_rows(5, 2, E, pad_to), d), float("nan"), device=DEV)
        kp.scatter_rows(x, info, out=big)
        assert torch.equal(big[:R], rxp) and not big[R:].any() and not big.isnan().any()
        # unpermute backward's d(y_perm) (the weighted scatter): w * d(out) on slot rows, 0 elsewhere
        g = _x(5, d, seed=3)
        y = _x(R, d, seed=4).requires_grad_()
        (expect,) = torch.autograd.grad(ref.unpermute(y, rinfo, w), y, g)
        dy = torch.full((R, d), float("nan"), device=DEV)
        kp.scatter_rows(g, info, w, out=dy)
        torch.testing.assert_close(dy, expect, rtol=1e-6, atol=0)
        # the combine writes every token row, unrouted tokens as zeros
        o = torch.full((5, d), float("nan"), device=DEV)
        kp.gather_rows(rxp, info, w, out=o)
        torch.testing.assert_close(o, ref.unpermute(rxp, rinfo, w), rtol=1e-5, atol=1e-6)
        assert not o[4].any()


def test_out_buffer_checks():
    ids = _ids([[0], [1]])
    info = kp.permute_metadata(ids, 2)
    with pytest.raises(ValueError, match="contiguous"):
        kp.scatter_rows(_x(2, 4), info, out=torch.zeros(4, 2, device=DEV).t())
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        kp.gather_rows(_x(2, 4), info, out=torch.zeros(3, 4, device=DEV))


# --------------------------------------------------------------------------------------------
# The sync-free path: permute_metadata + permute_rows(num_rows=static bound)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_to", [1, 3])
def test_static_rows(pad_to):
    ids = _ids([[0, 1], [1, -1], [2, 1]])
    x = _x(3, 5).requires_grad_()
    bound = kp.max_permuted_rows(3, 2, 3, pad_to)
    info = kp.permute_metadata(ids, 3, pad_to)
    xp = kp.permute_rows(x, info, num_rows=bound)
    rxp, rinfo = ref.permute(x, ids, 3, pad_to=pad_to)
    R = rxp.shape[0]
    assert xp.shape[0] == bound > R
    assert torch.equal(xp[:R], rxp) and not xp[R:].any()
    g = _x(bound, 5, seed=5)
    (dx,) = torch.autograd.grad(xp, x, g)
    (rdx,) = torch.autograd.grad(rxp, x, g[:R])
    torch.testing.assert_close(dx, rdx, rtol=1e-6, atol=1e-6)
    # unpermute over the static buffer: rows past R are ignored forward and get zero gradients
    w = torch.rand(3, 2, device=DEV, requires_grad=True)
    y = _x(bound, 5, seed=6)
    y[R:] = float("nan")
    y.requires_grad_()
    out = kp.unpermute(y, info, w)
    yr = y.detach()[:R].clone().requires_grad_()
    expect = ref.unpermute(yr, rinfo, w)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    g = _x(3, 5, seed=7)
    dy, dw = torch.autograd.grad(out, (y, w), g)
    rdy, rdw = torch.autograd.grad(expect, (yr, w), g)
    torch.testing.assert_close(dy[:R], rdy, rtol=1e-6, atol=0)
    assert not dy[R:].any() and not dy.isnan().any()
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_permuted_rows"):
        kp.permute_rows(x, info, num_rows=bound - 1)
    assert torch.equal(kp.permute_rows(x, info), rxp)  # default: exactly R rows


@pytest.mark.parametrize("pad_to", [1, 4])
def test_public_permute_num_rows_runs_the_expert_path(pad_to):
    """tm.permute(..., num_rows=max_permuted_rows(...)) on both backends: the same bounded buffer
    (rows past R zero, bit-equal across backends), and permute -> grouped_ffn -> unpermute over it
    equals the exact-R path in value and gradient, with validation on."""
    T, K, E, d, f = 7, 2, 4, 8, 4
    ids = _ids([[0, 1], [1, -1], [3, 1], [2, 0], [-1, -1], [1, 2], [0, 3]])
    g = torch.Generator().manual_seed(pad_to)
    w1 = (torch.randn(E, d, 2 * f, generator=g) * 0.3).to(DEV).requires_grad_()
    w2 = (torch.randn(E, f, d, generator=g) * 0.3).to(DEV).requires_grad_()
    w = torch.rand(T, K, generator=g).to(DEV).requires_grad_()
    N = tm.max_permuted_rows(T, K, E, pad_to)
    outs = {}
    for backend in ("triton", "torch"):
        for rows in (None, N):
            x = _x(T, d, seed=3).requires_grad_()
            xp, info = tm.permute(x, ids, E, pad_to=pad_to, num_rows=rows, backend=backend)
            if rows is not None:
                R = int(info.expert_offsets[-1])
                assert xp.shape[0] == N and N > R and not xp[R:].any()
            # the reference grouped_ffn handles the tail rows; value validation wants exact R there
            with tm.validation(False):
                yp = tm.grouped_ffn(xp, info.expert_offsets, w1, w2, backend="torch")
            out = tm.unpermute(yp, info, w, backend=backend)
            grads = torch.autograd.grad(out, (x, w1, w2, w), torch.ones_like(out))
            outs[backend, rows] = (xp.detach(), out.detach(), grads)
    assert torch.equal(outs["triton", N][0], outs["torch", N][0])
    for backend in ("triton", "torch"):
        exact, bounded = outs[backend, None], outs[backend, N]
        assert torch.equal(bounded[0][: exact[0].shape[0]], exact[0])
        torch.testing.assert_close(bounded[1], exact[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(bounded[2], exact[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_rows,exc,fragment", [
    (13, ValueError, "max_permuted_rows(T=7, k=2, E=4, pad_to=1) = 14"),
    (14.0, TypeError, "num_rows"),
])
def test_public_permute_num_rows_validation(num_rows, exc, fragment):
    ids = _ids([[0, 1]] * 7)
    with pytest.raises(exc) as info:
        tm.permute(_x(7, 3), ids, 4, num_rows=num_rows, backend="triton")
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="only 5 rows"):  # a buffer shorter than R
        _, pinfo = tm.permute(_x(7, 3), ids, 4)
        tm.unpermute(_x(5, 3), pinfo, torch.rand(7, 2, device=DEV))
    with pytest.raises(ValueError):
        tm.max_permuted_rows(7, 0, 4)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["default", "blocks"])
def test_backward_matches_reference(config):
    ids = _ids([[1, 0], [1, 2], [-1, 1], [2, 2]])
    x = _x(4, 7).requires_grad_()
    w = torch.rand(4, 2, device=DEV, requires_grad=True)
    with _configs(config):
        xp, info = kp.permute(x, ids, 3, pad_to=2)
        y = (xp * 1.5).detach().requires_grad_()
        out = kp.unpermute(y, info, w)
        g = _x(4, 7, seed=7)
        dx, = torch.autograd.grad(xp, x, _x(xp.shape[0], 7, seed=8))
        dy, dw = torch.autograd.grad(out, (y, w), g)
        dw_only, = torch.autograd.grad(kp.unpermute(y, info, w), w, g)  # the d(w)-only kernel variant
        dy_only, = torch.autograd.grad(kp.unpermute(y, info, w), y, g)
    rxp, rinfo = ref.permute(x, ids, 3, pad_to=2)
    rdx, = torch.autograd.grad(rxp, x, _x(rxp.shape[0], 7, seed=8))
    rdy, rdw = torch.autograd.grad(ref.unpermute(y, rinfo, w), (y, w), g)
    torch.testing.assert_close(dx, rdx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dy, rdy, rtol=1e-6, atol=0)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-6)
    assert torch.equal(dw, dw_only) and torch.equal(dy, dy_only)
    assert dw.dtype == torch.float32 and dy.dtype == y.dtype


@pytest.mark.parametrize("config", ["default", "blocks"])
def test_gradcheck_fp64(config):
    ids = _ids([[1, 0], [-1, 1], [2, 1]])
    x = _x(3, 3, torch.float64).requires_grad_()
    w = torch.rand(3, 2, dtype=torch.float64, device=DEV, requires_grad=True)
    with _configs(config):
        assert torch.autograd.gradcheck(lambda x: kp.permute(x, ids, 3, pad_to=2)[0], (x,), fast_mode=True)
        info = kp.permute_metadata(ids, 3, 2)
        y = _x(int(info.expert_offsets[-1]), 3, torch.float64, seed=1).requires_grad_()
        assert torch.autograd.gradcheck(lambda y, w: kp.unpermute(y, info, w), (y, w), fast_mode=True)


# --------------------------------------------------------------------------------------------
# Bad ids
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, exc",
    [(3, IndexError), (-2, IndexError), (2**40, IndexError), ("float", TypeError)],
    ids=["E", "-2", "2**40", "float"],
)
def test_bad_ids_raise_before_launch(bad, exc, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("the kernels were reached with invalid ids")

    monkeypatch.setattr(kp, "permute_metadata", launched)
    x = _x(2, 4)
    ids = _ids([[0, 1], [2, 0]]).float() if bad == "float" else _ids([[0, 1], [bad, 0]])
    with pytest.raises(exc):
        tm.permute(x, ids, 3, backend="triton")


@pytest.mark.parametrize("config", ["default", "blocks"])
def test_out_of_range_ids_are_skipped_without_validation(config):
    """With validation off, ids outside [-1, E) must not be read out of bounds: the metadata
    treats them like -1 (documented in permute_metadata)."""
    ids = _ids([[0, 7], [-5, 1], [2**40, 2]])
    with _configs(config):
        info = kp.permute_metadata(ids, 3)
    expect = ref.permute(_x(3, 1), torch.where((ids >= 0) & (ids < 3), ids, -1), 3)[1]
    check_metadata(info, expect)


# --------------------------------------------------------------------------------------------
# int64 index math
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_offset_probe(rows_ptr, out_ptr, stride, N: tl.constexpr):
    r = tl.load(rows_ptr + tl.arange(0, N))  # int32 rows
    tl.store(out_ptr + tl.arange(0, N), row_offset(r, stride))


def test_row_offset_is_int64():
    """row * stride of an int32 row near 2^31 / stride must not wrap."""
    stride = 16384
    rows = torch.tensor([2**31 // stride - 1, 2**31 // stride, 2**31 // stride + 7, 2**31 - 1], dtype=torch.int32, device=DEV)
    out = torch.zeros(4, dtype=torch.int64, device=DEV)
    _row_offset_probe[(1,)](rows, out, stride, N=4)
    assert out.tolist() == [int(r) * stride for r in rows.tolist()]
    assert max(out.tolist()) > 2**31


@pytest.mark.parametrize("config", ["default", "blocks"])
def test_offsets_past_2_31(config):
    """Offsets and rows past 2^31 (huge pad_to) stay exact in int64, in both metadata paths."""
    ids = _ids([[0, 2], [2, -1], [1, 2]])
    pad_to = 2**30 + 3
    with _configs(config):
        info = kp.permute_metadata(ids, 4, pad_to)
    small = ref.permute(_x(3, 1), ids, 4)[1]
    counts = small.counts.long()
    padded = (counts + pad_to - 1) // pad_to * pad_to
    offs = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    assert torch.equal(info.expert_offsets, offs) and int(offs[-1]) > 2**31
    e = ids.clamp(min=0)
    rows = torch.where(ids >= 0, offs[e] + small.slot_rows - small.expert_offsets[e], -1)
    assert torch.equal(info.slot_rows, rows) and int(rows.max()) > 2**31
    assert torch.equal(info.counts, small.counts)


# --------------------------------------------------------------------------------------------
# Config policy
# --------------------------------------------------------------------------------------------


def test_config_policy():
    cuda = torch.device("cuda")
    for d in (1, 7, 128, 4096, 7168, 16384, 16385):
        for es in (2, 4, 8):
            s = kp.rows_config("scatter", 4096, 8, d, es, torch.device("cpu"))
            g = kp.rows_config("gather", 4096, 8, d, es, torch.device("cpu"))
            for c in (s, g):
                assert c.block_d & (c.block_d - 1) == 0 and 1 <= c.num_warps <= 8 and c.nsplit >= 1
            assert s.block_d * es <= 4096 or s.block_d == 16
            assert 8 * g.block_d <= 8192
            for k in (1, 2, 6, 8, 16):
                gk = kp.rows_config("gather", 4096, k, d, es, torch.device("cpu"))
                # warps only along the row: one warp spans 512 bytes of it (32 threads x 16 B), so
                # more warps than block_d * es / 512 would split the slots of a column across warps
                # (a shared-memory reduction per chunk; the AOT check counts its barriers)
                assert gk.num_warps == 1 or gk.num_warps * 512 <= gk.block_d * es, (d, es, k, gk)
    assert kp.metadata_config(64, 8, torch.device("cpu")).fused
    with CF.override("permute.metadata", fused=False, block_s=8):
        c = kp.metadata_config(64, 8, torch.device("cpu"))
        assert not c.fused and c.block_s == 8
    assert kp.metadata_config(64, 8, torch.device("cpu")).fused  # scoped to the block
    with pytest.raises(ValueError, match="block_q"):
        with CF.override("permute.metadata", block_q=1):
            pass
    with pytest.warns(DeprecationWarning, match="config_override"):  # the old spelling, an alias
        with kp.config_override(metadata={"fused": False}):
            assert not kp.metadata_config(64, 8, torch.device("cpu")).fused
    if HAS_CUDA:
        assert not kp.metadata_config(4096 * 8, 256, cuda).fused


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_realistic_shapes(dtype):
    torch.manual_seed(0)
    T, K, E, d = 4096, 8, 64, 7168
    logits = torch.randn(T, E, device="cuda")
    routing = tm.route(logits, K, capacity=T * K // E)  # drops some slots: ids -1
    x = torch.randn(T, d, device="cuda", dtype=dtype)
    for pad_to in (1, 128):
        xp, info = tm.permute(x, routing.topk_ids, E, pad_to=pad_to, backend="triton")
        rxp, rinfo = ref.permute(x, routing.topk_ids, E, pad_to=pad_to)
        check_metadata(info, rinfo)
        assert torch.equal(xp, rxp)
        y = torch.randn_like(xp)
        out = tm.unpermute(y, info, routing.topk_weights, backend="triton")
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(out, ref.unpermute(y, rinfo, routing.topk_weights), rtol=rtol, atol=atol)
        out2 = tm.unpermute(y, info, routing.topk_weights, backend="triton")
        assert torch.equal(out, out2)  # deterministic


@pytest.mark.gpu
def test_gpu_large_index_math():
    """T * k * d just above 2^31 elements: every row offset past 2^31 must be exact."""
    T, K, E, d = 32769, 8, 16, 8192  # T*K*d = 2^31 + 2^16
    assert T * K * d > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(1)]).repeat(T, 1)
    ids = (ids + torch.arange(T, device="cuda")[:, None]) % E
    x = torch.randn(T, d, device="cuda", dtype=torch.float16, generator=g)
    xp, info = tm.permute(x, ids, E, backend="triton")
    rinfo = ref.permute(x[:, :1], ids, E)[1]
    check_metadata(info, rinfo)
    # the slots whose rows start past element 2^31: check them directly
    past = info.slot_rows * d >= 2**31
    assert int(past.sum()) > 0
    tok = torch.arange(T, device="cuda")[:, None].expand(T, K)[past]
    assert torch.equal(xp[info.slot_rows[past]], x[tok])
    src = torch.empty(xp.shape[0], dtype=torch.int64, device="cuda")
    src[info.slot_rows.reshape(-1)] = torch.arange(T, device="cuda").repeat_interleave(K)
    assert torch.equal(xp[:, -1], x[src, -1]) and torch.equal(xp[:, 0], x[src, 0])
    # the combine reads the same rows back: k copies of x[t] / k sum to x[t] exactly in fp32
    w = torch.full((T, K), 1.0 / K, device="cuda")
    out = tm.unpermute(xp, info, w, backend="triton")
    assert torch.equal(out, x)
    del xp, out
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_sync_free_path():
    """permute_metadata + permute_rows(num_rows=bound) + unpermute (and its backward) never
    synchronize with the host."""
    T, K, E, d = 512, 4, 16, 256
    ids = torch.randint(-1, E, (T, K), device="cuda")
    x = torch.randn(T, d, device="cuda", requires_grad=True)
    w = torch.rand(T, K, device="cuda", requires_grad=True)
    bound = kp.max_permuted_rows(T, K, E, 16)

    def step():
        info = kp.permute_metadata(ids, E, 16)
        xp = kp.permute_rows(x, info, num_rows=bound)
        kp.unpermute(xp * 2, info, w).sum().backward()
        return xp

    step()  # compile every kernel outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        xp = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rxp, rinfo = ref.permute(x.detach(), ids, E, pad_to=16)
    assert torch.equal(xp[: rxp.shape[0]], rxp) and not xp[rxp.shape[0]:].any()


@pytest.mark.gpu
def test_gpu_sync_free_permute_op():
    """The public permute with num_rows=max_permuted_rows (the layer's call) and its unpermute,
    forward and backward, never synchronize with the host on the Triton backend."""
    T, K, E, d = 512, 4, 16, 256
    ids = torch.randint(-1, E, (T, K), device="cuda")
    x = torch.randn(T, d, device="cuda", requires_grad=True)
    w = torch.rand(T, K, device="cuda", requires_grad=True)
    N = tm.max_permuted_rows(T, K, E)

    def step():
        xp, info = kp.permute(x, ids, E, num_rows=N)
        kp.unpermute(xp * 2, info, w).sum().backward()
        return xp

    step()  # compile every kernel outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        xp = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rxp, _ = ref.permute(x.detach(), ids, E)
    assert xp.shape[0] == N and torch.equal(xp[: rxp.shape[0]], rxp) and not xp[rxp.shape[0]:].any()


def _kernel_names(fn) -> set[str]:
    """Names of the CUDA kernels ``fn`` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@pytest.mark.gpu
@pytest.mark.parametrize("ffn_path,train", [("auto", False), ("auto", True), ("unfused", False)])
def test_gpu_layer_runs_the_permute_kernels_on_its_unfused_path(ffn_path, train):
    """On CUDA with backend "auto": for inference (no grad) "auto" runs the fused moe_ffn (no
    permuted buffer, so no permute / unpermute kernels); for training (grad enabled, parameters
    that require grad) "auto" and ffn_path="unfused" permute and unpermute with the Triton
    kernels. All match the reference layer."""
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(64, 128, 8, 2, backend="auto", ffn_path=ffn_path), device="cuda")
    ref_layer = tm.MoELayer(tm.MoEConfig(64, 128, 8, 2, backend="torch"), device="cuda")
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(3, 17, 64, device="cuda")
    with torch.set_grad_enabled(train):
        layer(x)  # compile outside the profile
        out = {}
        names = _kernel_names(lambda: out.setdefault("y", layer(x)))
        want = ref_layer(x)
    moved = {k for k in ("_scatter_rows_kernel", "_gather_rows_kernel") if any(k in n for n in names)}
    if ffn_path == "unfused" or train:
        assert layer.ffn_path_used == "unfused"
        assert moved == {"_scatter_rows_kernel", "_gather_rows_kernel"}, sorted(names)
    else:
        assert layer.ffn_path_used == "fused"
        assert not moved, sorted(names)
    torch.testing.assert_close(out["y"], want, rtol=1e-5, atol=1e-5)
