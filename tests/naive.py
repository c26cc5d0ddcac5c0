"""Naive per-token implementations written independently of tritonmoe.reference.

They follow DESIGN.md's contracts literally, one token and one slot at a time with Python loops,
so that the vectorized reference (and through it every kernel) is checked against a second,
obviously-correct reading of the spec. Only for small inputs.
"""

from __future__ import annotations

import math

import torch


def _score_row(logits_row: torch.Tensor, score_func: str) -> list[float]:
    vals = [float(v) for v in logits_row.detach().double()]
    if score_func == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) if v > -math.inf else 0.0 for v in vals]
    m = max(vals)
    ex = [math.exp(v - m) if v > -math.inf else 0.0 for v in vals]
    s = sum(ex)
    return [e / s for e in ex]


def route(logits, top_k, *, score_func="softmax", renormalize=True, expert_bias=None,
          n_groups=None, topk_groups=None, capacity=None, group_score="top2sum", routed_scaling_factor=1.0):
    """Returns (ids [T][k] list, weights [T][k] list of float, counts [E], selected_counts [E]).
    Selection on fp64 scores (plus the bias): the order the canonical values of the reference
    follow away from near-ties."""
    T, E = logits.shape
    ids, weights = [], []
    for t in range(T):
        s = _score_row(logits[t], score_func)
        sel = [s[e] + (float(expert_bias[e]) if expert_bias is not None else 0.0) for e in range(E)]
        sel = [-math.inf if math.isnan(v) else v for v in sel]
        allowed = [True] * E
        if n_groups is not None and n_groups > 1:
            g_size = E // n_groups
            gscores = []
            for g in range(n_groups):
                members = sorted(sel[g * g_size:(g + 1) * g_size], reverse=True)
                top2 = group_score == "top2sum" and g_size > 1
                gscores.append(members[0] + members[1] if top2 else members[0])
            kept = sorted(range(n_groups), key=lambda g: (-gscores[g], g))[:topk_groups]
            allowed = [(e // g_size) in kept for e in range(E)]
        # allowed first, then descending score, then ascending id
        order = sorted(range(E), key=lambda e: (not allowed[e], -sel[e], e))
        chosen = order[:top_k]
        w = [s[e] for e in chosen]
        if renormalize:
            tot = max(sum(w), 1e-20)
            w = [v / tot for v in w]
        w = [v * routed_scaling_factor for v in w]
        ids.append(chosen)
        weights.append(w)
    selected = [0] * E
    for t in range(T):
        for e in ids[t]:
            selected[e] += 1
    if capacity is not None:
        held = [0] * E
        for j in range(top_k):
            for t in range(T):
                e = ids[t][j]
                if held[e] >= capacity:
                    ids[t][j] = -1
                    weights[t][j] = 0.0
                else:
                    held[e] += 1
    counts = [0] * E
    for t in range(T):
        for e in ids[t]:
            if e >= 0:
                counts[e] += 1
    return ids, weights, counts, selected


def permute(x, ids, num_experts, pad_to=1):
    """Returns (x_perm tensor, offsets list, slot_rows [T][k] list, counts list)."""
    T = len(ids)
    k = len(ids[0]) if T else 0
    rows, slot_rows = [], [[-1] * k for _ in range(T)]
    offsets, counts = [0], []
    for e in range(num_experts):
        n = 0
        for t in range(T):
            for j in range(k):
                if ids[t][j] == e:
                    slot_rows[t][j] = len(rows)
                    rows.append(x[t])
                    n += 1
        counts.append(n)
        for _ in range((-n) % pad_to):  # zero rows up to a multiple of pad_to
            rows.append(torch.zeros_like(x[0]))
        offsets.append(len(rows))
    d = x.shape[1]
    x_perm = torch.stack(rows) if rows else x.new_zeros(0, d)
    return x_perm, offsets, slot_rows, counts


def unpermute(y_perm, slot_rows, weights, dtype):
    T = len(slot_rows)
    d = y_perm.shape[1]
    out = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        for j, r in enumerate(slot_rows[t]):
            if r >= 0:
                out[t] += float(weights[t][j]) * y_perm[r].double()
    return out.to(dtype)


def act(h, activation):
    if activation == "swiglu":
        f = h.shape[-1] // 2
        g, u = h[..., :f], h[..., f:]
        return g / (1 + torch.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0)))
    return torch.clamp(h, min=0)


