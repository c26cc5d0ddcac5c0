"""A PermuteInfo built or edited by the caller is validated at unpermute's boundary.

Users build and slice ``PermuteInfo`` (micro-batching, expert parallelism), so unpermute checks
it like ids and offsets: dtypes and shapes always, values (offsets, counts, slot rows and their
consistency) while validation is on, on every backend, before any launch. Each case of the
table below returned a finite, wrong tensor or crashed with an internal error before the check
existed. The property at the end compares the validation's verdict on randomly tampered slot
rows with an independent per-row check written here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import reference as ref

from strategies import permute_cases

BACKENDS = ["torch", "triton"]  # triton runs in the interpreter on CPU

# ids [[1, 0], [1, 2], [-1, 1], [2, 0]], E=3, pad_to=2: counts [2, 3, 2], offsets [0, 2, 6, 8],
# slot_rows [[2, 0], [3, 6], [-1, 4], [7, 1]]; row 5 is expert 1's padding.
X = torch.randn(4, 5)
IDS = torch.tensor([[1, 0], [1, 2], [-1, 1], [2, 0]])
W = torch.rand(4, 2)


def _info(**changes) -> tm.PermuteInfo:
    _, info = ref.permute(X, IDS, 3, pad_to=2)
    return dataclasses.replace(info, **changes)


def _rows(**cells) -> torch.Tensor:
    """The valid slot_rows with some cells changed: ``_rows(r0c1=5)`` sets slot_rows[0, 1] = 5."""
    rows = _info().slot_rows.clone()
    for key, v in cells.items():
        rows[int(key[1]), int(key[3])] = v
    return rows


def _y(info: tm.PermuteInfo, rows: int | None = None) -> torch.Tensor:
    R = int(info.expert_offsets[-1]) if rows is None else rows
    return torch.randn(R, X.shape[1])


# (name, info, y rows (None: R), error type, fragment of the message)
TAMPERED = [
    # -- slot rows out of range or of the wrong type (the probe's findings) --
    ("slot row -5", _info(slot_rows=_rows(r0c0=-5)), None, IndexError, "info.slot_rows[0, 0]=-5 is outside [-1, R=8)"),
    ("slot row == R", _info(slot_rows=_rows(r0c0=8)), None, IndexError, "info.slot_rows[0, 0]=8 is outside [-1, R=8)"),
    ("slot row 2**40", _info(slot_rows=_rows(r3c1=2**40)), None, IndexError, str(2**40)),
    ("float slot_rows", _info(slot_rows=_info().slot_rows.float()), None, TypeError, "info.slot_rows has dtype torch.float32"),
    ("int16 slot_rows", _info(slot_rows=_info().slot_rows.short()), None, TypeError, "use int64 (or int32)"),
    ("slot_rows 1-D", _info(slot_rows=_info().slot_rows.flatten()), None, ValueError, "info.slot_rows must be 2-D"),
    # -- slot rows inconsistent with offsets / counts --
    ("slot row in padding", _info(slot_rows=_rows(r0c0=5)), None, ValueError, "info.slot_rows[0, 0]=5 is not a data row"),
    ("two slots share a row", _info(slot_rows=_rows(r0c0=3)), None, ValueError, "row 3 of the permuted buffer is held by several slots"),
    ("a routed slot dropped", _info(slot_rows=_rows(r0c1=-1)), None, ValueError, "info.counts[0]=2 but 1 slots point into expert 0"),
    # -- offsets and counts --
    ("offsets[0] != 0", _info(expert_offsets=torch.tensor([1, 2, 6, 8])), None, ValueError, "info.expert_offsets[0]=1"),
    ("offsets decrease", _info(expert_offsets=torch.tensor([0, 6, 2, 8])), None, ValueError, "not monotone"),
    # A buffer may have rows past R (permute(..., num_rows=N)), never fewer than R.
    ("offsets[E] > rows", _info(), 7, ValueError, "info.expert_offsets[E]=8 but the buffer has only 7 rows"),
    ("offsets float", _info(expert_offsets=torch.tensor([0.0, 2, 6, 8])), None, TypeError, "info.expert_offsets has dtype torch.float32"),
    ("offsets length", _info(expert_offsets=torch.tensor([0, 2, 8])), None, ValueError, "expected 4 (E+1"),
    ("negative count", _info(counts=torch.tensor([2, -1, 2], dtype=torch.int32)), None, ValueError, "info.counts[1]=-1 is negative"),
    ("counts vs offsets", _info(counts=torch.tensor([2, 5, 2], dtype=torch.int32)), None, ValueError, "gives expert 1 4 rows but info.counts[1]=5"),
    ("counts vs slots", _info(counts=torch.tensor([2, 4, 2], dtype=torch.int32)), None, ValueError, "info.counts[1]=4 but 3 slots"),
    ("pad_to vs offsets", _info(pad_to=4), None, ValueError, "rounded up to pad_to=4 is 4"),
    ("counts float", _info(counts=torch.tensor([2.0, 3, 2])), None, TypeError, "info.counts has dtype torch.float32"),
    # -- the scalar fields --
    ("num_tokens mismatch", _info(num_tokens=3), None, ValueError, "info.num_tokens=3 but info.slot_rows has 4 rows"),
    ("num_tokens float", _info(num_tokens=4.0), None, TypeError, "info.num_tokens must be an int"),
    ("pad_to 0", _info(pad_to=0), None, ValueError, "info.pad_to=0"),
    ("not a PermuteInfo", (_info().expert_offsets, _info().slot_rows), 8, TypeError, "info must be the tritonmoe.PermuteInfo"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,info,rows,exc,fragment", TAMPERED, ids=[c[0] for c in TAMPERED])
def test_tampered_permute_info_raises(name, info, rows, exc, fragment, backend):
    y = _y(_info(), rows)
    with pytest.raises(exc) as err:
        tm.unpermute(y, info, W, backend=backend)
    assert fragment in str(err.value), str(err.value)


def test_dtype_checks_run_with_validation_off():
    """Dtype and shape checks need no sync and always run: a float slot_rows is a TypeError even
    with value checks switched off (before: an internal IndexError in the reference and a wrong
    tensor on the Triton backend)."""
    with tm.validation(False):
        with pytest.raises(TypeError, match="info.slot_rows has dtype"):
            tm.unpermute(_y(_info()), _info(slot_rows=_info().slot_rows.float()), W)


@pytest.mark.parametrize("backend", BACKENDS)
def test_user_built_infos_are_accepted(backend):
    """Legal PermuteInfos that permute() did not produce pass: int32 fields, slots in another
    order inside a segment, and a micro-batch's info (a slice of the tokens, permuted alone)."""
    info = _info()
    y = _y(info)
    want = ref.unpermute(y, info, W)
    narrow = dataclasses.replace(info, slot_rows=info.slot_rows.int(), expert_offsets=info.expert_offsets.int())
    torch.testing.assert_close(tm.unpermute(y, narrow, W, backend=backend), want)
    # expert 1's data rows 2, 3, 4 held by slots (0,0), (1,0), (2,1): rotate them
    rotated = _info(slot_rows=_rows(r0c0=3, r1c0=4, r2c1=2))
    y2 = y.clone()
    y2[[3, 4, 2]] = y[[2, 3, 4]]
    torch.testing.assert_close(tm.unpermute(y2, rotated, W, backend=backend), want)
    xp, mb = tm.permute(X[1:3], IDS[1:3], 3, pad_to=2)
    torch.testing.assert_close(tm.unpermute(xp, mb, W[1:3], backend=backend), ref.unpermute(xp, mb, W[1:3]))


