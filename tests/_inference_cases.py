"""Rank functions of tests/test_replicated.py (run in spawned gloo processes, see _dist.py)."""

from __future__ import annotations

import traceback

import torch

import tritonmoe as tm
from tritonmoe.inference import (
    LinaScheduler,
    Placement,
    PopularityEstimator,
    ReplicatedMoELayer,
    choices_from_layers,
    eplb_placement,
    lina_placement,
)

E, D = 8, 8


def zipf_layer(seed: int, skew: float = 1.5, *, bias: bool = False, top_k: int = 2) -> tm.MoELayer:
    """A local fp64 MoELayer whose router favours low expert ids (logit bias -skew*log(e+1)):
    Zipf-like popularity. Built from ``seed``: identical on every rank."""
    torch.manual_seed(seed)
    layer = tm.MoELayer(tm.MoEConfig(D, 6, E, top_k, router_bias=True, expert_ffn_bias=bias), dtype=torch.float64)
    with torch.no_grad():
        layer.router.bias.copy_(-skew * torch.log(torch.arange(1, E + 1, dtype=torch.float64)))
        if bias:
            layer.b1.normal_()
            layer.b2.normal_()
    return layer


def _tokens(rank: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(T, D, dtype=torch.float64, generator=g)


def _global_counts(layer, x, group=None) -> torch.Tensor:
    import torch.distributed as dist

    with torch.no_grad():
        _, r = layer.route(x)
    c = r.counts.to(torch.float64)
    dist.all_reduce(c, group=group)
    return c


def _expect_error(fn, exc, match: str) -> str:
    try:
        fn()
    except exc as e:  # noqa: PERF203
        return "ok" if match in str(e) else f"wrong message: {e}"
    except Exception as e:  # noqa: BLE001
        return f"wrong type {type(e).__name__}: {e}"
    return "no error"


def _layer_experts(layer) -> list:
    return [getattr(layer, n) for n in ("w1", "w2", "b1", "b2") if getattr(layer, n) is not None]


def _per_expert_bytes(layer) -> int:
    """One expert's bytes, from the local layer's tensors (not from the code under test)."""
    return sum(t[0].numel() * t.element_size() for t in _layer_experts(layer))


def _held_bytes(rep) -> int:
    """Device bytes behind the serving layer's expert tensors: the distinct storages' sizes."""
    seen, total = set(), 0
    for t in rep.expert_weights.values():
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _shares_storage(a, b) -> bool:
    pa = {t.untyped_storage().data_ptr() for t in a if t.untyped_storage().nbytes()}
    return bool(pa & {t.untyped_storage().data_ptr() for t in b})


class _CopyCounter:
    """Wrap tritonmoe.inference.replicated._copy_expert (the host-to-device path): per call,
    the expert whose host rows were read (from the source views' storage offsets), the bytes
    copied, and whether the sources are views of the given host tensors."""

    def __init__(self, host: list):
        import tritonmoe.inference.replicated as R

        self.R, self.orig, self.calls = R, R._copy_expert, []
        self.host_ptrs = {t.untyped_storage().data_ptr() for t in host}

    def __enter__(self):
        def counting(dst, src, non_blocking):
            e = src[0].storage_offset() // src[0].numel()
            nbytes = sum(t.numel() * t.element_size() for t in dst)
            from_host = all(t.untyped_storage().data_ptr() in self.host_ptrs for t in src)
            self.calls.append((e, nbytes, from_host))
            self.orig(dst, src, non_blocking)

        self.R._copy_expert = counting
        return self

    def __exit__(self, *a):
        self.R._copy_expert = self.orig

    def take(self) -> list:
        out, self.calls = self.calls, []
        return out


def _replan_cases(rank: int, P: int, layer) -> dict:
    """A placement sequence on one serving layer (exact-size slots and a fixed 4-slot buffer):
    after each change, the output against the local layer, the experts and bytes copied from
    host memory (counted by wrapping the copy), the device bytes held (measured from the
    storages) and whether kept experts stayed in place."""
    out: dict = {}
    x = _tokens(rank, [0, 17, 3, 9][rank], 1)  # ragged, rank 0 has no tokens
    with torch.no_grad():
        want = layer(x)
    load = _global_counts(layer, x)
    seq = [
        ("contiguous", Placement.contiguous(E, P)),
        ("lina", lina_placement(load, P)),
        ("hand", Placement(E, ((0,), (0, 1), (0, 2, 3, 4), (0, 5, 6, 7)), ((1.0,), (2.0, 1.0), (1.0,) * 4, (1.0,) * 4))),
        ("empty_device", Placement(E, ((0, 1, 2, 3), (), (4, 5, 6, 7), (0,)))),
        ("eplb", eplb_placement(load, P)),
        ("contiguous2", Placement.contiguous(E, P)),
    ]
    per = _per_expert_bytes(layer)
    for slots in (None, 4):
        steps = []
        with _CopyCounter(_layer_experts(layer)) as cc:
            rep, prev, prev_slots = None, (), {}
            for name, pl in seq:
                try:
                    if rep is None:
                        rep = ReplicatedMoELayer(layer, placement=pl, expert_slots=slots)
                    else:
                        rep.set_placement(pl)
                    calls = cc.take()
                    with torch.no_grad():
                        got = rep(x)
                    mine = pl.hosted[rank]
                    kept = set(mine) & set(prev)
                    bufs = {n: t.untyped_storage().data_ptr() for n, t in rep.expert_weights.items()}
                    slot_of = {e: k for k, e in enumerate(rep.slot_experts) if e >= 0}
                    steps.append(dict(
                        name=name, equal=bool(torch.equal(got, want)), n_hosted=len(mine),
                        expected=sorted(set(mine) - set(prev)), loaded=sorted(e for e, _, _ in calls),
                        loaded_bytes=sum(b for _, b, _ in calls), from_host=all(h for _, _, h in calls),
                        held=_held_bytes(rep), per_expert=per,
                        kept_in_place=bool(prev_slots) and prev_slots["bufs"] == bufs
                        and all(prev_slots["slot_of"][e] == slot_of[e] for e in kept),
                        same_size=len(prev) == len(mine),
                    ))
                    prev, prev_slots = mine, dict(bufs=bufs, slot_of=slot_of)
                except Exception:  # noqa: BLE001
                    steps.append(dict(name=name, equal=False, error=traceback.format_exc()))
        out[f"replan/slots={slots}"] = steps
    # a state dict as the host source: the copies read from it, not from the layer
    sd = {n: getattr(layer, n).detach().clone() for n in ("w1", "w2", "b1", "b2")}
    with _CopyCounter(list(sd.values())) as cc:
        rep = ReplicatedMoELayer(layer, placement=seq[1][1], host_experts=sd)
        with torch.no_grad():
            got = rep(x)
        calls = cc.take()
    out["host_state_dict"] = dict(equal=bool(torch.equal(got, want)), from_host=bool(calls) and all(h for *_, h in calls),
                                  loaded=sorted(e for e, _, _ in calls), hosted=list(seq[1][1].hosted[rank]))
    # bad input: typed errors on every rank before any collective, the layer left as it was
    out["bad_expert_id"] = _expect_error(lambda: rep.set_placement(Placement.contiguous(16, P)), ValueError,
                                         "hosts expert 8 on device 2")
    small = ReplicatedMoELayer(layer, placement=seq[1][1] if seq[1][1].max_hosted <= 3 else seq[4][1], expert_slots=3)
    before = (small.placement, list(small.slot_experts))
    out["over_capacity"] = _expect_error(lambda: small.set_placement(seq[2][1]), ValueError,
                                         "hosts 4 experts on device 2, more than its expert_slots=3")
    out["over_capacity_ctor"] = _expect_error(lambda: ReplicatedMoELayer(layer, placement=seq[2][1], expert_slots=2),
                                              ValueError, "more than its expert_slots=2")
    out["unchanged_after_error"] = before == (small.placement, list(small.slot_experts))
    out["bad_slots"] = [_expect_error(lambda: ReplicatedMoELayer(layer, expert_slots=0), ValueError, "expert_slots=0"),
                        _expect_error(lambda: ReplicatedMoELayer(layer, expert_slots="4"), TypeError, "slots must be an int")]
    bad_sd = dict(sd, w1=sd["w1"][:, :, :2])
    out["bad_host"] = _expect_error(lambda: ReplicatedMoELayer(layer, host_experts=bad_sd), ValueError, "host_experts['w1']")
    with torch.no_grad():  # the group is still in step: a forward (collectives) after the errors
        out["after_errors_equal"] = bool(torch.equal(small(x), want))
    return out


def _scheduler_loads(rank: int, P: int) -> dict:
    """A 2-layer stack under the two-phase scheduler with re-plans: per forward of each layer,
    the experts copied from host memory (counted by wrapping the copy) against the experts newly
    hosted on this rank by the placement that served it."""
    layers = [zipf_layer(20 + i, skew=2.0, top_k=1) for i in range(2)]
    est = PopularityEstimator(2, E)
    with torch.no_grad():
        for b in range(2):
            h = _tokens(0, 48, 300 + b)
            for lay in layers:
                h = h + lay(h)
            est.record(choices_from_layers(layers))
    sch = LinaScheduler(est, P)
    host = [t for lay in layers for t in _layer_experts(lay)]
    ok, loaded, expected, changes = True, [], [], 0
    with _CopyCounter(host) as cc:
        reps = [ReplicatedMoELayer(lay, scheduler=sch, layer_index=i, expert_slots=4) for i, lay in enumerate(layers)]
        prev = [rp.placement.hosted[rank] for rp in reps]
        cc.take()
        for b in range(4):
            x = _tokens(rank, [5, 0, 9, 14][(rank + b) % P], 400 + b)
            with torch.no_grad():
                h_ref, h = x, x
                for lay in layers:
                    h_ref = h_ref + lay(h_ref)
                for i, rp in enumerate(reps):
                    h = h + rp(h)
                    mine = rp.placement_used.hosted[rank]
                    loaded.append(sorted(e for e, _, _ in cc.take()))
                    expected.append(sorted(set(mine) - set(prev[i])))
                    changes += mine != prev[i]
                    prev[i] = mine
            ok = ok and bool(torch.equal(h, h_ref))
    return dict(equal=ok, loaded=loaded, expected=expected, changes=changes)


def single_device_case(rank: int, P: int, device: str = "cpu", group=None) -> dict:
    """One device serving all E experts (a group of one, ``group``): the host source (on CUDA:
    pinned, the layer's device copies released and shared by a second wrapper), outputs equal
    the local layer, and slot orders that are not the experts' order (reached by driving the
    slot loader directly, as a multi-rank placement change would: kept experts first, then the
    newly loaded ones in the freed slots) give the same outputs."""
    import copy

    cuda = device == "cuda"
    dt = torch.float32 if cuda else torch.float64
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(D, 6, E, 2, expert_ffn_bias=True), device=device, dtype=dt)
    ref = copy.deepcopy(layer)
    x = torch.randn(37, D, device=device, dtype=dt)
    out: dict = {}
    with torch.no_grad():
        want = ref(x)
        per = _per_expert_bytes(ref)
        rep = ReplicatedMoELayer(layer, group=group)
        host = list(rep.host.values())
        out["host_is_layer"] = rep.host["w1"].data_ptr() == layer.w1.data_ptr()
        out["released"] = layer.w1.numel() == 0
        out["pinned"] = all(t.is_pinned() for t in host)
        first = rep(x)
        out["equal_local"] = bool(torch.equal(first, want))
        out["max_diff_local"] = float((first - want).abs().max())
        out["held"] = _held_bytes(rep) == E * per
        with _CopyCounter(host) as cc:
            rep._load((5, 6, 7))  # exact-size slots: resized, kept experts moved on the device
            rep._load(tuple(range(E)))
            out["loaded"] = sorted(e for e, _, _ in cc.take())
            out["slot_order"] = list(rep.slot_experts)
            out["equal_resized"] = bool(torch.equal(rep(x), first))
            rep2 = ReplicatedMoELayer(layer, group=group, expert_slots=E)
            out["shared_host"] = rep2.host["w1"].data_ptr() == rep.host["w1"].data_ptr()
            rep2._load((0, 1, 2, 3))  # fixed slots: 4..7 leave, then come back into the freed slots 0..3
            rep2._load((4, 5, 6, 7))
            cc.take()
            rep2._load(tuple(range(E)))
            out["loaded2"] = sorted(e for e, _, _ in cc.take())
            out["slot_order2"] = list(rep2.slot_experts)
            out["equal_fixed"] = bool(torch.equal(rep2(x), first))
            out["empty_batch"] = tuple(rep2(x[:0]).shape) == (0, D)
        out["held2"] = _held_bytes(rep2) == E * per
    return out


