"""Baselines measured beside tritonmoe in the same run."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_expert_loop_moe(x_TD, router_weight_ED, w1_EDN, w2_EFD, top_k: int, activation: str = "swiglu"):
    """The common plain-PyTorch MoE: softmax top-k routing, then a Python loop over experts that
    gathers each expert's tokens, runs its FFN with torch.matmul and index_adds the weighted
    result back (as in Mixtral's HF implementation)."""
    logits = x_TD @ router_weight_ED.t()
    probs = torch.softmax(logits.float(), dim=-1)
    w_TK, ids_TK = probs.topk(top_k, dim=-1)
    w_TK = (w_TK / w_TK.sum(-1, keepdim=True)).to(x_TD.dtype)
    out = torch.zeros_like(x_TD)
    for e in range(w1_EDN.shape[0]):
        tok, slot = torch.where(ids_TK == e)
        if tok.numel() == 0:
            continue
        h = x_TD[tok] @ w1_EDN[e]
        if activation == "swiglu":
            f = h.shape[-1] // 2
            h = F.silu(h[:, :f]) * h[:, f:]
        elif activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        y = (h @ w2_EFD[e]) * w_TK[tok, slot, None]
        out.index_add_(0, tok, y)
    return out