def _naive_valid(rows: list[list[int]], offsets: list[int], counts: list[int]) -> bool:
    """Independent check of slot rows against valid offsets/counts: every row -1 or a data row
    (inside [offsets[e], offsets[e] + counts[e]) for some e), no row twice, every data row held."""
    data = {r for e in range(len(counts)) for r in range(offsets[e], offsets[e] + counts[e])}
    held = [r for row in rows for r in row if r != -1]
    return all(r in data for r in held) and len(held) == len(set(held)) and set(held) == data


@settings(max_examples=60)
@given(
    case=permute_cases(max_tokens=8, max_d=2),
    edits=st.lists(st.tuples(st.integers(0, 63), st.integers(-3, 3), st.booleans()), min_size=1, max_size=3),
)
def test_tampered_slot_rows_property(case, edits):
    """Random edits of a valid info's slot rows (a nearby row, a copy of another slot's row, -1,
    -2, R): unpermute raises exactly when the edited rows break the bijection (checked by a
    naive loop), and never reads out of range when it accepts."""
    _, info = ref.permute(case.x, case.ids, case.num_experts, pad_to=case.pad_to)
    rows = info.slot_rows.clone().flatten()
    S = rows.numel()
    if S == 0:
        return
    R = int(info.expert_offsets[-1])
    for pos, delta, copy in edits:
        s = pos % S
        rows[s] = rows[(s + delta) % S] if copy else rows[s] + delta
    tampered = dataclasses.replace(info, slot_rows=rows.view_as(info.slot_rows))
    y = torch.randn(R, case.x.shape[1])
    valid = _naive_valid(tampered.slot_rows.tolist(), info.expert_offsets.tolist(), info.counts.tolist())
    if valid:
        out = tm.unpermute(y, tampered, case.weights)
        torch.testing.assert_close(out, ref.unpermute(y, tampered, case.weights))
    else:
        with pytest.raises((ValueError, IndexError)):
            tm.unpermute(y, tampered, case.weights)