def released_case(rank: int, P: int, device: str = "cpu", group=None) -> dict:
    """A layer whose expert tensors a ReplicatedMoELayer released to host memory (on CUDA the
    wrapper does it; on CPU ``release_to_host``, the same function, with unpinned memory): a
    direct call raises ExpertsReleasedError naming the wrapper and the fix; state_dict (the
    layer's and the wrapper's) reports the real weights, which load into a fresh layer;
    load_state_dict through the wrapper writes the host copy and reaches the slots; a wrong
    shape is named; restore_experts makes the layer run by itself again."""
    import copy

    from tritonmoe.inference import ExpertsReleasedError, is_released, restore_experts
    from tritonmoe.inference.replicated import EXPERT_TENSORS, release_to_host

    cuda = device == "cuda"
    dt = torch.float32 if cuda else torch.float64
    cfg = tm.MoEConfig(D, 6, E, 2, expert_ffn_bias=True)

    def same(a, b):
        return bool(torch.equal(a, b)) if not cuda else bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))

    torch.manual_seed(3)
    layer = tm.MoELayer(cfg, device=device, dtype=dt)
    ref = copy.deepcopy(layer)
    torch.manual_seed(4)
    new = tm.MoELayer(cfg, device=device, dtype=dt)
    x = torch.randn(19, D, device=device, dtype=dt)
    names = [n for n in EXPERT_TENSORS if getattr(layer, n) is not None]
    out: dict = {}
    with torch.no_grad():
        want, want_new = ref(x), new(x)
        if not cuda:
            release_to_host(layer, names, pin=False)
        rep = ReplicatedMoELayer(layer, group=group)
        out["released"] = is_released(layer) and all(getattr(layer, n).numel() == 0 for n in names)
        out["equal"] = same(rep(x), want)
        try:
            layer(x)
            out["direct"] = "no error"
        except ExpertsReleasedError as e:
            msg = str(e)
            out["direct"] = "ok" if isinstance(e, RuntimeError) and "ReplicatedMoELayer" in msg and \
                "restore_experts(layer)" in msg else msg
        except Exception:  # noqa: BLE001
            out["direct"] = traceback.format_exc()
        sd, rsd = layer.state_dict(), rep.state_dict()
        out["state_dict"] = all(bool(torch.equal(sd[n].to(device), getattr(ref, n))) for n in names) and all(
            bool(torch.equal(rsd["layer." + n].to(device), getattr(ref, n))) for n in names)
        import io

        buf = io.BytesIO()
        torch.save(layer, buf)  # the whole module (still picklable), loaded back: released, the same weights
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
        out["pickled"] = is_released(clone) and all(bool(torch.equal(clone.state_dict()[n].to(device), getattr(ref, n)))
                                                    for n in names)
        fresh = tm.MoELayer(cfg, device=device, dtype=dt)
        fresh.load_state_dict(sd)
        out["fresh_equal"] = bool(torch.equal(fresh(x), want))
        rep.load_state_dict({"layer." + k: v for k, v in new.state_dict().items()})
        out["load_equal"] = same(rep(x), want_new) and is_released(layer) and all(
            bool(torch.equal(rep.host[n].to(device), getattr(new, n))) for n in names)
        bad = {"layer." + k: v for k, v in new.state_dict().items()}  # (the other keys load, as torch does)
        bad["layer.w1"] = bad["layer.w1"][:-1]
        try:
            rep.load_state_dict(bad)
            out["bad_shape"] = "no error"
        except RuntimeError as e:
            out["bad_shape"] = "ok" if "size mismatch for layer.w1" in str(e) and f"{tuple(new.w1.shape)}" in str(e) \
                else str(e)
        restore_experts(layer)
        out["restored"] = (not is_released(layer)) and layer.w1.device == x.device and same(layer(x), want_new) \
            and same(rep(x), want_new)
        try:
            restore_experts(layer)
            out["restore_twice"] = "no error"
        except ValueError as e:
            out["restore_twice"] = "ok" if "not released" in str(e) else str(e)
    return out


