"""The fused Triton router (tritonmoe.kernels.routing) against tritonmoe.reference.route.

Every call goes through the public entry point ``tritonmoe.route(..., backend="triton")``. On CPU
the kernels run in Triton's interpreter with fp32 and fp16 logits; on CUDA (marker ``gpu``) with
bf16 too. Metadata (ids, dropped slots, counts, selected_counts) must match exactly; weights,
score sums and logsumexp to ~1e-6 (both sides compute fp32 scores from the same inputs, so only
the rounding of exp and of the sums differs: a wrong lane or a wrong token is off by far more).

The interpreter runs programs one after another and every reduction costs milliseconds, so the
shapes are small; two small-block configurations force several token blocks, so the capacity
scan crosses blocks, scan tiles and (per-slot scan) slot programs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import _settings, dispatch, kernels
from tritonmoe import reference as ref
from tritonmoe.kernels import routing as kr

from strategies import EXPERT_COUNTS, route_cases

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
EXPERTS = EXPERT_COUNTS + [16, 31, 60, 64, 67]  # E=1, primes, powers of two and not
# CPU: the interpreter does fp16 and fp32 (its bf16 arithmetic is unreliable); CUDA: all three.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])

# Several token blocks of 2, per-slot scan programs, scan tiles of 4 rows x 16 experts.
SMALL_SPLIT = kr.RouteConfig(block_t=2, num_warps=4, bwd_block_t=4, bwd_num_warps=4,
                             scan_block_r=4, scan_block_e=16, scan_split_slots=True)
# Token blocks of 4, one scan program down all slots, scan tiles of 2 rows x 4 experts.
SMALL_SERIAL = kr.RouteConfig(block_t=4, num_warps=4, bwd_block_t=2, bwd_num_warps=4,
                              scan_block_r=2, scan_block_e=4, scan_split_slots=False)
CONFIGS = [None, SMALL_SPLIT, SMALL_SERIAL]

W_TOL = dict(rtol=1e-5, atol=1e-6)  # weights in [0, 1], fp32
AUX_TOL = dict(rtol=1e-5, atol=1e-5)  # score sums over up to ~40 tokens, logsumexp


def _config_ctx(config):
    return kr.config_override(config) if config is not None else contextlib.nullcontext()


def _to_dev(case_kwargs):
    kw = dict(case_kwargs)
    if kw.get("expert_bias") is not None:
        kw["expert_bias"] = kw["expert_bias"].to(DEV)
    return kw


def _route_both(logits, k, kwargs, *, with_aux=False, config=None):
    with _config_ctx(config):
        got = tm.route(logits, k, backend="triton", with_aux=with_aux, **kwargs)
    want = ref.route(logits, k, with_aux=with_aux, **kwargs)
    return got, want


def _assert_same_routing(got, want, *, with_aux=False):
    T, k = want.topk_ids.shape
    E = want.counts.shape[0]
    assert got.topk_ids.dtype == torch.int32 and got.topk_ids.shape == (T, k)
    assert got.topk_weights.dtype == torch.float32 and got.topk_weights.shape == (T, k)
    assert got.counts.dtype == torch.int32 and got.counts.shape == (E,)
    assert got.selected_counts.dtype == torch.int32 and got.selected_counts.shape == (E,)
    assert got.score_func == want.score_func
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.counts, want.counts)
    assert torch.equal(got.selected_counts, want.selected_counts)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, equal_nan=True, **W_TOL)
    if with_aux:
        assert got.score_sum.dtype == torch.float32 and got.score_sum.shape == (E,)
        assert got.logsumexp.dtype == torch.float32 and got.logsumexp.shape == (T,)
        torch.testing.assert_close(got.score_sum, want.score_sum, equal_nan=True, **AUX_TOL)
        torch.testing.assert_close(got.logsumexp, want.logsumexp, equal_nan=True, **AUX_TOL)
    else:
        assert got.score_sum is None and got.logsumexp is None


def _pick_config(draw_index: int, T: int, k: int):
    """The drawn configuration, except that the small-block ones are kept to problems whose
    per-block top-k work stays small in the interpreter."""
    config = CONFIGS[draw_index]
    if config is not None and not HAS_CUDA and -(-T // config.block_t) * k > 160:
        return None
    return config


# ---------------------------------------------------------------------------------------------
# forward: properties against the reference
# ---------------------------------------------------------------------------------------------


@settings(max_examples=180)
@given(route_cases(max_tokens=40, experts=EXPERTS), st.sampled_from(DTYPES), st.integers(0, len(CONFIGS) - 1),
       st.booleans())
def test_forward_matches_reference(case, dtype, config_index, with_aux):
    """ids, dropped slots, counts exactly; weights, score sums and logsumexp to 1e-6 (fp32)."""
    logits = case.logits.to(DEV, dtype)
    config = _pick_config(config_index, logits.shape[0], case.top_k)
    got, want = _route_both(logits, case.top_k, _to_dev(case.kwargs()), with_aux=with_aux, config=config)
    _assert_same_routing(got, want, with_aux=with_aux)


# d(logits) has the logits' dtype. The kernel rounds its fp32 gradient once; the reference is run
# on the fp32 upcast of the same logits (autograd through the reference in fp16 would add two
# separately rounded fp16 partial gradients) and rounded once the same way: at most an ulp apart.
GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-5),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


@settings(max_examples=50)
@given(route_cases(max_tokens=24, experts=EXPERTS), st.sampled_from(DTYPES), st.integers(0, len(CONFIGS) - 1),
       st.booleans(), st.sampled_from(["weights", "weights+aux", "aux only"]))
def test_backward_matches_reference_autograd(case, dtype, config_index, with_aux, which):
    """d(logits) through the weights (renormalization, capacity drops) and the aux and z losses."""
    logits = case.logits.to(DEV, dtype)
    T, E = logits.shape
    k = case.top_k
    if which != "weights":
        with_aux = True
    g = torch.Generator().manual_seed(T * 131 + E * 7 + k)
    dw = torch.randn(T, k, generator=g).to(DEV)
    config = _pick_config(config_index, T, k)
    grads = []
    for backend in ("triton", "torch"):
        x = (logits if backend == "triton" else logits.float()).clone().requires_grad_(True)
        with _config_ctx(config):
            r = tm.route(x, k, backend=backend, with_aux=with_aux, **_to_dev(case.kwargs()))
        loss = x.sum() * 0.0
        if which != "aux only":
            loss = loss + (r.topk_weights * dw).sum()
        if with_aux:
            loss = loss + 0.7 * tm.load_balancing_loss(x, r) + 0.3 * tm.z_loss(x, r)
        (dx,) = torch.autograd.grad(loss, x)
        grads.append(dx.to(dtype))
    assert grads[0].dtype == dtype
    torch.testing.assert_close(grads[0], grads[1], equal_nan=True, **GRAD_TOL[dtype])


# ---------------------------------------------------------------------------------------------
# named cases
# ---------------------------------------------------------------------------------------------

# (name, T, E, k, kwargs): why each exists is in its name
NAMED = [
    ("one token", 1, 8, 2, {}),
    ("k = E, prime E", 5, 13, 13, dict(capacity=3)),
    ("E = 1", 6, 1, 1, dict(capacity=4)),
    ("E = 512, small T", 5, 512, 8, {}),
    ("E = 512 grouped, sigmoid + bias (DeepSeek-like)", 3, 512, 8,
     dict(score_func="sigmoid", n_groups=8, topk_groups=4, expert_bias="rand")),
    ("E = 256, 8 groups keep 4, capacity", 9, 256, 8,
     dict(score_func="sigmoid", n_groups=8, topk_groups=4, expert_bias="rand", capacity=1)),
    ("groups of one expert", 7, 6, 2, dict(n_groups=6, topk_groups=3)),
    ("odd group size, non-pow2 groups", 7, 15, 4, dict(n_groups=5, topk_groups=2)),
    ("capacity 0 drops everything", 6, 5, 2, dict(capacity=0)),
    ("capacity larger than any load", 6, 5, 2, dict(capacity=100)),
    ("no renormalize", 6, 9, 3, dict(renormalize=False, score_func="sigmoid")),
]


@pytest.mark.parametrize("name,T,E,k,kw", NAMED, ids=[n[0] for n in NAMED])
def test_named_cases(name, T, E, k, kw):
    g = torch.Generator().manual_seed(E * 1000 + T)
    kw = dict(kw)
    if kw.get("expert_bias") == "rand":
        kw["expert_bias"] = (torch.rand(E, generator=g) * 0.1).to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    got, want = _route_both(logits, k, kw, with_aux=True)
    _assert_same_routing(got, want, with_aux=True)


@pytest.mark.parametrize("capacity", [None, 2])
def test_zero_tokens(capacity):
    """T = 0: nothing is launched; empty outputs of the right shapes; zero aux losses and an
    empty gradient."""
    x = torch.randn(0, 6, device=DEV, requires_grad=True)
    r = tm.route(x, 2, backend="triton", capacity=capacity, with_aux=True)
    assert r.topk_ids.shape == (0, 2) and r.topk_ids.dtype == torch.int32
    assert r.topk_weights.shape == (0, 2) and r.topk_weights.dtype == torch.float32
    assert r.counts.tolist() == [0] * 6 and r.selected_counts.tolist() == [0] * 6
    assert r.score_sum.tolist() == [0.0] * 6 and r.logsumexp.shape == (0,)
    loss = r.topk_weights.sum() + tm.load_balancing_loss(x, r) + tm.z_loss(x, r)
    assert float(loss.detach()) == 0.0
    (dx,) = torch.autograd.grad(loss, x, allow_unused=True)
    assert dx is None or dx.shape == (0, 6)


def test_all_tokens_on_one_expert_and_empty_experts():
    """A large bias sends every token's first slot to expert 3; with capacity 5 only the first
    5 tokens keep it; experts never chosen have count 0."""
    T, E = 12, 7
    logits = torch.randn(T, E, device=DEV)
    bias = torch.zeros(E, device=DEV)
    bias[3] = 10.0
    for config in CONFIGS:
        got, want = _route_both(logits, 1, dict(expert_bias=bias, capacity=5), config=config)
        _assert_same_routing(got, want)
        assert got.selected_counts.tolist() == [0, 0, 0, T, 0, 0, 0]
        assert got.counts.tolist() == [0, 0, 0, 5, 0, 0, 0]
        assert got.topk_ids[:5, 0].tolist() == [3] * 5 and got.topk_ids[5:, 0].tolist() == [-1] * (T - 5)


def test_forced_ties_go_to_the_lower_expert_and_group():
    """Integer logits with many equal values: ties to the lower expert id; equal group scores to
    the lower group index; the order is slot-by-slot descending."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0, 0.0], [0.0] * 6, [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]], device=DEV)
    for kw in [{}, dict(n_groups=3, topk_groups=2), dict(n_groups=2, topk_groups=1, score_func="sigmoid")]:
        got, want = _route_both(logits, 3, kw)
        _assert_same_routing(got, want)
    got, _ = _route_both(logits, 3, {})
    assert got.topk_ids.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 2]]


