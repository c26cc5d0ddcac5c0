"""Expert placements for expert-parallel inference: which devices serve which experts.

A :class:`Placement` maps the E experts of one layer onto P devices: each device hosts a list of
distinct experts, each expert has one or more replicas, and a replica's ``weight`` says which
share of the expert's tokens it serves (a source rank splits its rows of an expert over the
replicas in proportion, :meth:`Placement.split`). Three planners:

* :meth:`Placement.contiguous`: the default expert-parallel layout (rank r owns the experts
  [r*E/P, (r+1)*E/P)), one replica each: "before" in every balance figure.
* :func:`lina_placement` (paper 001 §5.2, PAPERS.md §1.5): from the (estimated or actual)
  popularity p of the layer's experts, an expert with N*p_e >= 1 gets about N*p_e devices of
  its own, the others are packed by first-fit-decreasing into the remaining devices (bin
  capacity: one device's fair share; at most ``max_per_device`` = 4 experts per device, the
  paper's cap). Readings where the paper is silent (its Eq. 1 is lost): the replica counts
  are searched from ceil(N*p_e) down (one replica given back at a time by the expert whose load
  per replica stays lowest, then the least popular dedicated expert joins the packing; when
  the packing needs more devices than are left, an item that fits no bin goes to the
  least-loaded one) and the configuration with the lowest maximum device load is kept; the
  paper's floor(N*p_e) is on that path. Devices left idle go to the expert with the largest
  load per device; experts with no estimated load go to the devices hosting the fewest
  experts (the paper: "evenly ... otherwise randomly"). The result is never worse than
  :meth:`Placement.contiguous` on the maximum device load (when E is a multiple of P and the
  contiguous layout fits ``max_per_device``): where the packing had to overflow a device and
  the contiguous layout has the lower peak, the contiguous layout is returned.
* :func:`eplb_placement`: the hierarchical rebalancing of DeepSeek's EPLB, as the baseline:
  groups of experts packed onto nodes (balanced packing), replicas added one at a time to the
  expert with the largest load per replica until every slot is used, then the replicas packed
  onto the GPUs of each node (balanced packing, equal slots per GPU).

The planners are pure functions of the load vector (deterministic, ties to the lower index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import torch

from tritonmoe.core.suggest import suggest_unknown_kwargs

__all__ = ["Placement", "lina_placement", "eplb_placement", "MAX_PACKED_PER_DEVICE"]

#: Lina's cap on experts per device (001 §7.1).
MAX_PACKED_PER_DEVICE = 4


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}={v} must be >= {lo}")
    return v


def _load_vector(load, num_experts: Optional[int] = None) -> torch.Tensor:
    if not isinstance(load, torch.Tensor):
        try:
            load = torch.as_tensor(load, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"load must be a tensor or a sequence of numbers, got {type(load).__name__}") from None
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"load must be a non-empty 1-D vector (one entry per expert), got shape {tuple(load.shape)}")
    if load.dtype == torch.bool or load.is_complex():
        raise TypeError(f"load must be real numbers, got {load.dtype}")
    v = load.detach().to("cpu", torch.float64)
    if num_experts is not None and v.numel() != num_experts:
        raise ValueError(f"load has {v.numel()} entries, the placement {num_experts} experts")
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
        raise ValueError("load must be finite and >= 0 for every expert")
    return v


@suggest_unknown_kwargs
@dataclass(frozen=True)
class Placement:
    """Experts on devices.

    Args:
        num_experts: E.
        hosted: per device (P entries), the distinct experts it serves (kept in ascending order,
            the order of its rows in the expert-major buffer).
        weights: per device, per hosted expert, the replica's relative share of the expert's
            tokens (> 0); None: 1 for every replica (tokens split equally).

    Raises ValueError when an expert has no replica, a device hosts an expert twice, an id is
    outside [0, E), a weight is not positive; TypeError for non-integer ids.
    """

    num_experts: int
    hosted: tuple
    weights: Optional[tuple] = None

    def __post_init__(self) -> None:
        E = _int("num_experts", self.num_experts, 1)
        if isinstance(self.hosted, (str, bytes)) or not isinstance(self.hosted, Sequence):
            raise TypeError(f"hosted must be a sequence (one list of experts per device), got {type(self.hosted).__name__}")
        hosted = []
        for d, h in enumerate(self.hosted):
            if isinstance(h, (str, bytes)) or not isinstance(h, Sequence):
                raise TypeError(f"hosted[{d}] must be a sequence of expert ids, got {type(h).__name__}")
            ids = []
            for e in h:
                if isinstance(e, bool) or not isinstance(e, int):
                    raise TypeError(f"hosted[{d}] holds {e!r}; expert ids are ints")
                if not 0 <= e < E:
                    raise ValueError(f"hosted[{d}] holds expert {e} outside [0, {E})")
                ids.append(e)
            if len(set(ids)) != len(ids):
                raise ValueError(f"device {d} hosts an expert twice ({ids}); give that replica a larger weight instead")
            hosted.append(ids)
        if not hosted:
            raise ValueError("hosted is empty; a placement needs at least one device")
        if self.weights is None:
            weights = tuple(tuple(1.0 for _ in h) for h in hosted)
        else:
            if len(self.weights) != len(hosted) or any(len(w) != len(h) for w, h in zip(self.weights, hosted)):
                raise ValueError("weights must have one entry per hosted expert of every device")
            weights = tuple(tuple(float(x) for x in w) for w in self.weights)
            for d, w in enumerate(weights):
                if any(not (math.isfinite(x) and x > 0) for x in w):
                    raise ValueError(f"weights[{d}] = {w}: a replica's weight must be finite and > 0")
        seen = set(e for h in hosted for e in h)
        missing = [e for e in range(E) if e not in seen]
        if missing:
            raise ValueError(
                f"expert {missing[0]} has no replica (experts without one: {missing[:8]}{'...' if len(missing) > 8 else ''}); "
                "every expert must be hosted on at least one device"
            )
        # canonical order: a device's experts ascending (its rows are laid out in expert order)
        order = [sorted(range(len(h)), key=lambda j: h[j]) for h in hosted]
        hosted = [tuple(h[j] for j in o) for h, o in zip(hosted, order)]
        weights = tuple(tuple(w[j] for j in o) for w, o in zip(weights, order))
        object.__setattr__(self, "hosted", tuple(hosted))
        object.__setattr__(self, "weights", weights)
        reps: list[list[tuple[int, float]]] = [[] for _ in range(E)]
        for d, (h, w) in enumerate(zip(hosted, weights)):
            for e, x in zip(h, w):
                reps[e].append((d, x))
        object.__setattr__(self, "_replicas", tuple(tuple(r) for r in reps))
        # per expert, the replicas' weights as integers on one scale (exact: a float is a dyadic
        # rational) and their sum: the shares and the splits are computed exactly from them, so
        # no weight (1e308, 1e-300) can overflow a sum or round a share
        object.__setattr__(self, "_int_weights", tuple(_integer_weights([x for _, x in r]) for r in reps))

    # -- reading -------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.hosted)

    @property
    def max_hosted(self) -> int:
        """The most experts any device hosts (M: the width of the per-device buffers)."""
        return max(len(h) for h in self.hosted)

    def replicas(self, expert: int) -> tuple:
        """((device, weight), ...) of ``expert``'s replicas, ascending device."""
        return self._replicas[expert]

    def num_replicas(self) -> list[int]:
        return [len(r) for r in self._replicas]

    def shares(self) -> torch.Tensor:
        """fp64 [P, E]: the share of expert e's tokens device d serves (columns sum to 1)."""
        S = torch.zeros(self.num_devices, self.num_experts, dtype=torch.float64)
        for e, reps in enumerate(self._replicas):
            n, tot = self._int_weights[e]
            for (d, _), k in zip(reps, n):
                S[d, e] = float(Fraction(k, tot))  # exact share, rounded once
        return S

    def device_load(self, expert_load) -> torch.Tensor:
        """fp64 [P]: the load each device serves when expert e gets ``expert_load[e]`` tokens
        split over its replicas by weight."""
        v = _load_vector(expert_load, self.num_experts)
        return self.shares() @ v

    def imbalance(self, expert_load) -> float:
        """max / mean of :meth:`device_load` (1 = perfectly balanced)."""
        d = self.device_load(expert_load)
        mean = float(d.mean())
        return float(d.max()) / mean if mean > 0 else 1.0

    def split(self, expert: int, rows: int, source: int = 0) -> list[tuple[int, int]]:
        """[(device, rows)] of ``rows`` rows of ``expert`` sent by rank ``source``: largest-remainder
        (Hamilton) apportionment in proportion to the replicas' weights. Each replica gets the
        floor of its exact quota ``rows * w / sum(w)`` (exact integer arithmetic, whatever the
        weights' magnitude), then the rows left (fewer than the replicas) go one each to the
        replicas with the largest fractional remainders; ties go to the replicas in order starting
        at replica ``source mod r`` (so that sources spread their remainders). The counts sum to
        ``rows`` and each is the floor or the ceiling of its quota. Deterministic."""
        reps = self._replicas[expert]
        r = len(reps)
        if r == 1:
            return [(reps[0][0], rows)]
        n, tot = self._int_weights[expert]
        base = [rows * k // tot for k in n]
        rest = rows - sum(base)
        if rest:
            rem = [rows * k % tot for k in n]
            order = sorted(range(r), key=lambda j: (-rem[j], (j - source) % r))
            for j in order[:rest]:
                base[j] += 1
        return [(d, c) for (d, _), c in zip(reps, base)]

    def send_counts(self, counts_E: Sequence[int], source: int = 0) -> list[list[int]]:
        """Per device d, per hosted expert j of d, the rows rank ``source`` sends (its per-expert
        counts ``counts_E`` split by :meth:`split`): [P][len(hosted[d])]."""
        out = [[0] * len(h) for h in self.hosted]
        pos = [{e: j for j, e in enumerate(h)} for h in self.hosted]
        for e, c in enumerate(counts_E):
            for d, n in self.split(e, int(c), source):
                out[d][pos[d][e]] += n
        return out

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int) -> "Placement":
        """The default layout: device r hosts [r*E/P, (r+1)*E/P) (E divisible by P)."""
        E, P = _int("num_experts", num_experts, 1), _int("num_devices", num_devices, 1)
        if E % P:
            raise ValueError(f"num_experts={E} is not divisible by num_devices={P}; use a multiple of {P}")
        L = E // P
        return cls(E, tuple(tuple(range(r * L, (r + 1) * L)) for r in range(P)))

    def check_fits(self, max_per_device: int) -> None:
        """ValueError naming the device when one hosts more than ``max_per_device`` experts."""
        for d, h in enumerate(self.hosted):
            if len(h) > max_per_device:
                raise ValueError(f"device {d} hosts {len(h)} experts, more than max_per_device={max_per_device}")