def expert_ffn(x_row, w1_e, w2_e, activation):
    """One token through one expert in fp64."""
    h = x_row.double() @ w1_e.double()
    return act(h, activation) @ w2_e.double()


def moe_layer(x_TD, router_w_ED, w1, w2, cfg, expert_bias=None):
    """The MoE layer token by token in fp64, differentiable w.r.t. x, the router and the experts.

    Selection comes from the naive router on the layer's own logits (ids are constants); weights
    are the scores at the selected experts, renormalized over the k selected before capacity
    dropping (dropped slots then contribute nothing)."""
    logits = x_TD @ router_w_ED.t()
    opts = dict(score_func=cfg.score_func, renormalize=cfg.renormalize, expert_bias=expert_bias,
                n_groups=cfg.n_groups, topk_groups=cfg.topk_groups)
    chosen, _, _, _ = route(logits.detach(), cfg.top_k, **opts)
    kept, _, _, _ = route(logits.detach(), cfg.top_k, capacity=cfg.capacity(x_TD.shape[0]), **opts)
    lf = logits.double()
    s = torch.softmax(lf, -1) if cfg.score_func == "softmax" else torch.sigmoid(lf)
    rows = []
    for t in range(x_TD.shape[0]):
        w = s[t, chosen[t]]
        if cfg.renormalize:
            w = w / w.sum().clamp_min(1e-20)
        acc = torch.zeros(x_TD.shape[1], dtype=torch.float64)
        for j, e in enumerate(kept[t]):
            if e >= 0:
                acc = acc + w[j] * expert_ffn(x_TD[t], w1[e], w2[e], cfg.activation)
        rows.append(acc)
    out = torch.stack(rows) if rows else torch.zeros(0, x_TD.shape[1], dtype=torch.float64)
    return out, kept


def act_full(h, activation, limit=7.0, alpha=1.702):
    """``act`` plus GPT-OSS's clamped SwiGLU (gate clamped from above, up from both sides)."""
    if activation == "swiglu_oai":
        f = h.shape[-1] // 2
        g = torch.clamp(h[..., :f], max=limit)
        u = torch.clamp(h[..., f:], min=-limit, max=limit)
        return (u + 1) * g * (1 / (1 + torch.exp(-alpha * g)))
    return act(h, activation)


def model_layer(x_TD, layer):
    """A MoELayer with every real-model option (router bias and dtype, group score, routed
    scaling factor, expert biases, clamped SwiGLU, gated shared expert), token by token in fp64,
    differentiable w.r.t. x and every parameter of ``layer`` (read from it)."""
    cfg = layer.config
    W = layer.router.weight
    logits = x_TD.to(W.dtype) @ W.t()
    if layer.router.bias is not None:
        logits = logits + layer.router.bias
    opts = dict(score_func=cfg.score_func, renormalize=cfg.renormalize, expert_bias=layer.expert_bias,
                n_groups=cfg.n_groups, topk_groups=cfg.topk_groups, group_score=cfg.group_score)
    chosen, _, _, _ = route(logits.detach(), cfg.top_k, **opts)
    kept, _, _, _ = route(logits.detach(), cfg.top_k, capacity=cfg.capacity(x_TD.shape[0]), **opts)
    lf = logits.double()
    s = torch.softmax(lf, -1) if cfg.score_func == "softmax" else torch.sigmoid(lf)
    lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    rows = []
    for t in range(x_TD.shape[0]):
        w = s[t, chosen[t]]
        if cfg.renormalize:
            w = w / w.sum().clamp_min(1e-20)
        w = w * cfg.routed_scaling_factor
        xt = x_TD[t].double()
        acc = torch.zeros(x_TD.shape[1], dtype=torch.float64)
        for j, e in enumerate(kept[t]):
            if e < 0:
                continue
            h = xt @ layer.w1[e].double()
            if layer.b1 is not None:
                h = h + layer.b1[e].double()
            y = act_full(h, cfg.activation, lim, alpha) @ layer.w2[e].double()
            if layer.b2 is not None:
                y = y + layer.b2[e].double()
            acc = acc + w[j] * y
        sh = layer.shared_experts
        if sh is not None:
            y = act_full(xt @ sh.w1.double(), cfg.activation, lim, alpha) @ sh.w2.double()
            if sh.gate is not None:
                y = y / (1 + torch.exp(-(xt @ sh.gate.double())))
            acc = acc + y
        rows.append(acc)
    out = torch.stack(rows) if rows else torch.zeros(0, x_TD.shape[1], dtype=torch.float64)
    return out, kept
