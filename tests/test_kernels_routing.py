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
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.core import settings as _settings
from tritonmoe import backends as dispatch, kernels
from tritonmoe import reference as ref
from tritonmoe.kernels import _routing_kernels as RK
from tritonmoe.kernels import config as CF
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
    return CF.override("route", config) if config is not None else contextlib.nullcontext()


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


#: The DeepSeek options drawn beside every route case: group score rule, routed scaling factor.
DEEPSEEK_OPTIONS = st.fixed_dictionaries(
    dict(group_score=st.sampled_from(["top2sum", "max"]), routed_scaling_factor=st.sampled_from([1.0, 2.5]))
)


@settings(max_examples=180)
@given(route_cases(max_tokens=40, experts=EXPERTS), st.sampled_from(DTYPES), st.integers(0, len(CONFIGS) - 1),
       st.booleans(), DEEPSEEK_OPTIONS)
def test_forward_matches_reference(case, dtype, config_index, with_aux, options):
    """ids, dropped slots, counts exactly; weights, score sums and logsumexp to 1e-6 (fp32)."""
    logits = case.logits.to(DEV, dtype)
    config = _pick_config(config_index, logits.shape[0], case.top_k)
    kw = _to_dev(dict(case.kwargs(), **options))
    got, want = _route_both(logits, case.top_k, kw, with_aux=with_aux, config=config)
    _assert_same_routing(got, want, with_aux=with_aux)


# d(logits) has the logits' dtype. The kernel rounds its fp32 gradient once; the reference is run
# on the fp32 upcast of the same logits (autograd through the reference in fp16 would add two
# separately rounded fp16 partial gradients) and rounded once the same way: at most an ulp apart.
GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-5),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


@settings(max_examples=50)
@given(route_cases(max_tokens=24, experts=EXPERTS), st.sampled_from(DTYPES), st.integers(0, len(CONFIGS) - 1),
       st.booleans(), st.sampled_from(["weights", "weights+aux", "aux only"]), DEEPSEEK_OPTIONS)
def test_backward_matches_reference_autograd(case, dtype, config_index, with_aux, which, options):
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
            r = tm.route(x, k, backend=backend, with_aux=with_aux, **_to_dev(dict(case.kwargs(), **options)))
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
        with CF.override("route", SMALL_SPLIT):
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
        with CF.override("route", "small"):
            pass
    with pytest.raises(TypeError), pytest.warns(DeprecationWarning):  # the old spelling, an alias
        with kr.config_override("small"):
            pass


# ---------------------------------------------------------------------------------------------
# GPU only: bf16, production shapes, int64 offsets, near-ties under the compiled kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_canonical_values_bitwise():
    """The compiled canonical exp / sigmoid / softmax (ex2.approx and div.full nowhere near them,
    no FMA) equal the reference's bit for bit on the GPU, and the reference's equal on CPU and
    CUDA, over 1M random values at several scales and the special values."""
    g = torch.Generator().manual_seed(0)
    G, S = 8, 32
    x = torch.randn(4096, G * S, generator=g) * torch.tensor([0.5, 4.0, 30.0, 100.0]).repeat_interleave(1024)[:, None]
    x[:16] = torch.tensor([-86.0, 88.0, float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 103.0]).repeat(2)[:, None]
    xc = x.cuda()
    outs = [torch.empty_like(xc) for _ in range(3)]
    _canonical_probe_kernel[(4096 // 8,)](xc, *outs, 4096, G=G, S=S, BLOCK_T=8, BLOCK_G=G, BLOCK_S=S,
                                          **kr.FWD_COMPILE_OPTIONS)
    for got, fn in zip(outs, (ref.canonical_exp, lambda v: ref.canonical_scores(v, "sigmoid"),
                              lambda v: ref.canonical_scores(v, "softmax", G))):
        want_cuda, want_cpu = fn(xc), fn(x)
        assert _same_bits(want_cuda.cpu(), want_cpu)
        assert _same_bits(got.cpu(), want_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,kw,bias", [
    (128, {}, None),
    (256, dict(score_func="sigmoid", n_groups=8, topk_groups=4), "collide"),
    (128, dict(n_groups=8, topk_groups=4, group_score="max", routed_scaling_factor=2.5), None),
    (256, dict(n_groups=8, topk_groups=4), None),
    (128, {}, "collide"),
])
def test_gpu_near_ties_select_identically(E, kw, bias, dtype):
    """T = 4096 tokens of ulp-apart logits (and a bias that makes every selection value a
    near-tie) through the compiled router: the ids equal the reference's exactly."""
    logits = _near_tie_logits(4096, E, seed=E + len(kw)).to(dtype).float()
    kw = dict(kw)
    if bias == "collide":
        kw["expert_bias"] = _colliding_bias(logits, kw.get("score_func", "softmax"), seed=1).cuda()
    got, want = _route_both(logits.to("cuda", dtype), 8, kw)
    _assert_same_ids(got, want)


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


