"""What the ops do with out-of-range metadata when value checks are off, on both backends.

The decision (docs/functional.md, "Semantics decided here"): with ``set_validation(False)`` an expert id
outside [-1, E) and a slot row outside [-1, R) mean "not routed", exactly like -1, and offsets
are clamped into [0, R]; both backends agree, nothing is read or written out of bounds, and no
internal error escapes. It costs nothing on the hot path: the kernels compare every id or row
against its range anyway. Inconsistent metadata beyond that (decreasing offsets, two slots on one
row, counts that disagree) is memory-safe and keeps the documented output shapes, but its
values are unspecified. Before the fix, the reference crashed with an internal RuntimeError on
ids of E+3, 2**32 and -5 while the Triton kernels dropped them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tritonmoe as tm
from tritonmoe import reference as ref

BACKENDS = ["torch", "triton"]  # triton runs in the interpreter on CPU
E = 4
IDS = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [1, 2]])
T, K = IDS.shape


def _x(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _bad_ids(bad: int, dtype=torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with slots (0, 0) and (3, 1) set to ``bad``, the same ids with -1 there)."""
    got, want = IDS.clone().to(dtype), IDS.clone().to(dtype)
    for t, j in ((0, 0), (3, 1)):
        got[t, j] = bad
        want[t, j] = -1
    return got, want


OUT_OF_RANGE_IDS = [(E, torch.int64), (E + 3, torch.int64), (2**32, torch.int64), (-5, torch.int64),
                    (-2, torch.int32), (100, torch.int8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad,dtype", OUT_OF_RANGE_IDS, ids=[f"{b}-{d}".replace("torch.", "") for b, d in OUT_OF_RANGE_IDS])
def test_out_of_range_ids_are_not_routed(bad, dtype, backend):
    """permute with an id outside [-1, E) equals permute with -1 there (metadata and rows), and
    the whole permute -> unpermute path and moe_ffn give the same result as with -1."""
    ids, want_ids = _bad_ids(bad, dtype)
    x = _x(T, 6)
    w = torch.rand(T, K)
    with tm.validation(False):
        xp, info = tm.permute(x, ids, E, pad_to=2, backend=backend)
        out = tm.unpermute(xp, info, w, backend=backend)
    xp_ref, info_ref = ref.permute(x, want_ids, E, pad_to=2)
    assert torch.equal(info.slot_rows, info_ref.slot_rows)
    assert torch.equal(info.expert_offsets, info_ref.expert_offsets)
    assert torch.equal(info.counts, info_ref.counts)
    assert torch.equal(xp, xp_ref)
    torch.testing.assert_close(out, ref.unpermute(xp_ref, info_ref, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_in_moe_ffn(backend):
    w1, w2 = _x(E, 6, 8, seed=1) * 0.3, _x(E, 4, 6, seed=2) * 0.3
    x = _x(T, 6, seed=3)
    routed = tm.route(_x(T, E, seed=4), K)
    for bad in (E + 3, 2**32, -5):
        ids, want_ids = _bad_ids(bad)
        # counts describe the routed (in-range) slots, as moe_ffn requires of any Routing
        counts = torch.bincount(want_ids[want_ids >= 0].long(), minlength=E).to(torch.int32)
        got_r = dataclasses.replace(routed, topk_ids=ids, counts=counts)
        want_r = dataclasses.replace(routed, topk_ids=want_ids.to(torch.int32), counts=counts)
        with tm.validation(False):
            got = tm.moe_ffn(x, got_r, w1, w2, backend=backend)
        torch.testing.assert_close(got, ref.moe_ffn(x, want_r, w1, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_slot_rows_are_not_routed(backend):
    """unpermute: a slot row below -1 or at/after R contributes nothing (as -1), forward; the
    weight gradient of such a slot is 0 and the backward stays in bounds."""
    x = _x(T, 6)
    xp, info = ref.permute(x, IDS, E)
    R = xp.shape[0]
    rows, want_rows = info.slot_rows.clone(), info.slot_rows.clone()
    for (t, j), v in (((0, 0), -5), ((2, 1), R), ((4, 0), 2**40)):
        rows[t, j], want_rows[t, j] = v, -1
    y = _x(R, 6, seed=5).requires_grad_()
    w = torch.rand(T, K).requires_grad_()
    with tm.validation(False):
        out = tm.unpermute(y, dataclasses.replace(info, slot_rows=rows), w, backend=backend)
    out.backward(torch.ones_like(out))
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = ref.unpermute(y2, dataclasses.replace(info, slot_rows=want_rows), w2)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w.grad, w2.grad)
    assert w.grad[0, 0] == 0 and w.grad[2, 1] == 0 and w.grad[4, 0] == 0
    # y's gradient on rows no remaining slot holds is unspecified (not zeroed: that would cost a
    # memset of the whole buffer); the rows the remaining slots hold are exact.
    held = want_rows[want_rows >= 0]
    torch.testing.assert_close(y.grad[held], y2.grad[held])


OFFSETS_CLAMPED = [
    ("offsets[E] past R", [0, 3, 5, 9], [0, 3, 5, 7]),
    ("negative first offset", [-4, 3, 5, 7], [0, 3, 5, 7]),
    ("an offset past R, then R", [0, 30, 7, 7], None),  # decreasing: shape only
    ("offsets not starting at 0", [2, 3, 5, 7], None),  # shape only
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,offsets,equiv", OFFSETS_CLAMPED, ids=[c[0] for c in OFFSETS_CLAMPED])
def test_offsets_are_clamped(name, offsets, equiv, backend):
    """grouped_gemm / grouped_ffn: offsets outside [0, R] are clamped into it (equal to the
    clamped offsets); decreasing offsets or a non-zero start keep the output's shape and raise
    nothing (values unspecified)."""
    R = 7
    x = _x(R, 8)
    w = _x(3, 8, 5, seed=1)
    w1, w2 = _x(3, 8, 6, seed=2), _x(3, 3, 8, seed=3)
    o = torch.tensor(offsets)
    with tm.validation(False):
        y = tm.grouped_gemm(x, o, w, backend=backend)
        z = tm.grouped_ffn(x, o, w1, w2, backend=backend)
    assert y.shape == (R, 5) and z.shape == (R, 8)
    if equiv is not None:
        e = torch.tensor(equiv)
        torch.testing.assert_close(y, ref.grouped_gemm(x, e, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z, ref.grouped_ffn(x, e, w1, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inconsistent_permute_info_is_memory_safe(backend):
    """Two slots on one row, counts and offsets that disagree with the rows and a segment past
    the buffer: unpermute's forward and backward raise nothing and keep their shapes."""
    x = _x(T, 6)
    xp, info = ref.permute(x, IDS, E)
    R = xp.shape[0]
    rows = info.slot_rows.clone()
    rows[1, 0] = rows[0, 0]
    bad = dataclasses.replace(
        info,
        slot_rows=rows,
        counts=torch.tensor([5, 0, 40, -3], dtype=torch.int32),
        expert_offsets=torch.tensor([0, 2, 2, 60, 9]),
    )
    y = _x(R, 6, seed=6).requires_grad_()
    w = torch.rand(T, K).requires_grad_()
    with tm.validation(False):
        out = tm.unpermute(y, bad, w, backend=backend)
    out.sum().backward()
    assert out.shape == (T, 6) and y.grad.shape == y.shape and w.grad.shape == w.shape
