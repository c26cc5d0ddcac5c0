"""Expert-parallel serving of a :class:`~tritonmoe.inference.Placement` with replicas and
packing (Lina's inference scheduler, paper 001 §5.2 and §6.2; PAPERS.md §1.5).

:class:`ReplicatedMoELayer` wraps a local :class:`~tritonmoe.MoELayer` whose E experts are
identical on every rank of the group (inference weights, built from one seed or one checkpoint).
The full expert set lives in host memory (the layer's CPU tensors, a state dict, or a pinned
copy of the layer's GPU tensors); each rank's device holds only the experts its placement hosts
on it (replicas included), in compact ``[slots, ...]`` buffers with a slot -> expert map. Each
rank routes its own tokens with the layer's router, then:

1. gathers every rank's per-expert counts (one small all-gather; a host sync: the split sizes
   are host values, as in the expert-parallel layer), from which every rank derives every
   split;
2. permutes its tokens by expert, splits the rows of each expert over its replicas
   (:meth:`Placement.split`: in proportion to the replicas' weights, remainders rotated by
   source rank) and sends each chunk to its replica's device (the all-to-all of the rows);
3. reorders the received rows by slot (one segment copy) and computes the hosted experts (one
   grouped FFN over the slot buffers; a free slot has an empty segment);
4. returns the rows with the reverse all-to-all and combines them (``unpermute``).

A placement change (:meth:`ReplicatedMoELayer.set_placement`, or a re-plan of the scheduler)
loads only the experts newly hosted on the rank from host memory, into the slots of the experts
it no longer hosts; kept experts stay in their slots (001 §6.2's swap-in). On CUDA the copies
run on a copy stream, after the compute that last read the slots and before the next compute
(events); on CPU they are plain copies.

Where a token's rows are computed changes, not how: the output equals the local layer's on the
same tokens (bitwise in fp64 on the reference backend; ``tests/test_replicated.py``).

:class:`LinaScheduler` ties popularity estimation to placement over a stack of such layers
(two-phase scheduling): at layer l, after the gate, the counts all-gather of step 1 also
carries every rank's estimate for layer l+1 (from its tokens' sample paths: the piggyback of
001 §6.2), so the scheduler adds no collective; from the summed counts phase two keeps layer l's planned placement if its estimated top-k
experts are the actual ones ("resume"), else re-plans from the actual counts; phase one plans
layer l+1 from the summed estimate. Every rank computes the same placement from the same
gathered vectors (a deterministic planner), so no broadcast is needed. A layer with no
estimate (the first ``path_length`` layers have shorter paths; layer 0 has none) is planned from
its actual counts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
import weakref
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._released import _Released, is_released, mark_released
from .placement import MAX_PACKED_PER_DEVICE, Placement, lina_placement
from .popularity import PopularityEstimator, top_choices, top_k_match
from tritonmoe.comm.splits import group_rank_size
from tritonmoe.layer import MoELayer
from tritonmoe.comm import check_agreement
from tritonmoe.comm.errors import backend_errors, input_status, raise_rank_input_error
from tritonmoe.comm.splits import comm_device
from tritonmoe.comm.all_to_all import all_to_all_raw
from tritonmoe.backends import implementation
from tritonmoe.core.specs import ffn_options
from tritonmoe.core.suggest import UNSET, renamed_argument

__all__ = ["ReplicatedMoELayer", "LinaScheduler", "EXPERT_TENSORS", "plan_slots", "slot_segments", "release_to_host",
           "replica_fingerprint"]


class LinaScheduler:
    """Two-phase placement over a stack of :class:`ReplicatedMoELayer`\\ s (see the module
    docstring).

    Args:
        estimator: a profiled :class:`~tritonmoe.inference.PopularityEstimator` of the stack.
        num_devices: P, the expert-parallel group size.
        max_per_device: Lina's cap on packed experts per device (4).
        k_top: how many of the most popular experts phase two compares (the paper's top-2); an
            int in [1, E] (ValueError otherwise: 0 would compare empty sets, so phase two would
            always resume).

    Attributes: ``resumes`` and ``replans`` (phase-two outcomes), ``unplanned`` (layers planned
    from their actual counts because no estimate existed), ``decisions``: per layer call
    (layer, "resume"|"replan"|"unplanned").
    """

    def __init__(self, estimator: PopularityEstimator, num_devices: int, *, max_per_device: int = MAX_PACKED_PER_DEVICE,
                 k_top: int = 2) -> None:
        if not isinstance(estimator, PopularityEstimator):
            raise TypeError(f"estimator must be a PopularityEstimator, got {type(estimator).__name__}")
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices={num_devices!r} must be an int >= 1")
        if isinstance(max_per_device, bool) or not isinstance(max_per_device, int) or max_per_device < 1:
            raise ValueError(f"max_per_device={max_per_device!r} must be an int >= 1 (Lina's cap is "
                             f"{MAX_PACKED_PER_DEVICE})")
        E = estimator.num_experts
        # phase two compares the k_top most popular experts of the estimate and of the actual
        # counts (PAPERS.md §1.5, the paper's top-k): k_top = 0 would compare empty sets, so every
        # layer would "resume" and the gate's counts would never re-plan
        if isinstance(k_top, bool) or not isinstance(k_top, int):
            raise TypeError(f"k_top must be an int, got {type(k_top).__name__}")
        if not 1 <= k_top <= E:
            raise ValueError(f"k_top={k_top} must be in [1, {E}] (the {E} experts of the estimator): phase two compares "
                             f"the k_top most popular experts; Lina uses 2, pass k_top={min(2, E)}")
        if estimator.num_experts > max_per_device * num_devices:
            raise ValueError(f"{estimator.num_experts} experts do not fit on {num_devices} devices with "
                             f"max_per_device={max_per_device}")
        self.estimator = estimator
        self.num_devices = num_devices
        self.max_per_device = max_per_device
        self.k_top = k_top
        self.pending: dict[int, tuple[torch.Tensor, Placement]] = {}
        self.history: list[torch.Tensor] = []
        self.resumes = self.replans = self.unplanned = 0
        self.decisions: list[tuple[int, str]] = []

    def plan(self, load) -> Placement:
        return lina_placement(load, self.num_devices, max_per_device=self.max_per_device)

    def phase_one(self, layer: int, estimate: torch.Tensor) -> Placement:
        """Plan ``layer`` from its estimated load (before its gate runs)."""
        pl = self.plan(estimate)
        self.pending[layer] = (estimate.detach().to("cpu", torch.float64), pl)
        return pl

    def phase_two(self, layer: int, actual: torch.Tensor) -> tuple[Placement, str]:
        """``layer``'s placement once its gate ran: the planned one when the estimate's top-k
        experts are the actual top-k ("resume"), else one planned from ``actual`` ("replan");
        "unplanned" when there was no estimate."""
        actual = actual.detach().to("cpu", torch.float64)
        if layer not in self.pending:
            self.unplanned += 1
            out = (self.plan(actual), "unplanned")
        else:
            est, pl = self.pending.pop(layer)
            if top_k_match(est, actual, self.k_top):
                self.resumes += 1
                out = (pl, "resume")
            else:
                self.replans += 1
                out = (self.plan(actual), "replan")
        self.decisions.append((layer, out[1]))
        return out


#: The expert tensors of a MoELayer a serving rank holds per hosted expert (biases when present).
EXPERT_TENSORS = ("w1", "w2", "b1", "b2")

# Layers whose expert tensors were on the device and were moved to host memory by a
# ReplicatedMoELayer: their host copies, so that a second wrapper of the same layer shares them.
_RELEASED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def release_to_host(layer: nn.Module, names: Sequence[str], *, pin: bool) -> dict:
    """Copy ``layer``'s expert tensors ``names`` into host memory (pinned when ``pin``), release
    the layer's own copies (empty placeholders on their device) and mark the layer released
    (:mod:`tritonmoe.inference._released`: a direct call raises
    :class:`~tritonmoe.inference.ExpertsReleasedError`, ``state_dict`` reports the host copies,
    ``load_state_dict`` writes into them). Returns the host copy, shared by every later wrapper
    of the layer. What :class:`ReplicatedMoELayer` does with a layer on a GPU; device-agnostic
    (a CPU layer with ``pin=False`` goes through the same steps)."""
    with torch.no_grad():
        out = {n: torch.empty(getattr(layer, n).shape, dtype=getattr(layer, n).dtype, pin_memory=pin)
               .copy_(getattr(layer, n).detach()) for n in names}
        for n in names:  # release the layer's device copies: the host holds them now
            p = getattr(layer, n)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    _RELEASED[layer] = out
    mark_released(layer, _Released(
        owner="a ReplicatedMoELayer", names=list(names), host=functools.partial(_identity, out),
        write=functools.partial(_write_into, out),
        call_hint="serve it through the ReplicatedMoELayer that wraps it, on every rank of its group",
        on_restore=functools.partial(_forget_released, layer)))
    return out


def _digest(t: torch.Tensor) -> tuple[int, str]:
    """(int64 code, readable label) of a tensor's exact contents: a BLAKE2b digest of its dtype,
    shape and bytes (equal exactly when the tensors are bitwise equal), and its fp64 sum for
    the reader. One host copy of a device tensor (at construction only)."""
    t = t.detach()
    if t.is_meta:
        return -2, f"meta {tuple(t.shape)}"
    flat = t.reshape(-1).contiguous().cpu()  # host sync: construction only
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    total = float(flat.to(torch.float64).sum()) if not flat.dtype.is_complex else float("nan")
    return int(digest[:15], 16), f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} blake2b {digest[:12]} sum {total!r}"


def replica_fingerprint(layer, host: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, str]]:
    """(values, labels) for :func:`~tritonmoe.comm.check_agreement` of the ranks of a
    :class:`ReplicatedMoELayer`: the layer's :meth:`MoEConfig.agreement_values
    <tritonmoe.MoEConfig.agreement_values>` (every field but the rank-local ones), then
    ``weights:<name>`` per served tensor: the expert tensors of ``host`` (what the slots load)
    and every other entry of the layer's state dict (router, shared experts, biases), each a
    digest of its exact bytes (:func:`_digest`). Local, no collective."""
    values, labels = dict(layer.config.agreement_values()), dict(layer.config.agreement_labels())
    tensors = dict(host)
    for name, t in layer.state_dict().items():
        if name not in host and isinstance(t, torch.Tensor):
            tensors[name] = t
    for name, t in tensors.items():
        values[f"weights:{name}"], labels[f"weights:{name}"] = _digest(t)
    return values, labels


def _check_input(rep: "ReplicatedMoELayer", x) -> None:
    """A forward's input checks (typed errors; local, no collective)."""
    c = rep.layer.config
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != c.d_model:
        raise ValueError(f"x has shape {tuple(x.shape)}; the last dimension must be d_model={c.d_model}")
    dtype = rep.host[rep.names[0]].dtype
    if x.dtype != dtype:
        raise TypeError(f"x is {x.dtype} but the layer's parameters are {dtype}; cast one of them")
    if x.device != rep.device:
        raise ValueError(f"x is on {x.device} but the layer is on {rep.device}; move one of them")


def _check_replicas(layer, host: Mapping[str, torch.Tensor], group) -> None:
    """Replicas must compute the same thing: every config field that changes what a rank
    computes and a digest of every served tensor (:func:`replica_fingerprint`), compared once at
    construction (one collective; on a disagreement a second one gathers every rank's readable
    values, and every rank raises the same ValueError)."""
    values, labels = replica_fingerprint(layer, host)
    check_agreement(values, group=group, labels=labels,
                    what="the replicated layers' MoEConfig and weights (every rank must wrap a bitwise copy of the same "
                         "layer: build it from the same seed or load the same checkpoint)")


def _gather_counts(group, P: int, vec: torch.Tensor, refused: Optional[BaseException]) -> torch.Tensor:
    """:meth:`ReplicatedMoELayer._exchange_counts`' all-gather of every rank's [2E + 1] vector;
    a non-zero status word (the last entry: a rank that refused its input) raises the same
    RankInputError on every rank. Returns [P, 2E] (the words dropped)."""
    dev = comm_device(group)  # NCCL gathers CUDA tensors
    vec = vec.to(dev)
    parts = [torch.empty_like(vec) for _ in range(P)]
    with backend_errors("the replicated layer's counts all-gather", group):
        dist.all_gather(parts, vec, group=group)
    table = torch.stack(parts).cpu()  # host sync: the splits and the placement are host values
    raise_rank_input_error([int(v) for v in table[:, -1].tolist()], refused, group,
                           "the replicated layer's counts all-gather")
    return table[:, :-1]


def _identity(x):
    return x


def _write_into(host: dict, values: dict) -> None:
    with torch.no_grad():
        for n, v in values.items():
            host[n].copy_(v.detach())


def _forget_released(layer) -> None:
    _RELEASED.pop(layer, None)


def _copy_expert(dst: list, src: list, non_blocking: bool) -> None:
    """Copy one expert's tensors (``src``: views of the host copy) into its device slot (``dst``):
    the only host-to-device path of :class:`ReplicatedMoELayer` (tests wrap it to count bytes)."""
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


def plan_slots(current: Sequence[int], hosted: Sequence[int], num_slots: int):
    """How a rank's slots change from holding ``current`` (the expert per slot, -1 free) to
    holding ``hosted`` in ``num_slots`` slots: ``(slot_experts, moves, loads)``. With the same
    number of slots the buffers are kept: the experts still hosted stay in their slots and the
    newly hosted ones take the freed slots (lowest first). Otherwise new buffers: the kept
    experts first (``moves``: (old slot, new slot), device-to-device), then the new ones.
    ``loads``: (expert, slot) copied from host memory, exactly the experts of ``hosted`` not in
    ``current``."""
    want = set(hosted)
    have = set(e for e in current if e >= 0)
    incoming = [e for e in hosted if e not in have]
    if num_slots == len(current):
        slot_experts = [e if e in want else -1 for e in current]
        moves: list = []
    else:
        keep = [(k, e) for k, e in enumerate(current) if e in want]
        slot_experts = [e for _, e in keep] + [-1] * (num_slots - len(keep))
        moves = [(k, j) for j, (k, _) in enumerate(keep)]
    free = [k for k, e in enumerate(slot_experts) if e < 0]
    loads = list(zip(incoming, free))
    for e, k in loads:
        slot_experts[k] = e
    return slot_experts, moves, loads


def slot_segments(counts_PM: torch.Tensor, hosted: Sequence[int], slot_experts: Sequence[int]):
    """(src_starts, dst_starts, lengths, slot_offsets), int64: the segment copy from the
    received order (source s, then hosted expert j in ``hosted`` order; ``counts_PM[s, j]``
    rows) to slot order (slot k, then source), and the [slots + 1] row offsets of the slots in
    the result (a free slot: no rows). The reverse copy swaps the starts."""
    P = counts_PM.shape[0]
    S = len(slot_experts)
    slot_of = {e: k for k, e in enumerate(slot_experts) if e >= 0}
    col = torch.tensor([slot_of[e] for e in hosted], dtype=torch.int64)
    c_SP = torch.zeros(S, P, dtype=torch.int64)
    c_SP[col] = counts_PM.to(torch.int64).t()
    lens = counts_PM.to(torch.int64).reshape(-1)
    src = torch.cumsum(lens, 0) - lens
    flat = c_SP.reshape(-1)
    dst_SP = (torch.cumsum(flat, 0) - flat).view(S, P)
    dst = dst_SP[col].t().reshape(-1)  # (s, j) -> the start of (slot of j, s)
    off = torch.zeros(S + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(c_SP.sum(1), 0)
    return src, dst, lens, off


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (measured, not computed from shapes)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


# -- ReplicatedMoELayer's parts: its argument checks, its host copy, the rows it exchanges --------

def _check_expert_slots(slots) -> None:
    """``expert_slots``: None or an int >= 1."""
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int):
            raise TypeError(f"expert_slots must be an int or None, got {type(slots).__name__}")
        if slots < 1:
            raise ValueError(f"expert_slots={slots} must be >= 1 (or None: as many as the placement hosts)")


def _check_scheduler(scheduler, layer_index, world_size: int, num_experts: int, expert_slots: Optional[int]) -> None:
    """A :class:`LinaScheduler` fits the layer: the group's size, the experts, a ``layer_index``
    in its stack, and (fixed slots) room for the placements it may plan."""
    if not isinstance(scheduler, LinaScheduler):
        raise TypeError(f"scheduler must be a LinaScheduler, got {type(scheduler).__name__}")
    if scheduler.num_devices != world_size:
        raise ValueError(f"scheduler plans for {scheduler.num_devices} devices, the group has {world_size}")
    if scheduler.estimator.num_experts != num_experts:
        raise ValueError(f"scheduler's estimator has {scheduler.estimator.num_experts} experts, the layer {num_experts}")
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or not (
            0 <= layer_index < scheduler.estimator.num_layers):
        raise ValueError(f"layer_index={layer_index!r}: give this layer's position in the stack, "
                         f"0 <= layer_index < {scheduler.estimator.num_layers}")
    if expert_slots is not None and scheduler.max_per_device > expert_slots:
        raise ValueError(f"expert_slots={expert_slots} is below the scheduler's max_per_device={scheduler.max_per_device}: "
                         f"its placements may host {scheduler.max_per_device} experts on a device; use "
                         f"expert_slots >= {scheduler.max_per_device}")


def _check_placement(placement, num_experts: int, world_size: int, expert_slots: Optional[int]) -> None:
    """A :class:`Placement` fits the layer: its experts, the group's size, and (fixed slots) at
    most ``expert_slots`` experts per device. Reads only the placement (the same on every rank)."""
    E = num_experts
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tritonmoe.inference.Placement, got {type(placement).__name__}")
    for d, h in enumerate(placement.hosted):
        for e in h:
            if e >= E:
                raise ValueError(f"the placement hosts expert {e} on device {d}; the layer's experts are "
                                 f"[0, {E}): plan the placement for {E} experts")
    if placement.num_experts != E or placement.num_devices != world_size:
        raise ValueError(f"placement is for {placement.num_experts} experts on {placement.num_devices} devices; "
                         f"the layer has {E} experts on a group of {world_size}")
    if expert_slots is not None:
        for d, h in enumerate(placement.hosted):
            if len(h) > expert_slots:
                raise ValueError(f"the placement hosts {len(h)} experts on device {d}, more than its expert_slots={expert_slots}; "
                                 f"use a placement with at most {expert_slots} experts per device or more expert_slots")


def _host_source(layer, names: Sequence[str], host_experts, *, pin: bool) -> dict:
    """A :class:`ReplicatedMoELayer`'s host copy of ``layer``'s expert tensors ``names``: name ->
    the full [E, ...] tensor in host memory (pinned when ``pin``: serving on CUDA). From
    ``host_experts`` (checked against the layer), else the copy an earlier wrapper released to
    host memory, else the layer's own CPU tensors, else a new released copy
    (:func:`release_to_host`)."""
    if host_experts is not None:
        if not isinstance(host_experts, Mapping):
            raise TypeError(f"host_experts must be a mapping of tensor names to tensors, got "
                            f"{type(host_experts).__name__}")
        if set(host_experts) != set(names):
            raise ValueError(f"host_experts has {sorted(host_experts)}; the layer's expert tensors are "
                             f"{names}: pass exactly those")
        out = {}
        for n in names:
            t, ref = host_experts[n], getattr(layer, n)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"host_experts[{n!r}] must be a tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"host_experts[{n!r}] is on {t.device}; the host copy lives in CPU memory")
            if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
                raise ValueError(f"host_experts[{n!r}] is {tuple(t.shape)} {t.dtype}; the layer's is "
                                 f"{tuple(ref.shape)} {ref.dtype}")
            t = t.detach()
            out[n] = t.pin_memory() if pin and not t.is_pinned() else t
        return out
    if layer in _RELEASED:
        return _RELEASED[layer]
    if is_released(layer):
        raise ValueError("layer's experts were moved to host memory by another wrapper (an OffloadedExperts stack); "
                         "close it and call tritonmoe.inference.restore_experts(layer) first")
    ts = {n: getattr(layer, n).detach() for n in names}
    if all(t.device.type == "cpu" for t in ts.values()):
        # the layer's CPU copy is the shared source (pinned copies when serving on CUDA)
        return {n: (t.pin_memory() if pin and not t.is_pinned() else t) for n, t in ts.items()}
    return release_to_host(layer, names, pin=True)


def _rebind_host(host: dict, layer, names: Sequence[str], *, pin: bool) -> None:
    """After load_state_dict: when the host copy ``host`` is not the layer's own storage (an
    explicit ``host_experts``) and the layer holds its expert tensors, ``host`` is rebound to a
    copy of them (pinned when ``pin``; the caller's ``host_experts`` tensors are not written)."""
    with torch.no_grad():
        for n in names:
            t, h = getattr(layer, n), host[n]
            if t.shape != h.shape or t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr():
                continue  # released device copy (the host is the truth) or the same storage
            c = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host[n] = c.copy_(t.detach())


def _send_plan(pl: Placement, counts: Sequence[int], rank: int, P: int, num_experts: int):
    """What this rank sends: its permuted rows (grouped by expert, ``counts[e]`` rows each) split
    over each expert's replicas (:meth:`Placement.split`). Returns ``(send_splits, chunks)``: the
    rows per destination device, and the (start row, rows) chunks in sending order (device, then
    the expert's position among the device's hosted ones)."""
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    pos = [{e: j for j, e in enumerate(h)} for h in pl.hosted]
    seg = [[(0, 0)] * pl.max_hosted for _ in range(P)]  # (start row, rows) per (device, hosted slot)
    for e in range(num_experts):
        start = offsets[e]
        for d, n in pl.split(e, counts[e], rank):
            seg[d][pos[d][e]] = (start, n)
            start += n
    return [sum(n for _, n in row) for row in seg], [(s, n) for row in seg for s, n in row if n]


def _recv_counts(pl: Placement, table: list, hosted: Sequence[int], rank: int, P: int) -> torch.Tensor:
    """int64 [P, len(hosted)]: the rows every source rank sends to this rank's ``hosted`` experts
    (the split each source computes, recomputed here from the gathered counts ``table[s][e]``)."""
    return torch.tensor(
        [[dict(pl.split(e, table[s][e], s)).get(rank, 0) for e in hosted] for s in range(P)], dtype=torch.int64
    ).view(P, len(hosted))


class ReplicatedMoELayer(nn.Module):
    """Serve a local :class:`~tritonmoe.MoELayer` (all E experts, identical on every rank) over
    the expert-parallel group ``group`` with a :class:`Placement` (see the module docstring).

    Args:
        layer: the local MoELayer (not expert-parallel; dropless routing: no capacity). Its
            router (and shared experts) run on its device; its routed experts are served from
            host memory (below).
        group: the process group (None: the default group).
        placement: a fixed placement (default: :meth:`Placement.contiguous`); every rank must
            pass the same one (checked once, collectively).
        scheduler: a :class:`LinaScheduler` choosing the placement per forward (then
            ``layer_index`` is this layer's position in the stack, the layers run in order).
        host_experts: the full expert set in host memory, ``{"w1": [E, ...], "w2": ..., "b1",
            "b2"}`` (the layer's expert tensors' names, shapes and dtypes; CPU tensors, e.g. a
            checkpoint's state dict). Default: the layer's own expert tensors when they are on
            the CPU (shared, not copied); when they are on a GPU they are copied once into pinned
            host memory and the layer's device copies are released (:func:`release_to_host`:
            calling the layer itself then raises
            :class:`~tritonmoe.inference.ExpertsReleasedError`, its ``state_dict`` reports the
            host copy and ``load_state_dict`` writes into it; another wrapper of the same layer
            shares the host copy; :func:`~tritonmoe.inference.restore_experts` undoes it).
        expert_slots: device slots, one expert each, for the hosted experts (``slots=`` is its
            deprecated name: a :class:`DeprecationWarning`; OffloadedExperts' slots hold layers). None: exactly as many as the placement hosts on
            this rank (the buffers are reallocated when that number changes, kept experts copied
            over on the device); an int: a fixed buffer of that many slots, and a placement
            hosting more experts on any device raises ValueError.

    The device holds only the hosted experts: ``expert_weights`` (name -> [slots, ...]) and
    ``slot_experts`` (the global expert in each slot, -1 for a free slot). A new placement loads
    only the experts newly hosted on this rank from the host copy, into the slots of the experts
    it no longer hosts (kept experts stay in their slots): on CUDA on a copy stream, ordered
    after the compute that last read the slots and before the next forward's compute by events;
    on CPU a plain copy.

    After a forward, ``placement_used`` is the placement that served it, ``decision`` the
    scheduler's phase-two outcome, ``rows_served`` the rows this rank computed. Load
    statistics: ``last_load_experts`` (experts loaded by the last placement change),
    ``load_bytes`` / ``load_s`` / ``loads`` (host-to-device bytes, host seconds spent issuing
    them, placement changes that loaded something; cumulative), ``device_copy_bytes`` (kept
    experts moved on the device when the slot buffers were resized).

    Inference only: the exchanges are not differentiable (run it under ``torch.no_grad()``) and
    no auxiliary loss is computed. Every rank of the group must call it, in the same order.
    """

    @property
    def slots(self) -> Optional[int]:
        """Deprecated name of :attr:`expert_slots` (OffloadedExperts' ``slots`` are layer buffers)."""
        import warnings

        warnings.warn("ReplicatedMoELayer.slots is deprecated: use expert_slots", DeprecationWarning, stacklevel=2)
        return self.expert_slots

    def __init__(self, layer: nn.Module, group=None, *, placement: Optional[Placement] = None,
                 scheduler: Optional[LinaScheduler] = None, layer_index: Optional[int] = None,
                 host_experts: Optional[Mapping[str, torch.Tensor]] = None, expert_slots: Optional[int] = None,
                 slots=UNSET) -> None:
        super().__init__()
        slots = renamed_argument("ReplicatedMoELayer", "expert_slots", expert_slots, "slots", slots)

        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer must be a tritonmoe.MoELayer, got {type(layer).__name__}")
        if layer.expert_parallel:
            raise ValueError("layer is already expert-parallel; pass a local MoELayer holding all experts")
        if layer.config.capacity_factor is not None:
            raise ValueError("ReplicatedMoELayer serves dropless routing; build the layer with capacity_factor=None")
        self.rank, self.world_size = group_rank_size(group)
        self.group = group
        self.layer = layer
        E = layer.config.num_experts
        _check_expert_slots(slots)
        self.expert_slots = slots
        if scheduler is not None:
            _check_scheduler(scheduler, layer_index, self.world_size, E, slots)
        self.scheduler = scheduler
        self.layer_index = layer_index
        self.device = layer.router.weight.device
        self.names = [n for n in EXPERT_TENSORS if getattr(layer, n) is not None]
        self.host = _host_source(layer, self.names, host_experts, pin=self.device.type == "cuda")
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._ready = None  # CUDA event: the last placement change's copies are done
        self.slot_experts: list[int] = []
        self.expert_weights: dict[str, torch.Tensor] = {
            n: torch.zeros((0, *t.shape[1:]), dtype=t.dtype, device=self.device) for n, t in self.host.items()}
        self.placement_used: Optional[Placement] = None
        self.decision: Optional[str] = None
        self.rows_served = 0
        self.last_load_experts: list[int] = []
        self.load_bytes = self.device_copy_bytes = self.loads = 0
        self.load_s = 0.0
        self._hosted: tuple = ()
        self.placement = None
        if self.world_size > 1:
            _check_replicas(layer, self.host, group)
        self.set_placement(placement if placement is not None else Placement.contiguous(E, self.world_size), check=True)
        # load_state_dict writes the layer's expert tensors: reload the slots from them afterwards
        self.register_load_state_dict_post_hook(ReplicatedMoELayer._after_load_state_dict)

    @staticmethod
    def _after_load_state_dict(module, incompatible_keys) -> None:
        _rebind_host(module.host, module.layer, module.names, pin=module.device.type == "cuda")
        module.refresh_experts()

    def refresh_experts(self) -> None:
        """Reload every hosted slot from the host copy. Called after ``load_state_dict``; call it
        yourself after editing the host copy (the layer's expert tensors, or ``host_experts``) in
        place, since the device slots hold copies made when the experts were loaded."""
        if not self.slot_experts or all(e < 0 for e in self.slot_experts):
            return
        stream = self._copy_stream
        nb = stream is not None
        bufs = self.expert_weights
        with torch.no_grad():
            if nb:  # the compute that last read the slots comes first
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if nb else contextlib.nullcontext():
                for k, e in enumerate(self.slot_experts):
                    if e >= 0:
                        _copy_expert([bufs[n][k] for n in self.names], [self.host[n][e] for n in self.names], nb)
                if nb:
                    self._ready = torch.cuda.Event()
                    self._ready.record(stream)
            if nb:
                for t in bufs.values():
                    t.record_stream(stream)

    # -- placement -----------------------------------------------------------------------------

    def set_placement(self, placement: Placement, *, check: bool = True) -> None:
        """Serve ``placement`` from now on and load the experts newly hosted on this rank.
        ``check`` (default True): compare it across ranks first (one small collective, here only,
        never in the forward; the same ValueError on every rank when they differ, instead of a
        mismatched exchange in the next forward); pass False only when every rank provably holds
        the same placement (the scheduler's own changes skip it). The checks on the placement itself run before any collective and
        raise on every rank (they read only the placement, the same on every rank)."""
        _check_placement(placement, self.layer.config.num_experts, self.world_size, self.expert_slots)
        if check and self.world_size > 1:
            check_agreement({"placement": hash((placement.hosted, placement.weights)) % (2**61)}, group=self.group,
                            what="the placement (pass the same Placement on every rank)")
        self._load(placement.hosted[self.rank])
        self.placement = placement
        self._hosted = placement.hosted[self.rank]

    def _load(self, hosted: tuple) -> None:
        """Make the slots hold exactly ``hosted``: kept experts stay (in their slot, or moved on
        the device when the buffers are resized), newly hosted ones are copied from the host."""
        t0 = time.perf_counter()
        cur = self.slot_experts
        S = len(hosted) if self.expert_slots is None else self.expert_slots
        slot_experts, moves, loads = plan_slots(cur, hosted, S)
        self.last_load_experts = [e for e, _ in loads]
        if S == len(cur) and not loads:  # nothing to copy: the experts no longer hosted just leave
            self.slot_experts = slot_experts
            return
        stream = self._copy_stream
        nb = stream is not None
        old = self.expert_weights
        with torch.no_grad():
            if S == len(cur):  # the same buffers: the new experts take the freed slots
                bufs = old
            else:  # new buffers (allocated on the compute stream): kept experts moved on the device
                bufs = {n: torch.zeros((S, *t.shape[1:]), dtype=t.dtype, device=self.device) for n, t in old.items()}
            if nb:
                # the compute that last read the slots, and the allocation above, come first
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if nb else contextlib.nullcontext():
                for k_old, k_new in moves:
                    for n in self.names:
                        bufs[n][k_new].copy_(old[n][k_old], non_blocking=nb)
                    self.device_copy_bytes += self.expert_bytes
                for e, k in loads:
                    _copy_expert([bufs[n][k] for n in self.names], [self.host[n][e] for n in self.names], nb)
                if nb:
                    self._ready = torch.cuda.Event()
                    self._ready.record(stream)
            if nb:  # the copy stream uses these: their memory is not reused before it is done
                for t in {id(t): t for t in list(old.values()) + list(bufs.values())}.values():
                    t.record_stream(stream)
        self.expert_weights = bufs
        self.slot_experts = slot_experts
        if loads:
            self.loads += 1
            self.load_bytes += len(loads) * self.expert_bytes
        self.load_s += time.perf_counter() - t0

    def device_expert_bytes(self) -> int:
        """Device bytes held by this rank's expert weights (the slot buffers' storages)."""
        return _storage_bytes(self.expert_weights.values())

    # -- forward -------------------------------------------------------------------------------

    def _exchange_counts(self, routing, refused: Optional[BaseException] = None) -> torch.Tensor:
        """fp64 [P, 2E]: every rank's per-expert counts of this layer and (under a scheduler) its
        estimate for the next layer, from one all-gather (host values: the split sizes and the
        placement are decided on the host). From it every rank derives the global popularity,
        the placement and every split, so no other exchange of counts is needed. The gathered
        vectors end with each rank's status word: a rank whose input was ``refused`` sends zeros
        and the error's word, and every rank raises the same
        :class:`~tritonmoe.comm.errors.RankInputError` (the healthy path adds one number)."""
        E = self.layer.config.num_experts
        vec = torch.zeros(2 * E + 1, dtype=torch.float64)
        vec[2 * E] = input_status(refused)
        if refused is None:
            vec[:E] = routing.counts.to("cpu", torch.float64)  # host sync: counts size the exchanges
        sch, l = self.scheduler, self.layer_index
        if sch is not None and refused is None:
            if l == 0:
                sch.history = []
            choices = top_choices(routing.topk_ids).cpu()
            sch.history = sch.history[:l] + [choices]
            if l + 1 < sch.estimator.num_layers:  # phase one for the next layer, piggybacked
                vec[E : 2 * E] = sch.estimator.estimate(l + 1, torch.stack(sch.history, dim=1))
        if self.world_size == 1:
            return vec[: 2 * E].view(1, -1)
        return _gather_counts(self.group, self.world_size, vec, refused)

    def _schedule(self, table: torch.Tensor) -> None:
        """Phase two for this layer, phase one for the next, from the gathered counts."""
        sch, l = self.scheduler, self.layer_index
        E = self.layer.config.num_experts
        tot = table.sum(0)
        placement, self.decision = sch.phase_two(l, tot[:E])
        if l + 1 < sch.estimator.num_layers:
            sch.phase_one(l + 1, tot[E:])
        self.set_placement(placement, check=False)  # planned from the all-gathered counts: the same on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, c = self.layer, self.layer.config
        try:
            _check_input(self, x)
        except (TypeError, ValueError, IndexError) as exc:
            if self.world_size > 1:  # the others wait in the counts all-gather: take it, then all raise
                self._exchange_counts(None, refused=exc)
            raise
        x_TD = x.reshape(-1, c.d_model)
        _, routing = layer.route(x_TD)
        layer.last_routing = routing
        table = self._exchange_counts(routing)
        if self.scheduler is not None:
            self._schedule(table)
        out = self.experts(x_TD, routing, table[:, : c.num_experts])
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(x_TD)
        return out if x.dim() == 2 else out.view(x.shape)

    def experts(self, x_TD: torch.Tensor, routing, counts_PE: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for this rank's tokens, computed where the placement
        puts them; ``counts_PE``: every rank's per-expert counts (from :meth:`_exchange_counts`)."""

        layer, c = self.layer, self.layer.config
        pl, P, rank = self.placement, self.world_size, self.rank
        self.placement_used = pl
        impl = layer.expert_path.impl
        x_perm, info = impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts)
        table = counts_PE.to(torch.int64).tolist()
        send_splits, chunks = _send_plan(pl, table[rank], rank, P, c.num_experts)
        idx = [torch.arange(s, s + n) for s, n in chunks]
        idx = torch.cat(idx).to(x_perm.device) if idx else torch.zeros(0, dtype=torch.int64, device=x_perm.device)
        x_send = x_perm.index_select(0, idx)
        # what every source sends to this rank's hosted experts: the same split, computed here
        mine = self._hosted
        recv_counts_PM = _recv_counts(pl, table, mine, rank, P)
        Md = len(mine)
        recv_splits = recv_counts_PM.sum(1).tolist()
        recv, _ = all_to_all_raw(x_send, send_splits, recv_splits, self.group) if P > 1 else (x_send, None)
        rows = recv.shape[0]
        self.rows_served = rows
        if rows and Md:
            # recv holds chunks (source s, hosted expert j ascending); the grouped FFN wants them
            # by slot (the slot of each hosted expert), then source: one segment copy each way
            src, dst, lens, off = slot_segments(recv_counts_PM, mine, self.slot_experts)
            copy = implementation("copy_segments", c.backend, recv.device)
            dev = recv.device
            src, dst, lens = src.to(dev), dst.to(dev), lens.to(dev)
            x_RD = copy(recv, src, dst, lens, rows)
            if self._ready is not None:  # the placement change's copies land before the compute
                torch.cuda.current_stream(self.device).wait_event(self._ready)
                self._ready = None
            w = self.expert_weights
            y_RD = impl("grouped_ffn", x_RD)(x_RD, off.to(dev), w["w1"], w["w2"], c.activation, w.get("b1"),
                                             w.get("b2"), **ffn_options(c))
            y = copy(y_RD, dst, src, lens, rows)
        else:
            y = recv.new_zeros(rows, x_TD.shape[1])
        back, _ = all_to_all_raw(y, recv_splits, send_splits, self.group) if P > 1 else (y, None)
        y_perm = torch.zeros_like(x_perm).index_copy_(0, idx, back)
        return impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)