# ---------------------------------------------------------------------------------------------
# Exact selection across backends at near-ties (DESIGN.md: "Selection is exact across backends")
# ---------------------------------------------------------------------------------------------
#
# Two experts whose scores differ by one ulp (or tie in one backend's rounding and not in the
# other's) used to swap between the kernel and the reference: softmax scores came from tl.exp
# (ex2.approx on a GPU, numpy's exp in the interpreter) and a layout-dependent tl.sum, the
# reference's from torch.softmax. Selection now compares canonical values (the logits; with a
# bias a fixed-recipe score); these cases are built to sit on the ulp where the old comparison
# flipped, and must give identical ids on every backend.


def _nudge(v: torch.Tensor, steps: int) -> torch.Tensor:
    """v moved by ``steps`` fp32 ulps (towards +inf for steps > 0)."""
    target = torch.full_like(v, float("inf") if steps > 0 else float("-inf"))
    for _ in range(abs(steps)):
        v = torch.nextafter(v, target)
    return v


def _ulp_pairs(base_E: torch.Tensor, g: torch.Generator, max_steps: int = 2) -> torch.Tensor:
    """A logit row where the experts come in pairs 0 to max_steps ulps apart (equal included)."""
    E = base_E.shape[0]
    x = base_E.clone()
    perm = torch.randperm(E, generator=g).tolist()
    for a, b in zip(perm[0::2], perm[1::2]):
        steps = int(torch.randint(-max_steps, max_steps + 1, (1,), generator=g))
        x[b] = _nudge(x[a : a + 1], steps)[0]
    return x


def _near_tie_logits(T: int, E: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """T rows: a random row with its experts paired up 0-2 ulps apart, then copies of it with
    about a quarter of the entries nudged by an ulp either way (so different tokens break the
    near-ties differently); row 0 is the unnudged row."""
    g = torch.Generator().manual_seed(seed)
    base = _ulp_pairs(torch.randn(E, generator=g) * scale, g)
    rows = base.repeat(T, 1)
    step = torch.randint(-1, 2, (T, E), generator=g) * (torch.rand(T, E, generator=g) < 0.25)
    step[0] = 0
    up = torch.nextafter(rows, torch.full_like(rows, float("inf")))
    down = torch.nextafter(rows, torch.full_like(rows, float("-inf")))
    return torch.where(step > 0, up, torch.where(step < 0, down, rows))


def _colliding_bias(logits_TE: torch.Tensor, score_func: str, seed: int) -> torch.Tensor:
    """A bias that makes token 0's selection values (score + bias) all land within a few ulps of
    one constant: every pair of experts is a near-tie. Built from torch's scores (which differ
    from the canonical ones by an ulp or two), so the construction needs nothing this change added."""
    g = torch.Generator().manual_seed(seed)
    return _ulp_pairs(0.25 - ref.scores(logits_TE[:1].float(), score_func)[0], g, max_steps=1)


def _assert_same_ids(got, want):
    assert torch.equal(got.topk_ids, want.topk_ids), (got.topk_ids.tolist(), want.topk_ids.tolist())
    assert torch.equal(got.counts, want.counts) and torch.equal(got.selected_counts, want.selected_counts)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, equal_nan=True, **W_TOL)