def test_group_score_counts_a_repeated_max_twice():
    """A group's score is the sum of its top-2 selection scores, duplicates included: group 0
    ([2, 2, -3]) scores 2*s(2) and beats group 1 ([2, 1.9, 1.9]), although group 1 has the better
    second-and-third values."""
    logits = torch.tensor([[2.0, 2.0, -3.0, 2.0, 1.9, 1.9]], device=DEV)
    for score_func in ("softmax", "sigmoid"):
        got, want = _route_both(logits, 2, dict(n_groups=2, topk_groups=1, score_func=score_func))
        _assert_same_routing(got, want)
        assert got.topk_ids.tolist() == [[0, 1]]


def test_capacity_priority_is_slot_then_token():
    """Slot 0 of every token beats slot 1 of any token; inside a slot, earlier tokens win."""
    # every token picks expert 0 first and expert 1 second, except token 2 which picks 1, 0.
    # Expert 0 keeps slot 0 of tokens 0, 1; expert 1 keeps slot 0 of token 2, then slot 1 of token 0.
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [2.0, 1.0, 0.0]], device=DEV)
    for config in CONFIGS:
        got, want = _route_both(logits, 2, dict(capacity=2, renormalize=False), config=config)
        _assert_same_routing(got, want)
        assert got.topk_ids.tolist() == [[0, 1], [0, -1], [1, -1], [-1, -1]]


