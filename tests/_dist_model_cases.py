"""Per-rank bodies of tests/test_dist_model_layers.py: :func:`tritonmoe.update_expert_bias` on a
group (one verdict on every rank), and Parm's layouts with the options real models
use (GPT-OSS's clamped SwiGLU with non-default limit and alpha, expert biases b1/b2, a router bias)
against the single-process :class:`tritonmoe.MoELayer` in fp64 on gloo.

Reference: one process, the local layer holding the full experts, run on each batch (one batch per
MP group) separately: the output, input gradient, router weight and bias gradients and auxiliary
loss of each batch; expert gradients (w1, w2, b1, b2) summed over the batches in batch order, then
sliced to the rank's shard (b1 with w1's columns; b2 whole: every ESP shard of an expert holds the
same b2 and gets its whole gradient, while only shard 0 adds it to the output).

Bitwise where the summation order allows (n_esp = 1: output, input gradient; expert gradients
with one batch; the router's except S1's MP-sliced sum), to fp64 rounding elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.experts.model_parallel import shard_expert_biases, shard_expert_weights
from tritonmoe.parm_layout import ParmLayout

D_MODEL, D_FFN, NUM_EXPERTS = 8, 8, 4
TOL = dict(rtol=1e-12, atol=1e-12)
SCHEDULES = ("baseline", "s1", "s2")
SWIGLU = dict(activation="swiglu_oai", swiglu_limit=0.6, swiglu_alpha=1.3)


@dataclass(frozen=True)
class Case:
    n_mp: int
    n_esp: int
    placement: str
    top_k: int
    biases: bool  # expert_ffn_bias and router_bias
    capacity_factor: Optional[float]
    aux: bool
    tokens: tuple  # per batch (0: a zero-token batch; < n_mp: an MP rank with no S1 slice)
    seed: int
    dtype: torch.dtype = torch.float64  # fp32: to rounding (the gradients are not deferred there)

    def label(self, P: int) -> str:
        return (f"P={P} mp={self.n_mp} ep={P // self.n_esp} esp={self.n_esp} {self.placement} k={self.top_k} "
                f"biases={self.biases} cf={self.capacity_factor} aux={self.aux} tokens={self.tokens} {self.dtype}")


def _layouts(P: int) -> list[tuple[int, int, str]]:
    if P == 2:
        return [(1, 1, "esp_inner"), (2, 1, "esp_inner"), (1, 2, "esp_inner"), (2, 2, "esp_inner")]
    return [(1, 2, "esp_inner"), (2, 2, "ep_inner"), (2, 1, "esp_inner"), (4, 2, "esp_inner"), (1, 4, "esp_inner")]


def cases(P: int, biases: bool) -> list[Case]:
    out = []
    patterns = [(5, 0, 3, 6), (1, 7, 0, 4), (6, 2, 5, 0)]
    for i, (n_mp, n_esp, placement) in enumerate(_layouts(P)):
        G = P // n_mp
        pat = patterns[i % len(patterns)]
        out.append(Case(
            n_mp=n_mp, n_esp=n_esp, placement=placement, top_k=(2, 1, 3)[i % 3], biases=biases,
            capacity_factor=1.0 if i % 4 == 3 else None, aux=i % 2 == 1, tokens=tuple(pat[:G]) if G > 1 else (1 + i,),
            seed=500 + 10 * P + i,
        ))
    if biases and P == 2:  # fp32: the non-deferred gradient path of the shards that do not add b2
        out.append(Case(n_mp=2, n_esp=2, placement="esp_inner", top_k=2, biases=True, capacity_factor=None,
                        aux=True, tokens=(5,), seed=590, dtype=torch.float32))
    return out


def _check(failures: list, label: str, got, want, bitwise: bool, tol: Optional[dict] = None) -> None:
    if got is None or want is None:
        if not (got is None and want is None):
            failures.append(f"{label}: gradient {'missing' if got is None else 'unexpected'}")
        return
    if got.shape != want.shape:
        failures.append(f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    elif bitwise:
        if not torch.equal(got, want):
            failures.append(f"{label}: not bitwise equal (max diff {(got - want).abs().max().item():.3g})")
    else:
        try:
            torch.testing.assert_close(got, want, **(tol or TOL))
        except AssertionError as e:
            failures.append(f"{label}: {' '.join(str(e).split()[:30])}")


def run_case(P: int, case: Case, cache: dict) -> list[str]:
    failures: list[str] = []
    lay = ParmLayout.make(case.n_mp, P // case.n_esp, case.n_esp, placement=case.placement)
    groups = lay.process_groups(cache=cache)
    i = groups.rank
    g = lay.mp_group[i]
    dt = case.dtype
    gen = torch.Generator().manual_seed(case.seed)
    E, D, F = NUM_EXPERTS, D_MODEL, D_FFN
    batches = [torch.randn(t, D, generator=gen, dtype=dt) for t in case.tokens]
    grads = [torch.randn(t, D, generator=gen, dtype=dt) for t in case.tokens]
    full = {
        "router.weight": torch.randn(E, D, generator=gen, dtype=dt) * 0.5,
        "w1": torch.randn(E, D, 2 * F, generator=gen, dtype=dt) * 0.6,
        "w2": torch.randn(E, F, D, generator=gen, dtype=dt) * 0.4,
    }
    if case.biases:
        full["router.bias"] = torch.randn(E, generator=gen, dtype=dt) * 0.5
        full["b1"] = torch.randn(E, 2 * F, generator=gen, dtype=dt) * 0.5
        full["b2"] = torch.randn(E, D, generator=gen, dtype=dt) * 0.5
    opts = dict(SWIGLU, capacity_factor=case.capacity_factor, aux_loss_coef=0.01 if case.aux else 0.0,
                z_loss_coef=0.001 if case.aux else 0.0, expert_ffn_bias=case.biases, router_bias=case.biases)
    local_cfg = tm.MoEConfig(D, F, E, case.top_k, **opts)
    ref_layer = tm.MoELayer(local_cfg, dtype=dt)
    with torch.no_grad():
        for name, t in full.items():
            ref_layer.get_parameter(name).copy_(t)
    ref = []  # per batch: out, x grad, router grads, aux, expert grads
    for xb, gb in zip(batches, grads):
        ref_layer.zero_grad(set_to_none=True)
        x = xb.clone().requires_grad_()
        out = ref_layer(x)
        ((out * gb).sum() + ref_layer.aux_loss).backward()
        ref.append(dict(out=out.detach(), x=x.grad, aux=ref_layer.aux_loss.detach(),
                        **{n: p.grad for n, p in ref_layer.named_parameters()}))
    expert_names = ("w1", "w2") + (("b1", "b2") if case.biases else ())
    ref_expert = {}
    for n in expert_names:
        acc = ref[0][n]
        for r in ref[1:]:
            acc = acc + r[n]
        ref_expert[n] = acc
    want_w1, want_w2 = shard_expert_weights(ref_expert["w1"], ref_expert["w2"], local_cfg, lay, i)
    want = dict(w1=want_w1, w2=want_w2)
    if case.biases:
        want["b1"], want["b2"] = shard_expert_biases(ref_expert["b1"], ref_expert["b2"], local_cfg, lay, i)
    tol = TOL if dt == torch.float64 else dict(rtol=3e-5, atol=3e-5)

    def check(label, got, want, bitwise):
        _check(failures, label, got, want, bitwise and dt == torch.float64, tol)

    for sched in SCHEDULES:
        label = f"{case.label(P)} {sched}"
        cfg = tm.MoEConfig(D, F, E, case.top_k, parm_schedule=sched, **opts)
        layer = tm.MoELayer(cfg, parm_groups=groups, dtype=dt)
        with torch.no_grad():
            layer.router.weight.copy_(full["router.weight"])
            a, b = shard_expert_weights(full["w1"], full["w2"], cfg, lay, i)
            layer.w1.copy_(a)
            layer.w2.copy_(b)
            if case.biases:
                layer.router.bias.copy_(full["router.bias"])
                b1, b2 = shard_expert_biases(full["b1"], full["b2"], cfg, lay, i)
                layer.b1.copy_(b1)
                layer.b2.copy_(b2)
        x = batches[g].clone().requires_grad_()
        out = layer(x)
        ((out * grads[g]).sum() + layer.aux_loss).backward()
        if layer.expert_path.schedule_used != sched:
            failures.append(f"{label}: ran {layer.expert_path.schedule_used}")
        exact = case.n_esp == 1
        r = ref[g]
        check(f"{label}: output", out.detach(), r["out"], exact)
        check(f"{label}: x.grad", x.grad, r["x"], exact)
        router_exact = exact and (sched != "s1" or case.n_mp == 1)
        check(f"{label}: router.weight.grad", layer.router.weight.grad, r["router.weight"], router_exact)
        if case.biases:
            check(f"{label}: router.bias.grad", layer.router.bias.grad, r["router.bias"], router_exact)
        check(f"{label}: aux_loss", layer.aux_loss.detach().double(), r["aux"].double(),
               exact and (sched != "s1" or case.n_mp == 1))
        for n in expert_names:
            check(f"{label}: {n}.grad", getattr(layer, n).grad, want[n], exact and len(batches) == 1)
    return failures


# ---------------------------------------------------------------------------------------------
# The aux-loss-free bias update on a group: one verdict on every rank
# ---------------------------------------------------------------------------------------------


def _bias_layers(rank: int, n: int = 2) -> list:
    torch.manual_seed(7)  # the same replicated layers on every rank
    layers = [tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, expert_bias=True)) for _ in range(n)]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
    for layer in layers:
        layer(torch.randn(5 + 3 * rank, D_MODEL, generator=gen))
    return layers


def _expect_raise(failures: list, label: str, fn, exc, needle: str) -> None:
    try:
        fn()
    except exc as e:
        if needle not in str(e):
            failures.append(f"{label}: {type(e).__name__} without {needle!r}: {e}")
        return
    except BaseException as e:  # noqa: BLE001 - reported
        failures.append(f"{label}: raised {type(e).__name__}: {e}")
        return
    failures.append(f"{label}: did not raise")


def bias_update_checks(rank: int, P: int) -> list[str]:
    """update_expert_bias(group=WORLD): the good update (summed loads, equal biases everywhere);
    then a non-finite bias on the last rank only, a bad rate on rank 0 only, different layer
    counts: every rank raises (no rank enters the loads' all-reduce alone), nothing is written,
    the loads are kept; the group still works afterwards."""
    failures: list[str] = []
    world = dist.group.WORLD
    layers = _bias_layers(rank)
    mine = [layer.expert_load().clone() for layer in layers]
    want = [m.clone() for m in mine]
    for w in want:
        dist.all_reduce(w)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the verdict's all-gather uses the current name
        warnings.simplefilter("always")
        got = tm.update_expert_bias(layers, rate=0.01, group=world)
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    if deprecated:
        failures.append(f"good update: deprecation warnings {deprecated}")
    for i, (layer, w, g) in enumerate(zip(layers, want, got)):
        if not torch.equal(g, w):
            failures.append(f"good update: layer {i} loads {g.tolist()} != summed {w.tolist()}")
        expect = (0.01 * torch.sign(w.double().mean() - w.double())).float()
        if not torch.equal(layer.expert_bias, expect):
            failures.append(f"good update: layer {i} bias {layer.expert_bias.tolist()} != {expect.tolist()}")
        if layer.expert_load().any():
            failures.append(f"good update: layer {i} load not consumed")
    all_b = [torch.empty_like(layers[0].expert_bias) for _ in range(P)]
    dist.all_gather(all_b, layers[0].expert_bias)
    if any(not torch.equal(b, all_b[0]) for b in all_b):
        failures.append("good update: biases differ across ranks")

    def unchanged(label, before, loads):
        for i, layer in enumerate(layers):
            if not torch.equal(layer.expert_bias, before[i]) and not (
                torch.isnan(layer.expert_bias).any() and torch.isnan(before[i]).any()
            ):
                failures.append(f"{label}: layer {i}'s bias was written")
            if not torch.equal(layer.expert_load(), loads[i]):
                failures.append(f"{label}: layer {i}'s load was consumed")

    # -- a non-finite bias on the last rank only
    for layer in layers:
        layer(torch.randn(4, D_MODEL))
    loads = [layer.expert_load().clone() for layer in layers]
    if rank == P - 1:
        layers[1].expert_bias[2] = float("nan")
    before = [layer.expert_bias.clone() for layer in layers]
    needle = f"rank(s) [{P - 1}]"
    _expect_raise(failures, "nan bias on the last rank", lambda: tm.update_expert_bias(layers, rate=0.01, group=world),
                  tm.ExpertBiasError, needle)
    unchanged("nan bias on the last rank", before, loads)
    if rank == P - 1:
        layers[1].expert_bias[2] = 0.0
    # -- bad arguments on rank 0 only
    before = [layer.expert_bias.clone() for layer in layers]
    rate = float("nan") if rank == 0 else 0.01
    if rank == 0:
        _expect_raise(failures, "bad rate on rank 0", lambda: tm.update_expert_bias(layers, rate=rate, group=world),
                      ValueError, "rate=nan")
    else:
        _expect_raise(failures, "bad rate on rank 0", lambda: tm.update_expert_bias(layers, rate=rate, group=world),
                      tm.ExpertBiasError, "rank(s) [0]")
    unchanged("bad rate on rank 0", before, loads)
    # -- a layer listed twice: on every rank (each raises its ValueError), then on rank 0 only (the
    # others learn it from the verdict): no bias moves twice, nothing is written
    twice = [layers[0], layers[1], layers[0]]
    _expect_raise(failures, "a layer twice on every rank", lambda: tm.update_expert_bias(twice, rate=0.01, group=world),
                  ValueError, "layers[2] is the same layer as layers[0]")
    unchanged("a layer twice on every rank", before, loads)
    mine_twice = twice if rank == 0 else layers
    if rank == 0:
        _expect_raise(failures, "a layer twice on rank 0",
                      lambda: tm.update_expert_bias(mine_twice, rate=0.01, group=world), ValueError, "same layer")
    else:
        _expect_raise(failures, "a layer twice on rank 0",
                      lambda: tm.update_expert_bias(mine_twice, rate=0.01, group=world), tm.ExpertBiasError,
                      "rank(s) [0]")
    unchanged("a layer twice on rank 0", before, loads)
    # -- different layers
    sub = layers[:1] if rank == 0 else layers
    _expect_raise(failures, "different layer counts", lambda: tm.update_expert_bias(sub, rate=0.01, group=world),
                  tm.ExpertBiasError, "different layers")
    unchanged("different layer counts", before, loads)
    # -- the group still works, and so does the update
    tm.update_expert_bias(layers, rate=0.01, group=world)
    if any(layer.expert_load().any() for layer in layers):
        failures.append("the update after the refusals did not run")
    return failures


def parm_model_table(rank: int, P: int) -> dict:
    """Every case of both tables (without and with biases) on one group, then the bias update's
    checks."""
    cache: dict = {}
    out = {"bias_update": bias_update_checks(rank, P)}
    for biases in (False, True):
        failures, n = [], 0
        for case in cases(P, biases):
            failures += run_case(P, case, cache)
            n += 1
        out["biases" if biases else "swiglu"] = dict(failures=failures, cases=n)
    return out