@triton.jit
def _canonical_probe_kernel(x_ptr, exp_ptr, sig_ptr, soft_ptr, T, G: tl.constexpr, S: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Writes the router's canonical exp, sigmoid and softmax of a [T, G*S] fp32 tile."""
    E: tl.constexpr = G * S
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    e_E, lane_ok_E = RK._lanes(G, S, BLOCK_G, BLOCK_S)
    ok = row_ok[:, None] & lane_ok_E[None, :]
    x = tl.load(x_ptr + t[:, None] * E + e_E[None, :], mask=ok, other=float("-inf"))
    x = tl.where(row_ok[:, None], x, 0.0)
    out = t[:, None] * E + e_E[None, :]
    tl.store(exp_ptr + out, RK._canonical_exp(x), mask=ok)
    tl.store(sig_ptr + out, RK._canonical_sigmoid(x), mask=ok)
    tl.store(soft_ptr + out, RK._canonical_softmax(x, lane_ok_E, BLOCK_T, BLOCK_G * BLOCK_S), mask=ok)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as fp32 bit patterns, any NaN equal to any NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a].view(torch.int32), b[~nan_b].view(torch.int32))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf in the interpreter
@pytest.mark.parametrize("G,S", [(1, 13), (4, 6), (3, 16)])
def test_canonical_values_are_bitwise_the_reference(G, S):
    """The kernel's canonical exp / sigmoid / softmax (compiled as the forward kernel is: no FMA
    contraction) equal tritonmoe.reference's bit for bit: ulp-apart pairs, the exp range limits,
    +-inf, NaN, +-0, subnormals, a row of -inf."""
    g = torch.Generator().manual_seed(G * 100 + S)
    E = G * S
    rows = [_near_tie_logits(1, E, seed=s, scale=sc)[0] for s, sc in [(1, 1.0), (2, 8.0), (3, 40.0)]]
    special = torch.tensor([-86.0, -86.00001, 88.0, 88.00001, -87.5, 0.0, -0.0, 1e-40, -1e-40, 103.0,
                            float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 0.5])
    rows.append(special[torch.arange(E) % special.numel()])
    rows.append(torch.full((E,), float("-inf")))
    rows.append(torch.randn(E, generator=g) * 30)
    x = torch.stack(rows).to(DEV)
    T = x.shape[0]
    outs = [torch.empty_like(x) for _ in range(3)]
    bs, bg = triton.next_power_of_2(S), triton.next_power_of_2(G)
    _canonical_probe_kernel[(triton.cdiv(T, 4),)](x, *outs, T, G=G, S=S, BLOCK_T=4, BLOCK_G=bg, BLOCK_S=bs,
                                                 **kr.FWD_COMPILE_OPTIONS)
    assert _same_bits(outs[0], ref.canonical_exp(x))
    assert _same_bits(outs[1], ref.canonical_scores(x, "sigmoid"))
    assert _same_bits(outs[2], ref.canonical_scores(x, "softmax", G))
    finite = torch.isfinite(x) & (x > -86) & (x < 88)
    torch.testing.assert_close(outs[0][finite].double(), x[finite].double().exp(), rtol=3e-7, atol=0)


