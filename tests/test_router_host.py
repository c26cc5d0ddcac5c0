"""The Triton router's host path and its fused checks (issue 29, item 5).

* The eager call is its outputs and one launch: every ATen op outside the kernel launches is
  counted (a dispatch mode, switched off inside the launches, where Triton's interpreter runs
  its own ops) and host syncs by tests/_sync.py: dropless without aux, validation off, with an
  expert bias: ids, weights, zeroed counts, one forward launch, no other op, no sync; with
  validation on: one more zeroed int32 (the check flag) and its one read back.
* The value checks fused into the forward kernel raise the reference's errors (same type and
  message), wherever in the batch the bad value sits (several token blocks); a zero-token call
  still checks the bias.
* The fused non-finite bias guard: validation off, every weight NaN (dropless: in the kernel;
  with capacity: on the final weights), gradients w.r.t. the logits as the reference's.
"""

from __future__ import annotations

import collections

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import tritonmoe as tm
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import routing as kr

from _sync import HostSyncs

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's CPU path"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

_SMALL_BLOCKS = kr.RouteConfig(block_t=4, num_warps=4, bwd_block_t=4, bwd_num_warps=4, scan_split_slots=False)


class _Ops(TorchDispatchMode):
    """ATen ops outside kernel launches (``paused`` > 0 inside them)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """(ops mode, launches counter): every Triton kernel of kernels.routing counted per launch."""
    mode, launches = _Ops(), collections.Counter()

    class Counting:
        def __init__(self, name, k):
            self.name, self.k = name, k

        def __getitem__(self, grid):
            def run(*a, **kw):
                launches[self.name] += 1
                mode.paused += 1
                try:
                    return self.k[grid](*a, **kw)
                finally:
                    mode.paused -= 1
            return run

    for attr, obj in list(vars(kr).items()):
        if isinstance(obj, triton.runtime.jit.KernelInterface):
            monkeypatch.setattr(kr, attr, Counting(attr, obj))
    return mode, launches


OUTPUTS = {"aten.empty.memory_format": 2, "aten.zeros.default": 1}  # ids, weights; counts (zeroed)


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_eager_call_is_its_outputs_and_one_launch(counted, validate, grad):
    mode, launches = counted
    x = torch.randn(24, 16).requires_grad_(grad)
    bias = torch.randn(16)
    call = lambda: tm.route(x, 4, score_func="sigmoid", expert_bias=bias, backend="triton")  # noqa: E731
    with tm.validation(validate):
        want = call()
        launches.clear()
        with HostSyncs() as s, mode:
            got = call()
    assert dict(launches) == {"_route_fwd_kernel": 1}
    expected = dict(OUTPUTS)
    if validate:  # the check flag, zeroed, and its one read back
        expected["aten.zeros.default"] += 1
        expected["aten._local_scalar_dense.default"] = 1
    if grad:  # autograd saves nothing by copy; a detached view of the ids for the backward's bookkeeping is all
        mode.ops.pop("aten.detach.default", None)
    assert dict(mode.ops) == expected, dict(mode.ops)
    assert len(s.syncs) == (1 if validate else 0), s.where()
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)


def _bad(kind: str, T: int, E: int):
    x = torch.randn(T, E)
    bias = None
    score_func = "softmax"
    if kind == "nan":
        x[T - 2, 3] = float("nan")
    elif kind == "posinf":
        x[T - 1, 0] = float("inf")
    elif kind == "row_all_neginf":
        x[T - 3] = float("-inf")
    elif kind in ("bias_inf", "bias_nan"):
        score_func = "sigmoid"
        bias = torch.zeros(E)
        bias[E - 1] = float("inf") if kind == "bias_inf" else float("nan")
    return x, dict(score_func=score_func, expert_bias=bias)


@pytest.mark.parametrize("kind", ["nan", "posinf", "row_all_neginf", "bias_inf", "bias_nan"])
@pytest.mark.parametrize("capacity", [None, 3])
def test_fused_checks_raise_the_reference_errors(kind, capacity):
    x, kw = _bad(kind, 11, 8)  # 3 token blocks of 4: the bad value is in a later program
    with pytest.raises(ValueError) as want:
        tm.route(x, 2, capacity=capacity, backend="torch", **kw)
    with CF.override("route", _SMALL_BLOCKS), pytest.raises(ValueError) as got:
        tm.route(x, 2, capacity=capacity, backend="triton", **kw)
    assert str(got.value) == str(want.value)
    # valid logits of the same call pass the fused check
    tm.route(torch.randn(11, 8), 2, capacity=capacity, backend="triton", score_func=kw["score_func"])


def test_zero_tokens_still_check_the_bias():
    bias = torch.zeros(8)
    bias[2] = float("inf")
    with pytest.raises(ValueError, match=r"expert_bias\[2\]=inf"):
        tm.route(torch.randn(0, 8), 2, score_func="sigmoid", expert_bias=bias, backend="triton")


@pytest.mark.parametrize("capacity", [None, 3])
def test_fused_bias_guard_matches_the_reference(capacity):
    torch.manual_seed(1)
    bias = torch.randn(8) * 0.1
    bias[5] = float("nan")
    g = torch.randn(11, 2)
    out = {}
    for backend in ("torch", "triton"):
        x = torch.randn(11, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with tm.validation(False), CF.override("route", _SMALL_BLOCKS):
            r = tm.route(x, 2, score_func="sigmoid", expert_bias=bias, capacity=capacity, backend=backend)
        (r.topk_weights * g).nan_to_num(0.0).sum().backward()
        out[backend] = (r.topk_ids, r.topk_weights, x.grad)
    ids, w, dx = out["triton"]
    assert torch.isnan(w).all()
    assert torch.equal(ids, out["torch"][0])
    torch.testing.assert_close(dx, out["torch"][2], rtol=1e-5, atol=1e-6)
    # a finite bias leaves the weights finite (the guard adds 0)
    with tm.validation(False):
        r = tm.route(torch.randn(11, 8), 2, score_func="sigmoid", expert_bias=torch.zeros(8), backend="triton")
    assert torch.isfinite(r.topk_weights).all()