def test_neg_inf_logits_are_a_mask():
    """-inf logits score 0 (softmax and sigmoid) and are chosen last, lower id first; with
    groups an -inf expert of a kept group still beats every expert of a dropped group."""
    ninf = float("-inf")
    logits = torch.tensor([[ninf, 0.5, ninf, 1.0, ninf, ninf], [2.0, ninf, ninf, ninf, ninf, ninf]], device=DEV)
    for kw in [{}, dict(score_func="sigmoid"), dict(n_groups=3, topk_groups=2, score_func="sigmoid"),
               dict(capacity=1)]:
        got, want = _route_both(logits, 4, kw, with_aux=True)
        _assert_same_routing(got, want, with_aux=True)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # numpy's max inside the interpreter
def test_nan_logits_with_validation_off():
    """The documented non-finite behavior: a NaN selection score ranks as -inf (chosen last,
    lower id first) and its weight is NaN; softmax makes the whole row NaN."""
    nan = float("nan")
    logits = torch.tensor([[0.0, nan, 1.0, -1.0], [nan, nan, nan, nan], [0.5, 0.0, nan, 2.0]], device=DEV)
    with pytest.raises(ValueError, match="NaN"):
        tm.route(logits, 2, backend="triton")
    with tm.validation(False):
        for kw, ks in [(dict(score_func="sigmoid"), (2, 4)), (dict(score_func="sigmoid", renormalize=False), (2, 4)),
                       ({}, (2, 4)), (dict(n_groups=2, topk_groups=1, score_func="sigmoid"), (1, 2))]:
            for k in ks:
                got, want = _route_both(logits, k, dict(kw, capacity=2), with_aux=True)
                _assert_same_routing(got, want, with_aux=True)
        got, _ = _route_both(logits, 4, dict(score_func="sigmoid", renormalize=False))
        assert got.topk_ids[0].tolist() == [2, 0, 3, 1]
        assert torch.isnan(got.topk_weights[0, 3]) and not torch.isnan(got.topk_weights[0, :3]).any()