def cuda_single_device_case(rank: int, P: int) -> dict:
    out = single_device_case(rank, P, "cuda")
    out["released_case"] = released_case(rank, P, "cuda")
    return out


def replicated_cases(rank: int, P: int) -> dict:
    """Every check of test_replicated in one group: per case, whether the replicated layer's
    output equals the local layer's bitwise, and what the test inspects."""
    out: dict = {}
    T_of = {"even": [13, 13, 13, 13], "ragged": [0, 17, 3, 9]}
    top2, top1 = zipf_layer(0, bias=True), zipf_layer(1, skew=2.0, top_k=1)
    for tok_name, Ts, layer in [(t, Ts, lay) for t, Ts in T_of.items() for lay in (top2, top1)]:
        tok_name = tok_name + ("/top1" if layer is top1 else "")
        x = _tokens(rank, Ts[rank], 1)
        with torch.no_grad():
            want = layer(x)
        load = _global_counts(layer, x)
        hand = Placement(E, ((0,), (0, 1), (0, 2, 3, 4), (0, 5, 6, 7)), ((1.0,), (2.0, 1.0), (1.0,) * 4, (1.0,) * 4))
        empty_dev = Placement(E, ((0, 1, 2, 3), (), (4, 5, 6, 7), (0,)))
        cases = {
            "contiguous": Placement.contiguous(E, P),
            "lina": lina_placement(load, P),
            "eplb": eplb_placement(load, P),
            "hand": hand,
            "empty_device": empty_dev,
        }
        for name, pl in cases.items():
            try:
                rep = ReplicatedMoELayer(layer, placement=pl)
                with torch.no_grad():
                    got = rep(x)
                out[f"{tok_name}/{name}"] = dict(
                    equal=bool(torch.equal(got, want)), shape=tuple(got.shape), rows=rep.rows_served,
                    replicas=pl.num_replicas(), max_hosted=pl.max_hosted, load=load.tolist(),
                    held=_held_bytes(rep), per_expert=_per_expert_bytes(layer), n_hosted=len(pl.hosted[rank]),
                    shares_host=_shares_storage(rep.expert_weights.values(), _layer_experts(layer)),
                )
            except Exception:  # noqa: BLE001
                out[f"{tok_name}/{name}"] = dict(equal=False, error=traceback.format_exc())
    # a stack of three layers under the two-phase scheduler, against the local stack
    layers = [zipf_layer(10 + i) for i in range(3)]
    est = PopularityEstimator(3, E)
    with torch.no_grad():
        for b in range(4):  # profile: record routing of local batches (the same on every rank)
            h = _tokens(0, 64, 100 + b)
            for lay in layers:
                h = h + lay(h)
            est.record(choices_from_layers(layers))
    sch = LinaScheduler(est, P)
    reps = [ReplicatedMoELayer(lay, scheduler=sch, layer_index=i) for i, lay in enumerate(layers)]
    ok = True
    for b in range(3):
        x = _tokens(rank, [11, 0, 7, 20][(rank + b) % P], 200 + b)
        with torch.no_grad():
            h_ref, h = x, x
            for lay in layers:
                h_ref = h_ref + lay(h_ref)
            for rp in reps:
                h = h + rp(h)
        ok = ok and bool(torch.equal(h, h_ref))
    out["scheduler"] = dict(equal=ok, decisions=sch.decisions, resumes=sch.resumes, replans=sch.replans,
                            unplanned=sch.unplanned, hosted=[rp.placement_used.hosted for rp in reps])
    out.update(_replan_cases(rank, P, top2))
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(P)]  # collective: every rank creates every group
    try:
        out["single_device"] = single_device_case(rank, P, "cpu", singles[rank])
    except Exception:  # noqa: BLE001
        out["single_device"] = dict(error=traceback.format_exc())
    try:
        out["released"] = released_case(rank, P, "cpu", singles[rank])
    except Exception:  # noqa: BLE001
        out["released"] = dict(error=traceback.format_exc())
    out["scheduler_loads"] = _scheduler_loads(rank, P)
    # bad input, raised on every rank before any exchange
    layer = top2
    out["bad_devices"] = _expect_error(lambda: ReplicatedMoELayer(layer, placement=Placement.contiguous(E, 2)),
                                       ValueError, "on a group of 4")
    mine = Placement.contiguous(E, P) if rank else Placement(E, ((0, 1), (2, 3), (4, 5), (6, 7, 0)))
    out["disagree"] = _expect_error(lambda: ReplicatedMoELayer(layer, placement=mine), ValueError, "disagree")
    out["not_layer"] = _expect_error(lambda: ReplicatedMoELayer(torch.nn.Linear(2, 2)), TypeError, "MoELayer")
    out.update(_refresh_and_agreement_cases(rank, P))
    return out


