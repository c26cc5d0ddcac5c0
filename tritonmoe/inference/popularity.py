"""Expert-popularity estimation from sample paths (Lina, paper 001 §5.2; PAPERS.md §1.4).

Before layer l's gate runs, estimate how many of a batch's tokens each of its experts will get,
from the experts the same tokens picked in the previous layers. Profiling groups tokens by their
*sample path* pi = (e^(l-m), ..., e^(l-1)) (each element a token's top-1 expert in that layer,
PAPERS.md §1.4 Ambiguity 1) and keeps, per layer, one hash map pi -> counts of the expert picked
at layer l (P_l(e | pi) = count(pi, e) / count(pi)). The default path length is the paper's
m = 3; layer l uses the min(m, l) previous layers.

At inference, token t with path pi_t contributes P_l(. | pi_t) restricted to its ``k_est`` most
likely experts (the paper uses the top-k "since they demand the most resources"; ``k_est=None``
keeps the whole distribution), renormalized to one token; summed over the batch this is the
expected load per expert (:meth:`PopularityEstimator.estimate`, summing to the batch's tokens).

Unseen paths (PAPERS.md §1.4 Ambiguity 3): the estimator backs off to the longest suffix of the
path that was seen (a shorter path), and finally to the layer's marginal frequency; a layer
with no recorded data at all is estimated uniform (T / E tokens per expert). Tables are updated
online with :meth:`PopularityEstimator.record` (counts only add, so the tables do not
depend on the order tokens or batches were recorded in).

    est = PopularityEstimator(num_layers=12, num_experts=16)
    est.record(choices)                   # int [T, 12]: each token's top-1 expert per layer
    load = est.estimate(4, choices[:, :4])   # fp64 [16]: expected tokens per expert at layer 4
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["PopularityEstimator", "top_choices", "choices_from_layers", "l1_error", "top_k_match"]


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}={v} must be >= {lo}")
    return v


def top_choices(topk_ids: torch.Tensor) -> torch.Tensor:
    """A token's path element at one layer: its top-1 expert (column 0 of ``route``'s ids, which
    are in descending score), int64 [T]."""
    if topk_ids.dim() == 1:
        return topk_ids.to(torch.int64)
    return topk_ids[:, 0].to(torch.int64)


def choices_from_layers(layers: Sequence[torch.nn.Module]) -> torch.Tensor:
    """int64 [T, L]: the top-1 expert of every token at each of ``layers`` (MoELayers, in
    execution order) in their last forward (``layer.last_routing``), the recorded routing the
    estimator profiles."""
    cols = []
    for i, layer in enumerate(layers):
        r = getattr(layer, "last_routing", None)
        if r is None:
            raise ValueError(f"layers[{i}] has no recorded routing; run a forward through the stack first")
        cols.append(top_choices(r.topk_ids).cpu())  # host sync: the estimator's tables live on the host
    T = {c.shape[0] for c in cols}
    if len(T) != 1:
        raise ValueError(f"the layers routed different token counts {sorted(T)}; record one batch through the stack")
    return torch.stack(cols, dim=1)


def l1_error(estimate: torch.Tensor, actual: torch.Tensor) -> float:
    """L1 distance between the two load vectors, each normalized to sum 1 (0 = the same
    popularity, 2 = disjoint)."""
    e = estimate.to(torch.float64)
    a = actual.to(torch.float64)
    se, sa = float(e.sum()), float(a.sum())
    if se <= 0 or sa <= 0:
        return 0.0 if se <= 0 and sa <= 0 else 2.0
    return float((e / se - a / sa).abs().sum())


def top_k_match(estimate: torch.Tensor, actual: torch.Tensor, k: int = 2) -> bool:
    """Lina's accuracy criterion: the k most popular experts of the estimate are the actual k
    most popular (as sets; ties to the lower expert id)."""
    def top(v: torch.Tensor) -> set:
        order = torch.sort(-v.to(torch.float64), stable=True).indices
        return set(order[:k].tolist())  # host values: a host verdict (re-plan or not)

    return top(estimate) == top(actual)


class PopularityEstimator:
    """Per-layer tables of expert choice conditioned on the sample path (see the module
    docstring).

    Args:
        num_layers: L, MoE layers of the stack.
        num_experts: E, experts per layer.
        path_length: m, how many previous layers a path covers (default 3, the paper's).
        k_est: experts kept per token in :meth:`estimate` (default 2, the paper's top-2; None:
            the whole conditional distribution).

    Attributes: ``tables[l]``: dict path tuple -> int64 [E] counts (for every suffix length
    1..min(m, l), so backing off is a lookup); ``marginal[l]``: int64 [E]; ``tokens``: tokens
    recorded.
    """

    def __init__(self, num_layers: int, num_experts: int, *, path_length: int = 3, k_est: Optional[int] = 2) -> None:
        self.num_layers = _check_int("num_layers", num_layers, 1)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        self.path_length = _check_int("path_length", path_length, 0)
        if k_est is not None:
            _check_int("k_est", k_est, 1)
        self.k_est = k_est
        self.tables: list[dict[tuple, torch.Tensor]] = [dict() for _ in range(num_layers)]
        self.marginal = [torch.zeros(num_experts, dtype=torch.int64) for _ in range(num_layers)]
        self.tokens = 0

    # -- profiling -----------------------------------------------------------------------------

    def _check_choices(self, choices: torch.Tensor, width: int, what: str) -> torch.Tensor:
        if not isinstance(choices, torch.Tensor):
            raise TypeError(f"{what} must be an int tensor, got {type(choices).__name__}")
        if choices.dtype.is_floating_point or choices.dtype == torch.bool or choices.dim() != 2:
            raise TypeError(f"{what} must be an int tensor [tokens, layers], got {choices.dtype} {tuple(choices.shape)}")
        if choices.shape[1] != width:
            raise ValueError(f"{what} has {choices.shape[1]} layers (columns), expected {width}")
        c = choices.to(torch.int64).cpu()  # host sync: the tables are host dicts keyed by sample paths
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= self.num_experts):
            bad = c[(c < 0) | (c >= self.num_experts)][0]
            raise ValueError(f"{what} holds expert id {int(bad)} outside [0, {self.num_experts}); dropped slots (-1) "
                             "have no path: record the top-1 choices of routed tokens")
        return c

    def record(self, choices: torch.Tensor) -> None:
        """Add recorded routing: ``choices`` int [T, L], token t's top-1 expert at each layer
        (e.g. :func:`choices_from_layers`). Online: call it for every profiled batch."""
        c = self._check_choices(choices, self.num_layers, "choices")
        E = self.num_experts
        self.tokens += c.shape[0]
        for l in range(self.num_layers):
            self.marginal[l] += torch.bincount(c[:, l], minlength=E)
            for m in range(1, min(self.path_length, l) + 1):
                keys = c[:, l - m: l + 1]  # the path (m columns) and the choice
                uniq, counts = torch.unique(keys, dim=0, return_counts=True)
                table = self.tables[l]
                for row, n in zip(uniq.tolist(), counts.tolist()):
                    path = tuple(row[:-1])
                    v = table.get(path)
                    if v is None:
                        v = table[path] = torch.zeros(E, dtype=torch.int64)
                    v[row[-1]] += n

    # -- estimation ----------------------------------------------------------------------------

    def distribution(self, layer: int, path: Sequence[int]) -> torch.Tensor:
        """P_layer(. | path) as fp64 [E] (the path's last element is the layer before; longer
        paths than ``path_length`` use their last ``path_length`` elements); backs off to the
        longest seen suffix, then to the marginal, then to uniform when nothing was recorded."""
        self._check_layer(layer)
        path = tuple(int(e) for e in path)[-min(self.path_length, layer):] if layer and self.path_length else ()
        table = self.tables[layer]
        for m in range(len(path), 0, -1):
            v = table.get(path[-m:])
            if v is not None and int(v.sum()) > 0:
                return v.to(torch.float64) / float(v.sum())
        return self.unconditional(layer)

    def unconditional(self, layer: int) -> torch.Tensor:
        """The layer's marginal popularity, fp64 [E] summing to 1 (uniform before any record)."""
        self._check_layer(layer)
        v = self.marginal[layer]
        s = int(v.sum())
        if s == 0:
            return torch.full((self.num_experts,), 1.0 / self.num_experts, dtype=torch.float64)
        return v.to(torch.float64) / s

    def estimate(self, layer: int, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Expected load per expert of ``layer`` for a batch, fp64 [E] summing to its T tokens.

        ``history``: int [T, h], the tokens' top-1 experts in the h layers before ``layer``
        (column h-1 = layer-1; h may exceed ``path_length``: the last columns are used). None or
        h = 0 gives the unconditional estimate, which then needs ``T`` tokens: pass
        ``torch.empty(T, 0)``.

        Before anything was recorded for ``layer`` (no data) the estimate is uniform, T / E per
        expert (not truncated to ``k_est`` experts: with no data there is no top-k).
        """
        self._check_layer(layer)
        if history is None:
            raise ValueError("history is None; pass the tokens' choices in the previous layers, int [T, h] (h may be 0)")
        h = history.shape[1] if history.dim() == 2 else -1
        if h > layer:
            raise ValueError(f"history has {h} layers but layer {layer} has only {layer} layers before it")
        c = self._check_choices(history, max(h, 0), "history")
        T = c.shape[0]
        m = min(self.path_length, h)
        if T == 0:
            return torch.zeros(self.num_experts, dtype=torch.float64)
        if int(self.marginal[layer].sum()) == 0:
            # nothing recorded for this layer: no expert is known to be more popular than another,
            # so the load is spread evenly (truncating the uniform distribution to k_est experts
            # would put every token on experts 0..k_est-1, the lowest ids winning the ties)
            return torch.full((self.num_experts,), T / self.num_experts, dtype=torch.float64)
        if m == 0:
            return self._truncate(self.unconditional(layer)) * T
        uniq, inverse, counts = torch.unique(c[:, h - m:], dim=0, return_inverse=True, return_counts=True)
        out = torch.zeros(self.num_experts, dtype=torch.float64)
        for path, n in zip(uniq.tolist(), counts.tolist()):
            out += self._truncate(self.distribution(layer, path)) * n
        return out

    def _truncate(self, p: torch.Tensor) -> torch.Tensor:
        """A token's distribution restricted to its k_est most likely experts (ties to the lower
        id), renormalized to one token."""
        if self.k_est is None or self.k_est >= p.numel():
            return p
        keep = torch.sort(-p, stable=True).indices[: self.k_est]
        q = torch.zeros_like(p)
        q[keep] = p[keep]
        s = float(q.sum())
        return q / s if s > 0 else p

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer={layer} outside [0, {self.num_layers})")