def test_non_contiguous_logits_and_poisoned_padding():
    """Logits as a column slice of a NaN-padded buffer (row stride > E) and as a transposed
    view (expert stride > 1): the kernels must read only the [T, E] window."""
    T, E, k = 9, 7, 3
    buf = torch.full((T, E + 5), float("nan"), device=DEV)
    buf[:, :E] = torch.randn(T, E, device=DEV)
    sliced = buf[:, :E]
    transposed = buf[:, :E].t().contiguous().t()
    assert not sliced.is_contiguous() and not transposed.is_contiguous()
    for logits in (sliced, transposed):
        got, want = _route_both(logits, k, dict(capacity=2), with_aux=True)
        _assert_same_routing(got, want, with_aux=True)
        dx = []
        for backend in ("triton", "torch"):
            leaf = buf.detach().clone().requires_grad_(True)  # keeps the strides of `logits`
            x = leaf[:, :E] if logits is sliced else leaf[:, :E].t().contiguous().t()
            r = tm.route(x, k, backend=backend, with_aux=True)
            dx.append(torch.autograd.grad(r.topk_weights.sum() + tm.z_loss(x, r), x)[0])
        torch.testing.assert_close(dx[0], dx[1], rtol=1e-4, atol=1e-5)


def test_deterministic_run_to_run():
    """Two runs give bitwise-identical outputs and gradients (no float atomics)."""
    logits = torch.randn(37, 12, device=DEV)
    outs = []
    for _ in range(2):
        x = logits.clone().requires_grad_(True)
        with kr.config_override(SMALL_SPLIT):
            r = tm.route(x, 3, backend="triton", capacity=4, with_aux=True, n_groups=4, topk_groups=2)
        loss = (r.topk_weights * torch.arange(3.0, device=DEV)).sum() + tm.load_balancing_loss(x, r)
        (dx,) = torch.autograd.grad(loss, x)
        outs.append((r.topk_ids, r.topk_weights, r.counts, r.selected_counts, r.score_sum, r.logsumexp, dx))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_fp64_logits_follow_the_fp64_contract():
    """fp64 logits are routed by the reference (the kernels compute in fp32)."""
    logits = torch.randn(5, 6, dtype=torch.float64, device=DEV)
    got, want = _route_both(logits, 2, {}, with_aux=True)
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)


def test_gradient_of_bias_is_none_and_weights_only_graph():
    """The bias changes only the selection: no gradient flows to it; ids and counts carry no grad."""
    x = torch.randn(6, 8, device=DEV, requires_grad=True)
    bias = torch.randn(8, device=DEV, requires_grad=True)
    r = tm.route(x, 2, backend="triton", expert_bias=bias)
    assert r.topk_weights.requires_grad
    assert not r.topk_ids.requires_grad and not r.counts.requires_grad
    (db,) = torch.autograd.grad(r.topk_weights.sum(), bias, allow_unused=True)
    assert db is None