NEAR_TIES = [
    # (name, E, k, kwargs, bias, seed): "collide" makes every selection value a near-tie. The
    # seeds of the first five are ones where the code before this change (main at 9119a1a) chose
    # different experts in Triton's interpreter than in the reference.
    ("softmax, logits 0-2 ulps apart", 16, 5, {}, None, 7),
    ("sigmoid, logits 0-2 ulps apart", 12, 4, dict(score_func="sigmoid"), None, 19),
    ("softmax + colliding bias", 16, 6, {}, "collide", 0),
    ("sigmoid + colliding bias, groups top2sum (DeepSeek-V3-like)", 16, 4,
     dict(score_func="sigmoid", n_groups=4, topk_groups=2), "collide", 5),
    ("softmax groups top2sum without bias", 12, 4, dict(n_groups=4, topk_groups=2), None, 1),
    ("softmax + colliding bias, groups max, scaled", 12, 3,
     dict(n_groups=3, topk_groups=2, group_score="max", routed_scaling_factor=2.5), "collide", 3),
    ("sigmoid groups max without bias, capacity", 15, 3,
     dict(score_func="sigmoid", n_groups=5, topk_groups=3, group_score="max", capacity=2), None, 4),
]


@pytest.mark.parametrize("name,E,k,kw,bias,seed", NEAR_TIES, ids=[c[0] for c in NEAR_TIES])
def test_near_ties_select_identically(name, E, k, kw, bias, seed):
    logits = _near_tie_logits(6, E, seed=seed)
    kw = dict(kw)
    if bias == "collide":
        kw["expert_bias"] = _colliding_bias(logits, kw.get("score_func", "softmax"), seed=seed).to(DEV)
    got, want = _route_both(logits.to(DEV), k, kw)
    _assert_same_ids(got, want)


