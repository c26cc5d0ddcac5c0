"""The partition/concat op (copy_segments) and the chunk transpose built on it: the Triton kernel
(Triton's interpreter on CPU) against tritonmoe.reference, exactly (it is a copy), with its
gradient; the public entry point's validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonmoe import reference
from tritonmoe.comm import chunk_transpose_segments, copy_segments, transpose_chunks
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import partition as kp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = kp.PartitionConfig(block_r=2, block_d=4, num_warps=1)  # many programs, column tiles


def _poisoned_src(R: int, D: int, dtype, covered_rows) -> torch.Tensor:
    """Random rows; rows no segment reads are NaN, so a kernel that reads them fails loudly."""
    src = torch.full((R, D), float("nan"), dtype=dtype)
    idx = torch.tensor(sorted(covered_rows), dtype=torch.long)
    if idx.numel():
        src[idx] = torch.randn(idx.numel(), D).to(dtype)
    return src


def _run_both(src, s, d, n, rows, config=None):
    ref = reference.copy_segments(src, s, d, n, rows)
    if config is None:
        got = kp.copy_segments(src, s, d, n, rows)
    else:
        with CF.override("partition", config):
            got = kp.copy_segments(src, s, d, n, rows)
    return got, ref


@st.composite
def segment_problems(draw):
    """C disjoint segments: random lengths (zeros included), a random source order with gaps and
    a random destination order with gaps (uncovered output rows)."""
    C = draw(st.integers(0, 6))
    lengths = draw(st.lists(st.integers(0, 5), min_size=C, max_size=C))
    src_gaps = draw(st.lists(st.integers(0, 2), min_size=C + 1, max_size=C + 1))
    dst_gaps = draw(st.lists(st.integers(0, 2), min_size=C + 1, max_size=C + 1))
    src_order = draw(st.permutations(list(range(C))))
    dst_order = draw(st.permutations(list(range(C))))

    def place(order, gaps):
        starts, pos = [0] * C, gaps[0]
        for j, c in enumerate(order):
            starts[c] = pos
            pos += lengths[c] + gaps[j + 1]
        return starts, pos

    src_starts, R = place(src_order, src_gaps)
    dst_starts, rows = place(dst_order, dst_gaps)
    D = draw(st.sampled_from([1, 3, 8, 17]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.float64]))
    tiny = draw(st.booleans())
    return src_starts, dst_starts, lengths, R, rows, D, dtype, tiny


@settings(max_examples=25)
@given(segment_problems())
def test_copy_segments_kernel_matches_reference(problem):
    src_starts, dst_starts, lengths, R, rows, D, dtype, tiny = problem
    covered = {s + i for s, n in zip(src_starts, lengths) for i in range(n)}
    src = _poisoned_src(R, D, dtype, covered).requires_grad_()
    s, d, n = (torch.tensor(v, dtype=torch.int64) for v in (src_starts, dst_starts, lengths))
    got, ref = _run_both(src, s, d, n, rows, TINY if tiny else None)
    assert got.dtype == dtype and got.shape == (rows, D)
    assert torch.equal(got, ref)
    g = torch.randn(rows, D).to(dtype)
    (g_got,) = torch.autograd.grad(got, src, g)
    # The reference is disconnected from src when nothing is copied (its gradient is zero).
    g_ref = torch.autograd.grad(ref, src, g)[0] if ref.requires_grad else torch.zeros_like(src)
    assert torch.equal(g_got, g_ref)  # the reverse copy; unread rows get zero gradient


@pytest.mark.parametrize(
    "src_starts, dst_starts, lengths, R, rows, why",
    [
        ([], [], [], 3, 4, "no segments: all-zero output"),
        ([0], [0], [5], 5, 5, "one segment, identity"),
        ([2, 0], [0, 3], [0, 0], 4, 2, "only empty segments"),
        ([0, 2, 2], [3, 3, 0], [2, 0, 2], 4, 5, "an empty segment tied with a full one at the same start"),
        ([0, 2], [2, 2], [2, 0], 2, 4, "an empty segment starting inside another's destination range"),
        ([0], [0], [3], 3, 0, "zero output rows"),
    ],
)
def test_copy_segments_edge_cases(src_starts, dst_starts, lengths, R, rows, why):
    if rows == 0:
        lengths, src_starts, dst_starts = [0], [0], [0]
    src = torch.randn(R, 6)
    s, d, n = (torch.tensor(v, dtype=torch.int64) for v in (src_starts, dst_starts, lengths))
    for cfg in (None, TINY):
        got, ref = _run_both(src, s, d, n, rows, cfg)
        assert torch.equal(got, ref), why


def test_copy_segments_non_contiguous_source_and_int32_metadata():
    base = torch.randn(9, 10)
    for src in (base[:, 2:7], base.t()[:5].t()):  # a row-strided view, a column-major view
        s = torch.tensor([4, 0], dtype=torch.int32)
        d = torch.tensor([0, 5], dtype=torch.int32)
        n = torch.tensor([5, 3], dtype=torch.int32)
        got, ref = _run_both(src, s, d, n, 8, TINY)
        assert torch.equal(got, ref)


def test_config_override_is_scoped():
    default = kp.select_config(64, 4)
    with CF.override("partition", TINY):
        assert kp.select_config(64, 4) == TINY
    assert kp.select_config(64, 4) == default
    with pytest.warns(DeprecationWarning, match="override_config"):  # the old spelling, an alias
        with kp.override_config(TINY):
            assert kp.select_config(64, 4) == TINY


@settings(max_examples=20)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.data(),
    st.sampled_from(["torch", "triton"]),
)
def test_transpose_chunks_layout_and_inverse(A, B, data, backend):
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=A * B, max_size=A * B))).view(A, B)
    R = int(counts.sum())
    x = torch.randn(R, 5, dtype=torch.float64, requires_grad=True)
    y = transpose_chunks(x, counts, backend=backend)
    # Expected: chunk (a, b) of x moved to position (b, a).
    chunks = list(torch.split(x.detach(), counts.reshape(-1).tolist()))
    want = torch.cat([chunks[a * B + b] for b in range(B) for a in range(A)]) if R else x.detach()
    assert torch.equal(y.detach(), want)
    back = transpose_chunks(y, counts.t(), backend=backend)
    assert torch.equal(back.detach(), x.detach())
    g = torch.randn(R, 5, dtype=torch.float64)
    (gx,) = torch.autograd.grad(back, x, g)
    assert torch.equal(gx, g)  # the composition is the identity, so is its gradient


def test_chunk_transpose_segments_worked_example():
    # Chunks (a, b) with counts [[1, 2], [3, 0]] stored as a0b0 | a0b1 a0b1 | a1b0 x3 | (a1b1 empty)
    # go to b0: a0b0, a1b0 x3 | b1: a0b1 x2 | (a1b1).
    s, d, n = chunk_transpose_segments(torch.tensor([[1, 2], [3, 0]]))
    assert s.tolist() == [0, 1, 3, 6]
    assert d.tolist() == [0, 4, 1, 6]
    assert n.tolist() == [1, 2, 3, 0]


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(src_starts=torch.tensor([0, 2]), dst_starts=torch.tensor([0, 1]), lengths=torch.tensor([2, 2])),
         ValueError, "overlap in the output"),
        (dict(src_starts=torch.tensor([0, 1]), dst_starts=torch.tensor([0, 2]), lengths=torch.tensor([2, 2])),
         ValueError, "overlap in src"),
        (dict(src_starts=torch.tensor([3]), dst_starts=torch.tensor([0]), lengths=torch.tensor([2])),
         IndexError, r"src rows \[3, 5\) outside \[0, 4\)"),
        (dict(src_starts=torch.tensor([0]), dst_starts=torch.tensor([5]), lengths=torch.tensor([2])),
         IndexError, "the output rows"),
        (dict(src_starts=torch.tensor([0]), dst_starts=torch.tensor([0]), lengths=torch.tensor([-1])),
         ValueError, "lengths must be >= 0"),
        (dict(src_starts=torch.tensor([0.0]), dst_starts=torch.tensor([0]), lengths=torch.tensor([1])),
         TypeError, "src_starts has dtype torch.float32"),
        (dict(src_starts=torch.tensor([0, 1]), dst_starts=torch.tensor([0]), lengths=torch.tensor([1])),
         ValueError, "same shape"),
    ],
)
def test_copy_segments_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        copy_segments(torch.randn(4, 3), num_rows=6, **kwargs)


def test_transpose_chunks_validation():
    with pytest.raises(ValueError, match="sum to the 4 rows"):
        transpose_chunks(torch.randn(4, 3), torch.tensor([[1, 1], [1, 0]]))