def _refresh_and_agreement_cases(rank: int, P: int) -> dict:
    """load_state_dict / in-place edits of the host weights reach the device slots; a
    set_placement that differs across ranks raises on every rank (checked by default)."""
    out: dict = {}
    layer, new = zipf_layer(30), zipf_layer(31)
    x = _tokens(rank, 9, 300)
    rep = ReplicatedMoELayer(layer)
    sd = {n: getattr(layer, n).detach().clone() for n in ("w1", "w2")}
    rep_sd = ReplicatedMoELayer(layer, host_experts=sd)  # a separate host copy: rebound to the loaded weights
    rep.load_state_dict({"layer." + k: v for k, v in new.state_dict().items()})
    with torch.no_grad():
        want = new(x)
        eq = [bool(torch.equal(rep(x), want)), bool(torch.equal(layer(x), want))]
    rep_sd.load_state_dict({"layer." + k: v for k, v in new.state_dict().items()})
    with torch.no_grad():
        eq.append(bool(torch.equal(rep_sd(x), want)))
        layer.w1.mul_(0.5)  # an in-place edit of the host copy: refresh_experts() reloads the slots
        rep.refresh_experts()
        eq.append(bool(torch.equal(rep(x), layer(x))))
    out["refresh"] = eq
    before = rep.placement
    mine = Placement.contiguous(E, P) if rank else Placement(E, ((0, 1), (2, 3), (4, 5), (6, 7, 0)))
    out["set_placement_disagree"] = _expect_error(lambda: rep.set_placement(mine), ValueError, "disagree")
    with torch.no_grad():  # the group is still in step and the placement unchanged
        out["after_disagree"] = rep.placement == before and bool(torch.equal(rep(x), layer(x)))
    return out


__all__ = ["replicated_cases", "zipf_layer", "single_device_case", "released_case", "cuda_single_device_case"]