def test_selection_is_by_logit_when_scores_round_equal():
    """Without a bias the canonical value is the logit: experts whose scores round to the same
    fp32 value (softmax underflow to 0, sigmoid saturating at 1) still rank by logit, on every
    backend; equal logits (and -0 vs +0) tie to the lower id."""
    ninf = float("-inf")
    logits = torch.tensor([
        [-200.0, -199.0, 0.0, -150.0],  # softmax scores [0, 0, 1, 0]: 3 > 1 > 0 among the zeros
        [30.0, 31.0, 30.5, ninf],  # sigmoid saturates to 1.0 for all three finite ones
        [-0.0, 0.0, -0.0, -1.0],  # zeros of either sign tie: lower id first
        [5.0, 5.0, 5.0, 5.0],
    ], device=DEV)
    for score_func in ("softmax", "sigmoid"):
        got, want = _route_both(logits, 4, dict(score_func=score_func, renormalize=False))
        _assert_same_ids(got, want)
        assert got.topk_ids.tolist() == [[2, 3, 1, 0], [1, 2, 0, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


@settings(max_examples=40)
@given(
    T=st.integers(1, 5),
    E=st.sampled_from([4, 6, 8, 12, 16]),
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([0.5, 4.0, 30.0]),
    score_func=st.sampled_from(["softmax", "sigmoid"]),
    bias=st.sampled_from([None, "random", "collide"]),
    groups=st.booleans(),
    group_score=st.sampled_from(["top2sum", "max"]),
    routed_scaling_factor=st.sampled_from([1.0, 2.5]),
    dtype=st.sampled_from(DTYPES),
)
def test_near_tie_ids_match_exactly(T, E, seed, scale, score_func, bias, groups, group_score, routed_scaling_factor,
                                    dtype):
    """Property: ids are identical across backends on logits built from ulp-apart pairs (and with
    a bias that makes every selection value a near-tie), for every score function, group rule and
    dtype; weights within W_TOL."""
    g = torch.Generator().manual_seed(seed)
    logits = _near_tie_logits(T, E, seed, scale).to(dtype)
    k = int(torch.randint(1, E + 1, (1,), generator=g))
    kw = dict(score_func=score_func, group_score=group_score, routed_scaling_factor=routed_scaling_factor)
    if groups:
        n_groups = [d for d in (2, 3, 4) if E % d == 0][int(torch.randint(0, 2, (1,), generator=g)) % 2]
        need = -(-k // (E // n_groups))
        kw.update(n_groups=n_groups, topk_groups=max(need, n_groups - 1))
    if bias == "random":
        kw["expert_bias"] = torch.randn(E, generator=g) * 0.05
    elif bias == "collide":
        kw["expert_bias"] = _colliding_bias(logits, score_func, seed)
    kw = _to_dev(kw)
    got, want = _route_both(logits.to(DEV), k, kw)
    _assert_same_ids(got, want)


_AOT_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import triton
import aot_compile as aot
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritonmoe.kernels import _routing_kernels as RK, routing as kr

def fwd(E, k, G, softmax, bias, group_max, check):
    S = E // G
    bg, bs = triton.next_power_of_2(G), triton.next_power_of_2(S)
    cfg = kr.route_config(bg * bs)
    P = aot.Ptr
    return dict(logits_ptr=P("bf16"), bias_ptr=P("fp32"), ids_ptr=P("i32"), w_ptr=P("fp32"), counts_ptr=P("i32"),
                slot_hist_ptr=P("i32"), slot_tot_ptr=P("i32"), score_part_ptr=P("fp32"), lse_ptr=P("fp32"),
                T=4096, NB=4096 // cfg.block_t, stride_lt=E, stride_le=1, G=G, S=S, TOPK_GROUPS=max(1, G // 2), K=k,
                SOFTMAX=softmax, RENORMALIZE=True, HAS_BIAS=bias, HAS_CAPACITY=False, SLOT_TOTALS=False,
                WITH_AUX=False, BLOCK_T=cfg.block_t, BLOCK_G=bg, BLOCK_S=bs, BLOCK_K=triton.next_power_of_2(k),
                scale=2.5, GROUP_MAX=group_max, flag_ptr=P("i32"), CHECK=check, POISON=bias), cfg.num_warps

out = {}
for name, spec in json.loads(sys.argv[2]).items():
    args, warps = fwd(*spec)
    sig, consts, attrs = aot.specialize(RK._route_fwd_kernel, args)
    k = triton.compile(ASTSource(RK._route_fwd_kernel, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **kr.FWD_COMPILE_OPTIONS))
    ptx = k.asm["ptx"]
    out[name] = dict(fma=len(re.findall(r"\bfma\.", ptx)), div_rn=ptx.count("div.rn.f32"),
                     ftz_arith=len(re.findall(r"\b(?:add|sub|mul|div|fma)\.\w*\.?ftz", ptx)))
print(json.dumps(out))
"""

#: Canonical-value variants of the forward kernel: (E, k, G, softmax, bias, group max, fused
#: value checks). With a bias the launch also fuses the non-finite bias guard (POISON).
_AOT_ROUTERS = {
    "deepseek_v3_sigmoid_bias_groups": (256, 8, 8, False, True, False, False),
    "softmax_bias_tree_sum_groups_max_checked": (128, 8, 4, True, True, True, True),
}


@pytest.mark.slow
def test_canonical_forward_compiles_without_fma_for_sm90():
    """The forward kernel as launched (FWD_COMPILE_OPTIONS) compiled for sm_90a without a GPU:
    no fused multiply-add anywhere (an FMA rounds once where the reference rounds twice, so the
    canonical values would drift by an ulp on the GPU), correctly rounded divisions in the
    canonical scores, no flush-to-zero arithmetic."""
    import json
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, tests_dir)
    import aot_compile as aot

    reason = aot.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot compile for sm_90 here: {reason}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, tests_dir, json.dumps(_AOT_ROUTERS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, _, _, softmax, bias, *_) in _AOT_ROUTERS.items():
        f = facts[name]
        assert f["fma"] == 0, f"{name}: FMA contraction in the forward kernel: {f}"
        assert f["ftz_arith"] == 0, f"{name}: flush-to-zero arithmetic: {f}"
        if bias:
            assert f["div_rn"] > 0, f"{name}: the canonical score must divide with div.rn: {f}"