def _integer_weights(weights: Sequence[float]) -> tuple[tuple[int, ...], int]:
    """Positive finite float weights as positive integers with the same ratios (exact), and their
    sum."""
    fr = [Fraction(w) for w in weights]
    den = 1
    for f in fr:
        den = den * f.denominator // math.gcd(den, f.denominator)
    n = tuple(f.numerator * (den // f.denominator) for f in fr)
    return n, sum(n)


# ---------------------------------------------------------------------------------------------
# Lina
# ---------------------------------------------------------------------------------------------


def _ffd(items: list[int], size: torch.Tensor, cap: int, max_bins: Optional[int]) -> list[list[int]]:
    """First-fit-decreasing of ``items`` (sizes ``size[e]``) into bins of capacity 1 holding at
    most ``cap`` items. With ``max_bins``, an item that fits no open bin and finds no new one
    goes to the least-loaded bin with room (the overflow)."""
    order = sorted(items, key=lambda e: (-float(size[e]), e))
    bins: list[list[int]] = []
    loads: list[float] = []
    eps = 1e-12
    for e in order:
        s = float(size[e])
        for b in range(len(bins)):
            if len(bins[b]) < cap and loads[b] + s <= 1.0 + eps:
                bins[b].append(e)
                loads[b] += s
                break
        else:
            if max_bins is None or len(bins) < max_bins:
                bins.append([e])
                loads.append(s)
            else:
                room = [b for b in range(len(bins)) if len(bins[b]) < cap]
                b = min(room, key=lambda b: (loads[b], b))
                bins[b].append(e)
                loads[b] += s
    return bins


def lina_placement(load, num_devices: int, *, max_per_device: int = MAX_PACKED_PER_DEVICE) -> Placement:
    """Lina's phase-one placement from a load vector (estimated or actual tokens per expert, any
    scale); see the module docstring. Every expert gets at least one replica; a device hosts
    one replicated expert or at most ``max_per_device`` packed ones; a replicated expert's
    tokens are split equally over its replicas."""
    N = _int("num_devices", num_devices, 1)
    cap = _int("max_per_device", max_per_device, 1)
    v = _load_vector(load)
    E = v.numel()
    if E > cap * N:
        raise ValueError(
            f"{E} experts do not fit on {N} devices with max_per_device={cap}; use more devices or a larger max_per_device"
        )
    tot = float(v.sum())
    p = v / tot if tot > 0 else torch.full((E,), 1.0 / E, dtype=torch.float64)
    size = N * p  # devices each expert needs
    reps = {e: int(math.ceil(float(size[e]) - 1e-12)) for e in range(E) if float(size[e]) >= 1.0 - 1e-12}
    # Configurations from ceil(N p_e) replicas downwards, one replica given back at a time by
    # the expert whose load per replica stays the lowest without it (then the least popular
    # dedicated expert joins the packing); the paper's floor(N p_e) lies on this path. Keep the
    # feasible configuration with the lowest maximum device load (the first on ties).
    best = None
    while True:
        unpop = [e for e in range(E) if e not in reps]
        free = N - sum(reps.values())
        if free >= 0 and cap * free >= len(unpop) and (free > 0 or not unpop):
            bins = _ffd([e for e in unpop if float(size[e]) > 0], size, cap, free)
            peak = max([float(size[e]) / r for e, r in reps.items()] + [sum(float(size[x]) for x in b) for b in bins]
                       + [0.0])
            if best is None or peak < best[0] - 1e-12:
                best = (peak, dict(reps), bins, unpop, free)
        if not reps:
            break
        multi = [e for e, r in reps.items() if r > 1]
        if multi:
            e = min(multi, key=lambda e: (float(size[e]) / (reps[e] - 1), e))
            reps[e] -= 1
        else:  # the least popular dedicated expert joins the packing
            e = min(reps, key=lambda e: (float(size[e]), -e))
            del reps[e]
    _, reps, bins, unpop, free = best
    # devices left idle (less those the experts with no estimated load need): to the expert with
    # the largest load per device
    dedicated = dict(reps)
    bins = [list(b) for b in bins]
    zero = [e for e in unpop if float(size[e]) == 0]
    short = max(0, len(zero) - sum(cap - len(b) for b in bins))
    idle = free - len(bins) - (short + cap - 1) // cap
    while idle > 0:
        best, score = None, 0.0
        for e, r in dedicated.items():
            if float(size[e]) / r > score:
                best, score = ("rep", e), float(size[e]) / r
        for bi, b in enumerate(bins):
            if len(b) > 1:
                e = max(b, key=lambda e: (float(size[e]), -e))
                if float(size[e]) > score:
                    best, score = ("move", bi, e), float(size[e])
        if best is None:
            break
        if best[0] == "rep":
            dedicated[best[1]] += 1
        else:
            _, bi, e = best
            bins[bi].remove(e)
            dedicated[e] = 1
        idle -= 1
    # experts with no estimated load: to the devices with the fewest experts (empty ones first)
    bins += [[] for _ in range(free - len(bins) - sum(dedicated.values()) + sum(reps.values()))]
    for e in zero:
        b = min((b for b in range(len(bins)) if len(bins[b]) < cap),
                key=lambda b: (len(bins[b]), sum(float(size[x]) for x in bins[b]), b))
        bins[b].append(e)
    hosted: list[tuple[int, ...]] = []
    for e in sorted(dedicated, key=lambda e: (-float(size[e]), e)):
        hosted += [(e,)] * dedicated[e]
    hosted += [tuple(b) for b in bins if b]
    hosted += [()] * (N - len(hosted))
    pl = Placement(E, tuple(hosted))
    # Never worse than the default layout on the planner's own objective (the maximum device
    # load): when first-fit-decreasing has to overflow a full bin (the packing needs more devices
    # than are left) it can lose to the contiguous layout; keep the contiguous one then.
    if E % N == 0 and E // N <= cap:
        base = Placement.contiguous(E, N)
        # (a relative margin: a round-off difference of the two sums keeps Lina's layout)
        if float(base.device_load(v).max()) < float(pl.device_load(v).max()) * (1 - 1e-12):
            return base
    return pl


# ---------------------------------------------------------------------------------------------
# EPLB (DeepSeek's hierarchical expert-parallel load balancer), the baseline
# ---------------------------------------------------------------------------------------------


def _balanced_packing(weight: list[float], num_packs: int) -> list[int]:
    """Pack n items into ``num_packs`` packs of exactly n / num_packs items each: heaviest
    first, each to the lightest pack with room. Returns the pack of every item."""
    n = len(weight)
    per = n // num_packs
    pack_of = [0] * n
    loads = [0.0] * num_packs
    counts = [0] * num_packs
    for i in sorted(range(n), key=lambda i: (-weight[i], i)):
        p = min((p for p in range(num_packs) if counts[p] < per), key=lambda p: (loads[p], p))
        pack_of[i] = p
        loads[p] += weight[i]
        counts[p] += 1
    return pack_of


def _replicate(weight: list[float], num_phy: int) -> list[int]:
    """Replica count per item: one each, then one more at a time to the item with the largest
    weight per replica, until ``num_phy`` replicas."""
    cnt = [1] * len(weight)
    for _ in range(num_phy - len(weight)):
        i = max(range(len(weight)), key=lambda i: (weight[i] / cnt[i], -i))
        cnt[i] += 1
    return cnt


def eplb_placement(
    load,
    num_devices: int,
    *,
    num_replicas: Optional[int] = None,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """EPLB's hierarchical rebalancing for one layer.

    Args:
        load: tokens per expert (usually a moving average of past batches: EPLB rebalances
            periodically from history).
        num_devices: GPUs; divisible by ``num_nodes``.
        num_replicas: physical expert slots in all (divisible by ``num_devices`` and
            ``num_nodes``, >= E); default E + ``num_devices`` (one redundant slot per GPU).
        num_groups: expert groups (E divisible), kept on one node each; divisible by
            ``num_nodes``.
        num_nodes: nodes.

    A GPU may hold two replicas of one expert (EPLB allows it); they become one replica of
    twice the weight.
    """
    v = _load_vector(load)
    E = v.numel()
    P = _int("num_devices", num_devices, 1)
    G = _int("num_groups", num_groups, 1)
    n_nodes = _int("num_nodes", num_nodes, 1)
    R = E + P if num_replicas is None else _int("num_replicas", num_replicas, 1)
    if E % G or G % n_nodes or P % n_nodes or R % P or R < E:
        raise ValueError(
            f"eplb_placement needs E={E} divisible by num_groups={G}, num_groups divisible by num_nodes={n_nodes}, "
            f"num_devices={P} divisible by num_nodes, num_replicas={R} >= E and divisible by num_devices"
        )
    w = v.tolist()  # host values: the packing is a host algorithm, run when a placement is planned
    gsize = E // G
    group_w = [sum(w[g * gsize:(g + 1) * gsize]) for g in range(G)]
    node_of_group = _balanced_packing(group_w, n_nodes)
    gpus_per_node = P // n_nodes
    slots_per_gpu = R // P
    hosted: list[dict[int, float]] = [dict() for _ in range(P)]
    for node in range(n_nodes):
        experts = [e for g in range(G) if node_of_group[g] == node for e in range(g * gsize, (g + 1) * gsize)]
        phy = gpus_per_node * slots_per_gpu
        if phy < len(experts):
            raise ValueError(f"node {node} has {len(experts)} experts but only {phy} slots; raise num_replicas")
        cnt = _replicate([w[e] for e in experts], phy)
        replicas = [(e, w[e] / c) for e, c in zip(experts, cnt) for _ in range(c)]
        gpu_of = _balanced_packing([x for _, x in replicas], gpus_per_node)
        for (e, _), g in zip(replicas, gpu_of):
            d = node * gpus_per_node + g
            hosted[d][e] = hosted[d].get(e, 0.0) + 1.0
    return Placement(E, tuple(tuple(h) for h in hosted), tuple(tuple(h.values()) for h in hosted))
