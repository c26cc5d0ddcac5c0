"""The launchers' host-side helpers (kernels/_host.py) and the router's cached launch problem."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.kernels import _host
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import routing as kr


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_cdiv_equals_triton(a, b):
    assert _host.cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


@given(st.integers(0, 2**40))
def test_next_power_of_2_equals_triton(n):
    got = _host.next_power_of_2(n)
    assert got == triton.next_power_of_2(n)
    assert n == 0 and got == 0 or got >= n and got & (got - 1) == 0 and (got == 1 or got // 2 < n)


@pytest.mark.parametrize("n, want", [(0, 0), (1, 1), (2, 2), (3, 4), (128, 128), (129, 256)])
def test_next_power_of_2_named(n, want):
    assert _host.next_power_of_2(n) == want


def test_launchers_do_not_call_tritons_host_helpers():
    """triton.cdiv is a constexpr_function in Triton >= 3.5: microseconds per host call."""
    import inspect

    from tritonmoe.kernels import _gemm_config, _grouped_gemm_persistent, grouped_gemm, partition, permute

    for mod in (kr, permute, grouped_gemm, partition, _gemm_config, _grouped_gemm_persistent):
        src = inspect.getsource(mod)
        assert "triton.cdiv(" not in src and "triton.next_power_of_2(" not in src, mod.__name__


def test_route_problem_is_cached_and_the_override_still_applies():
    kr._problem.cache_clear()
    x = torch.randn(8, 16)
    a = tm.route(x, 2, backend="triton")
    b = tm.route(x, 2, backend="triton")
    info = kr._problem.cache_info()
    assert info.misses == 1 and info.hits == 1
    torch.testing.assert_close(a.topk_weights, b.topk_weights, rtol=0, atol=0)
    assert torch.equal(a.topk_ids, b.topk_ids)
    # a config override changes the launch config of a cached problem, not the cache
    cfg = dataclasses.replace(kr.route_config(16, interpret=True), block_t=2, bwd_block_t=2)
    with CF.override("route", cfg):
        c = tm.route(x, 2, backend="triton")
    assert kr._problem(8, 16, 2, None, None, "softmax", True, None, False, "top2sum", 1.0, True).config != cfg
    assert torch.equal(c.topk_ids, a.topk_ids)
    # a different problem is a different entry, with its own checks
    with pytest.raises(ValueError, match="tile of"):
        kr._problem(4, 2 * kr.MAX_TILE_LANES, 2, None, None, "softmax", True, None, False, "top2sum", 1.0, True)


def test_bench_host_measures_the_router_launchers(tmp_path):
    """``python -m bench host``: every case measured, each with its stubbed launches counted."""
    import json

    from bench import host

    out = tmp_path / "host.json"
    assert host.main(["--calls", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [c for c, _ in host.CASES]
    assert all(r["host_us"] > 0 for r in rows)
    assert [r["launches_per_call"] for r in rows] == [1, 1, 3]  # fwd kernel; + capacity scan and keep


def test_bench_host_refuses_zero_calls():
    from bench import host

    with pytest.raises(SystemExit):
        host.main(["--calls", "0"])