# ---------------------------------------------------------------------------------------------
# wiring, validation, configuration
# ---------------------------------------------------------------------------------------------


def test_registered_as_the_route_kernel():
    assert dispatch.implementation("route", "triton", torch.device(DEV)) is kr.route
    if HAS_CUDA:
        assert dispatch.implementation("route", "auto", torch.device("cuda")) is kr.route


LOGITS = torch.randn(4, 6)
BAD = [
    ("top_k > E", lambda x: tm.route(x, 7, backend="triton"), ValueError, "top_k=7"),
    ("E not divisible by n_groups", lambda x: tm.route(x, 2, n_groups=4, topk_groups=2, backend="triton"),
     ValueError, "n_groups=4"),
    ("bias wrong shape", lambda x: tm.route(x, 2, expert_bias=torch.zeros(5, device=x.device), backend="triton"),
     ValueError, "[6]"),
    ("negative capacity", lambda x: tm.route(x, 2, capacity=-1, backend="triton"), ValueError, "capacity=-1"),
]


@pytest.mark.parametrize("name,call,exc,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_before_launch(monkeypatch, name, call, exc, fragment):
    def launched(*args, **kwargs):
        raise AssertionError("a routing kernel was launched for invalid input")

    monkeypatch.setattr(kr, "_forward", launched)
    with pytest.raises(exc) as info:
        call(LOGITS.to(DEV))
    assert fragment in str(info.value)


def test_tile_limit_is_a_clear_error():
    x = torch.zeros(1, kr.MAX_TILE_LANES + 1, device=DEV)
    with pytest.raises(ValueError, match="backend='torch'"):
        tm.route(x, 1, backend="triton")


def test_route_config_policy():
    for lanes in [1, 2, 8, 64, 128, 256, 512, 1024, 4096, 8192]:
        for interpret in (False, True):
            cfg = kr.route_config(lanes, interpret=interpret)
            assert cfg.block_t >= 1 and cfg.block_t * lanes <= max(4096, lanes)
    assert kr.route_config(128).block_t == 16  # T=4096 -> 256 programs on the GPU
    with pytest.raises(ValueError, match="power of two"):
        kr.RouteConfig(block_t=3, num_warps=4, bwd_block_t=4, bwd_num_warps=4)
    with pytest.raises(TypeError):
        with kr.config_override("small"):
            pass


# ---------------------------------------------------------------------------------------------
# GPU only: bf16, production shapes, int64 offsets
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "T,E,k,kw",
    [
        (4096, 128, 8, {}),
        (4096, 256, 8, dict(score_func="sigmoid", n_groups=8, topk_groups=4, expert_bias="rand")),
        (4096, 64, 6, dict(capacity=300)),
        (1000, 8, 2, dict(score_func="sigmoid", renormalize=False, capacity=200)),
    ],
)
def test_gpu_production_shapes(dtype, T, E, k, kw):
    g = torch.Generator(device="cuda").manual_seed(T + E)
    kw = dict(kw)
    if kw.get("expert_bias") == "rand":
        kw["expert_bias"] = torch.rand(E, device="cuda", generator=g) * 0.1
    logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(dtype)
    got, want = _route_both(logits, k, kw, with_aux=True)
    _assert_same_routing(got, want, with_aux=True)
    dw = torch.randn(T, k, device="cuda", generator=g)
    dx = []
    for backend, x in (("triton", logits.clone()), ("torch", logits.float())):  # see GRAD_TOL
        x.requires_grad_(True)
        r = tm.route(x, k, backend=backend, with_aux=True, **kw)
        loss = (r.topk_weights * dw).sum() + tm.load_balancing_loss(x, r) + tm.z_loss(x, r)
        dx.append(torch.autograd.grad(loss, x)[0].to(dtype))
    torch.testing.assert_close(dx[0], dx[1], **GRAD_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_offsets_past_int32():
    """T * E > 2**31: rows past the int32 range route like the same rows routed alone."""
    E = 128
    T = 2**31 // E + 64
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    r = tm.route(logits, 8, backend="triton")
    tail = tm.route(logits[-64:].clone(), 8, backend="triton")
    assert torch.equal(r.topk_ids[-64:], tail.topk_ids)
    assert torch.equal(r.topk_weights[-64:], tail.topk_weights)
    assert int(r.counts.sum()) == T * 8
