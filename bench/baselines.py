"""Baselines measured beside tritonmoe in the same run.

* ``loop``: the common plain-PyTorch MoE, a Python loop over experts with one torch.matmul per
  GEMM in the input dtype (as in Hugging Face's Mixtral). It needs each expert's rows on the host,
  so it synchronizes with the device every call, as it does in the models that use it.
* ``grouped_mm``: ``torch._grouped_mm`` (CUTLASS grouped GEMM on sm90, present in recent torch),
  with a sort-based dispatch and an inverse-permutation combine around it (as torchtitan does).
  Its ``offs`` are the cumulative *end* rows of the groups, int32 [E] (our ``expert_offsets[1:]``);
  on CUDA it takes bf16 only and needs 16-byte-aligned strides (d, n1, f multiples of 8).

The reference path (``backend="torch"``, :mod:`tritonmoe.reference`) is the third baseline; the
suites call it through the public API.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonmoe import reference

from .harness import Unavailable, first_line


def activation_fn(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The expert activation in the input dtype (swiglu: silu(gate) * up, gate = first half)."""
    if activation == "swiglu":
        f = h.shape[-1] // 2
        return F.silu(h[..., :f]) * h[..., f:]
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r}; use 'swiglu', 'gelu' or 'relu'")


# ---------------------------------------------------------------------------------------------
# Per-expert loops
# ---------------------------------------------------------------------------------------------


def loop_grouped_ffn(x_RD, expert_offsets, w1_EDN, w2_EFD, activation: str = "swiglu"):
    """grouped_ffn over a permuted buffer as a loop of torch.matmul per expert segment."""
    offs = expert_offsets.tolist()  # host sync: the loop slices rows per expert
    E = w1_EDN.shape[0]
    pieces = []
    for e in range(E):
        a, b = offs[e], offs[e + 1]
        if b > a:
            pieces.append(activation_fn(x_RD[a:b] @ w1_EDN[e], activation) @ w2_EFD[e])
    if x_RD.shape[0] > offs[E]:
        pieces.append(x_RD.new_zeros(x_RD.shape[0] - offs[E], w2_EFD.shape[-1]))
    if not pieces:
        return x_RD.new_zeros(x_RD.shape[0], w2_EFD.shape[-1])
    return torch.cat(pieces, dim=0)


def loop_moe_ffn(x_TD, topk_ids_TK, topk_weights_TK, w1_EDN, w2_EFD, activation: str = "swiglu"):
    """Hugging Face Mixtral-style expert block for a given routing: for each expert, gather its
    tokens, run its FFN, scale by the gate weight and index_add into the output."""
    out = torch.zeros_like(x_TD)
    w_TK = topk_weights_TK.to(x_TD.dtype)
    for e in range(w1_EDN.shape[0]):
        tok, slot = torch.where(topk_ids_TK == e)  # host sync: the number of tokens of expert e
        if tok.numel() == 0:
            continue
        y = activation_fn(x_TD[tok] @ w1_EDN[e], activation) @ w2_EFD[e]
        out.index_add_(0, tok, y * w_TK[tok, slot, None])
    return out


def per_expert_loop_moe(
    x_TD,
    router_weight_ED,
    w1_EDN,
    w2_EFD,
    top_k: int,
    activation: str = "swiglu",
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias=None,
    n_groups=None,
    topk_groups=None,
):
    """The whole plain-PyTorch MoE layer: router matmul, routing, then :func:`loop_moe_ffn`.

    Plain softmax top-k routing is written inline (as in Mixtral); sigmoid, bias and
    group-limited routing use tritonmoe's reference router, the plain-PyTorch statement of them.
    """
    logits = x_TD @ router_weight_ED.t()
    if score_func == "softmax" and expert_bias is None and not n_groups:
        probs = torch.softmax(logits.float(), dim=-1)
        w_TK, ids_TK = probs.topk(top_k, dim=-1)
        if renormalize:
            w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    else:
        r = reference.route(
            logits, top_k, score_func=score_func, renormalize=renormalize, expert_bias=expert_bias,
            n_groups=n_groups, topk_groups=topk_groups,
        )
        ids_TK, w_TK = r.topk_ids, r.topk_weights
    return loop_moe_ffn(x_TD, ids_TK, w_TK, w1_EDN, w2_EFD, activation)


# ---------------------------------------------------------------------------------------------
# torch._grouped_mm
# ---------------------------------------------------------------------------------------------


def grouped_mm_offsets(expert_offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's ``offs`` from tritonmoe's [E+1] start offsets: int32 [E] end rows."""
    return expert_offsets[1:].to(torch.int32)


def require_grouped_mm(device: torch.device, dtype: torch.dtype, *, backward: bool) -> None:
    """Raise :class:`Unavailable` unless torch._grouped_mm exists and runs (with backward when
    asked) for this device and dtype, checked on a tiny aligned problem."""
    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    try:
        x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=backward)
        w = torch.randn(3, 16, 16, device=device, dtype=dtype, requires_grad=backward)
        offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
        if backward:
            torch.autograd.grad(y, (x, w), torch.randn_like(y))
    except Exception as exc:  # dtype or arch not supported by this build
        raise Unavailable(f"torch._grouped_mm does not run for {dtype} on {device.type}: {first_line(exc)}") from None


def grouped_mm_ffn(x_RD, offs_E, w1_EDN, w2_EFD, activation: str = "swiglu"):
    """grouped_ffn with two torch._grouped_mm calls; ``offs_E`` from :func:`grouped_mm_offsets`.
    Rows past offs_E[-1] are not written by _grouped_mm: use it on unpadded buffers
    (R == expert_offsets[E])."""
    h = torch._grouped_mm(x_RD, w1_EDN, offs=offs_E)
    return torch._grouped_mm(activation_fn(h, activation), w2_EFD, offs=offs_E)


def grouped_mm_moe_ffn(x_TD, topk_ids_TK, topk_weights_TK, w1_EDN, w2_EFD, activation: str = "swiglu"):
    """Routed expert FFN around torch._grouped_mm with no host sync: stable sort of the slots
    by expert, gather, two grouped GEMMs, weight, and an inverse-permutation gather plus a sum
    over k (deterministic, no atomics)."""
    T, K = topk_ids_TK.shape
    E = w1_EDN.shape[0]
    flat = topk_ids_TK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order inside
    counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x_perm = x_TD[order // K]
    y_perm = grouped_mm_ffn(x_perm, offs, w1_EDN, w2_EFD, activation)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y_TKD = y_perm[inv].view(T, K, -1)
    return (y_TKD * topk_weights_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(dim=1)
