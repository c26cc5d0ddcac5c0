"""Argument checks for the public entry points.

Every check raises before any kernel launch or collective: TypeError for a wrong type or dtype,
ValueError for a wrong shape or value, IndexError for an id or row index out of range. Messages
name the offending value and say what would be accepted.

``check_*`` functions always run shape/dtype/device checks; the ``*_values`` functions read tensor
contents (a device synchronization) and run only while validation is enabled.
"""

from __future__ import annotations

import math
import numbers

import torch

from tritonmoe.core.types import PermuteInfo

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
#: Dtypes of row indices and offsets: signed (-1 marks "not routed") and wide enough for R.
INDEX_DTYPES = (torch.int32, torch.int64)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_SCORES = ("top2sum", "max", "sum_topn")
#: Capacity drop policies of route(..., capacity=c, drop_policy=...).
DROP_POLICIES = ("slot", "position", "probs")
ACTIVATIONS = ("swiglu", "swiglu_oai", "gelu", "relu")
#: Activations whose first projection has 2 * d_ffn columns (gate, then up).
GLU_ACTIVATIONS = ("swiglu", "swiglu_oai")
#: GPT-OSS's clamped SwiGLU defaults (transformers' GptOssExperts: limit 7.0, alpha 1.702).
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702


def is_int(v) -> bool:
    """An integer that is not a bool: Python ints and integer scalars such as numpy.int64."""
    t = type(v)
    if t is int:  # the common case first: the ABC check below costs microseconds per call
        return True
    return t is not bool and isinstance(v, numbers.Integral)


def is_real(v) -> bool:
    """A real number that is not a bool (Python or numpy scalars)."""
    t = type(v)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(v, numbers.Real)


def finite(v) -> bool:
    """``math.isfinite`` by comparisons only, so that torch.compile can trace it when ``v`` is a
    symbolic float (``dynamic=True`` makes Python floats SymFloats; ``math.isfinite`` of one is a
    graph break)."""
    return v == v and v != math.inf and v != -math.inf


def tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def float_tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    tensor(name, t, ndim)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; use float16, bfloat16, float32 or float64")
    return t


def int_tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    tensor(name, t, ndim)
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; it holds indices, use an integer dtype (int32 or int64)")
    return t


def same_device(**tensors: torch.Tensor) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    dev0 = items[0][1].device
    for n, t in items[1:]:
        if t.device != dev0:
            raise ValueError(
                f"{n} is on {t.device} but {items[0][0]} is on {dev0}; move them to one device"
            )


def positive_int(name: str, v, minimum: int = 1) -> int:
    if not is_int(v):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{name}={v} must be >= {minimum}")
    return int(v)


def choice(name: str, v, options: tuple[str, ...]) -> str:
    if v not in options:
        raise ValueError(f"{name}={v!r} is not supported; use one of {', '.join(map(repr, options))}")
    return v


def routing_options(
    num_experts: int,
    top_k,
    score_func,
    renormalize,
    n_groups,
    topk_groups,
    capacity=None,
    *,
    group_score="top2sum",
    routed_scaling_factor=1.0,
    drop_policy="slot",
) -> None:
    """Checks shared by route() and MoEConfig."""
    E = num_experts
    if not is_int(top_k):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__} {top_k!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={E}]")
    choice("score_func", score_func, SCORE_FUNCS)
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if n_groups is None:
        if topk_groups is not None:
            raise ValueError(f"topk_groups={topk_groups} needs n_groups; give both or neither")
    else:
        positive_int("n_groups", n_groups)
        if E % n_groups:
            raise ValueError(f"num_experts={E} is not divisible by n_groups={n_groups}; pick a divisor of {E}")
        if topk_groups is None:
            raise ValueError(f"n_groups={n_groups} needs topk_groups (how many groups to keep), in [1, {n_groups}]")
        positive_int("topk_groups", topk_groups)
        if topk_groups > n_groups:
            raise ValueError(f"topk_groups={topk_groups} exceeds n_groups={n_groups}")
        if topk_groups * (E // n_groups) < top_k:
            raise ValueError(
                f"top_k={top_k} exceeds the {topk_groups * (E // n_groups)} experts in the "
                f"topk_groups={topk_groups} kept groups of {E // n_groups}; raise topk_groups"
            )
    choice("group_score", group_score, GROUP_SCORES)
    if group_score == "sum_topn" and n_groups is not None and n_groups > 1 and top_k < topk_groups:
        raise ValueError(
            f"group_score='sum_topn' scores a group by its top top_k // topk_groups = {top_k} // {topk_groups} = 0 "
            f"values; use top_k >= topk_groups, or group_score='top2sum' or 'max'"
        )
    choice("drop_policy", drop_policy, DROP_POLICIES)
    if not is_real(routed_scaling_factor):
        raise TypeError(
            f"routed_scaling_factor must be a real number, got {type(routed_scaling_factor).__name__} "
            f"{routed_scaling_factor!r}"
        )
    if not (finite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(
            f"routed_scaling_factor={routed_scaling_factor!r} must be finite and > 0 (1.0 leaves the weights as "
            "they are; DeepSeek-V3 uses 2.5)"
        )
    if capacity is not None:
        if not is_int(capacity):
            raise TypeError(f"capacity must be an int or None, got {type(capacity).__name__} {capacity!r}")
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0 (or None for dropless)")


def route_args(logits, top_k, score_func, renormalize, expert_bias, n_groups, topk_groups, capacity, with_aux,
               group_score="top2sum", routed_scaling_factor=1.0, drop_policy="slot") -> None:
    float_tensor("logits", logits, 2)
    E = logits.shape[1]
    if E == 0:
        raise ValueError("logits has 0 experts (shape [T, 0]); need at least one expert column")
    routing_options(E, top_k, score_func, renormalize, n_groups, topk_groups, capacity,
                    group_score=group_score, routed_scaling_factor=routed_scaling_factor, drop_policy=drop_policy)
    if expert_bias is not None:
        float_tensor("expert_bias", expert_bias, 1)
        if expert_bias.shape[0] != E:
            raise ValueError(f"expert_bias has shape {tuple(expert_bias.shape)}; expected [{E}] (one per expert)")
        same_device(logits=logits, expert_bias=expert_bias)
    if not isinstance(with_aux, bool):
        raise TypeError(f"with_aux must be a bool, got {type(with_aux).__name__}")


def padding_mask(mask, num_tokens: int, name: str = "padding_mask", device=None) -> None:
    """A token mask: bool [T] (True = a real token), on the tokens' device."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor [T] (True = a real token) or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} has dtype {mask.dtype}; use a bool tensor (True = a real token), e.g. mask.bool()")
    if tuple(mask.shape) != (num_tokens,):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but there are {num_tokens} tokens; pass one entry per token "
            f"([{num_tokens}], e.g. attention_mask.reshape(-1).bool())"
        )
    if device is not None and mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the tokens are on {device}; move it with .to({str(device)!r})")


def sequence_length(s, num_tokens: int) -> None:
    """``sequence_length`` of the sequence-level aux loss: a positive int dividing T."""
    if s is None:
        return
    if not is_int(s):
        raise TypeError(f"sequence_length must be an int or None, got {type(s).__name__} {s!r}")
    if s < 1:
        raise ValueError(f"sequence_length={s} must be >= 1 (tokens per sequence)")
    if num_tokens % s:
        raise ValueError(
            f"sequence_length={s} does not divide the {num_tokens} tokens; the tokens are read as [B, S] flattened "
            f"batch-major, so T must be B * sequence_length (pad the batch, or pass the right length)"
        )


def route_values(logits: torch.Tensor, score_func: str, expert_bias) -> None:
    lf = logits.detach()
    bad = torch.isnan(lf)
    if score_func == "softmax":
        pos_inf = torch.isposinf(lf)
        all_neg_inf = torch.isneginf(lf).all(dim=-1)
    n_nan = int(bad.sum())  # host sync: value validation (switch off with set_validation(False))
    if n_nan:
        t = int(bad.any(dim=-1).nonzero()[0, 0])
        raise ValueError(
            f"logits contain {n_nan} NaN value(s) (first in token {t}); NaN scores cannot be ranked. "
            "Fix the router input, or call set_validation(False) to rank NaN as -inf (weights NaN)"
        )
    if score_func == "softmax":
        if bool(pos_inf.any()):
            t = int(pos_inf.any(dim=-1).nonzero()[0, 0])
            raise ValueError(f"logits contain +inf (first in token {t}); softmax of +inf is NaN. Clamp the logits")
        if bool(all_neg_inf.any()):
            t = int(all_neg_inf.nonzero()[0, 0])
            raise ValueError(
                f"token {t} has all logits -inf; its softmax is NaN. Leave at least one expert finite"
            )
    if expert_bias is not None and not bool(torch.isfinite(expert_bias).all()):
        raise nonfinite_bias_error("expert_bias", expert_bias)


def nonfinite_bias_error(name: str, bias: torch.Tensor, others: int = 0) -> ValueError:
    """The error for a selection bias with non-finite entries (reads the bias: error path only)."""
    bad = ~torch.isfinite(bias.detach())
    e = int(bad.nonzero()[0, 0])
    more = f" (and {others} more biases)" if others else ""
    return ValueError(
        f"{name}[{e}]={float(bias[e])} is not finite ({int(bad.sum())} of {bias.shape[0]} entries){more}: a "
        "non-finite selection bias silently reroutes every token. The bias update diverged or the checkpoint is "
        "corrupt: restore the bias from the last good step (or reset it to zeros) and check the update rate"
    )


def permute_args(x, topk_ids, num_experts, pad_to, num_rows=None) -> None:
    tensor("x", x, 2)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; use float16, bfloat16, float32 or float64")
    int_tensor("topk_ids", topk_ids, 2)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens; one row of ids per token"
        )
    same_device(x=x, topk_ids=topk_ids)
    positive_int("num_experts", num_experts)
    positive_int("pad_to", pad_to)
    if num_rows is not None:
        if not is_int(num_rows):
            raise TypeError(f"num_rows must be an int or None, got {type(num_rows).__name__} {num_rows!r}")
        T, k = topk_ids.shape
        bound = T * k + int(num_experts) * (int(pad_to) - 1)
        if num_rows < bound:
            raise ValueError(
                f"num_rows={num_rows} is below max_permuted_rows(T={T}, k={k}, E={num_experts}, pad_to={pad_to}) = "
                f"{bound}, the only row count that holds every routing without reading R on the host; pass "
                f"num_rows >= {bound}, or None for exactly R rows (one host sync)"
            )


def ids_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    if topk_ids.numel() == 0:
        return
    # Range check in the ids' own dtype, before any narrowing cast (2**40 must not wrap to 0).
    lo, hi = torch.aminmax(topk_ids)
    lo, hi = int(lo), int(hi)  # host sync: value validation (switch off with set_validation(False))
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise IndexError(
            f"topk_ids contains {bad}, outside [-1, num_experts={num_experts}); "
            "ids must be expert indices, or -1 for a slot that is not routed"
        )


def offsets_args(name: str, offsets, num_experts: int | None = None) -> None:
    int_tensor(name, offsets, 1)
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} has dtype {offsets.dtype}; use int32 or int64")
    if offsets.shape[0] < 2:
        raise ValueError(f"{name} has {offsets.shape[0]} entries; it needs E+1 >= 2 (segment starts and the end)")
    if num_experts is not None and offsets.shape[0] != num_experts + 1:
        raise ValueError(
            f"{name} has {offsets.shape[0]} entries but the weights hold {num_experts} experts; "
            f"expected {num_experts + 1} (E+1)"
        )


def offsets_values(name: str, offsets: torch.Tensor, num_rows: int, *, allow_tail: bool = False) -> None:
    """offsets start at 0, never decrease and end at ``num_rows`` (with ``allow_tail``: at or
    below it, for a buffer with zero rows past R such as permute(..., num_rows=N) returns)."""
    o = offsets.detach().long()
    first, last = int(o[0]), int(o[-1])  # host sync: value validation
    if first != 0:
        raise ValueError(f"{name}[0]={first}; segments start at row 0")
    diffs = o[1:] - o[:-1]
    if bool((diffs < 0).any()):
        e = int((diffs < 0).nonzero()[0, 0])
        raise ValueError(f"{name} is not monotone: {name}[{e}]={int(o[e])} > {name}[{e + 1}]={int(o[e + 1])}")
    if allow_tail and last > num_rows:
        raise ValueError(f"{name}[E]={last} but the input has only {num_rows} rows; it needs at least R = {last}")
    if not allow_tail and last != num_rows:
        raise ValueError(f"{name}[E]={last} but the input has {num_rows} rows; the last offset must equal R")


def gemm_args(x, expert_offsets, w, *, x_name="x", w_name="w") -> None:
    float_tensor(x_name, x, 2)
    float_tensor(w_name, w, 3)
    offsets_args("expert_offsets", expert_offsets, w.shape[0])
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{x_name} has {x.shape[1]} columns but {w_name} is {tuple(w.shape)} (K={w.shape[1]}); "
            f"the inner dimensions must match"
        )
    if x.dtype != w.dtype:
        raise TypeError(f"{x_name} is {x.dtype} but {w_name} is {w.dtype}; cast them to one dtype")
    same_device(**{x_name: x, "expert_offsets": expert_offsets, w_name: w})


def expert_weights_args(x, w1, w2, activation, num_experts: int, experts_from: str) -> None:
    """w1 [E, d, n1] and w2 [E, f, d] of E = num_experts experts for tokens x [*, d]."""
    choice("activation", activation, ACTIVATIONS)
    float_tensor("w1", w1, 3)
    float_tensor("w2", w2, 3)
    if w1.shape[0] != num_experts:
        raise ValueError(
            f"w1 holds {w1.shape[0]} experts but {experts_from}={num_experts}; pass the weights of all {num_experts}"
        )
    if w2.shape[0] != w1.shape[0]:
        raise ValueError(f"w1 holds {w1.shape[0]} experts but w2 holds {w2.shape[0]}; they must match")
    if x.shape[1] != w1.shape[1]:
        raise ValueError(
            f"x has d={x.shape[1]} columns but w1 is {tuple(w1.shape)} (K={w1.shape[1]}); "
            f"the inner dimensions must match (w1 must be [E, {x.shape[1]}, n1])"
        )
    f = w2.shape[1]
    glu = activation in GLU_ACTIVATIONS
    n1 = 2 * f if glu else f
    if w1.shape[2] != n1:
        raise ValueError(
            f"w1 is {tuple(w1.shape)} but w2 is {tuple(w2.shape)} (d_ffn={f}); with activation={activation!r} "
            f"w1 needs {n1} output columns" + (" (gate then up)" if glu else "")
        )
    if w2.shape[2] != x.shape[1]:
        raise ValueError(f"w2 is {tuple(w2.shape)} but x has d={x.shape[1]}; w2 must be [E, d_ffn, {x.shape[1]}]")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"x is {x.dtype} but {name} is {w.dtype}; cast them to one dtype")
    same_device(x=x, w1=w1, w2=w2)


def ffn_args(x, expert_offsets, w1, w2, activation) -> None:
    float_tensor("x", x, 2)
    float_tensor("w1", w1, 3)
    offsets_args("expert_offsets", expert_offsets, w1.shape[0])
    expert_weights_args(x, w1, w2, activation, expert_offsets.shape[0] - 1, "expert_offsets' E")
    same_device(x=x, expert_offsets=expert_offsets)


def bias(name: str, b, num_experts: int, cols: int, x: torch.Tensor, what: str) -> None:
    """An optional per-expert bias [E, cols] in x's dtype and device (None passes)."""
    if b is None:
        return
    float_tensor(name, b, 2)
    if tuple(b.shape) != (num_experts, cols):
        raise ValueError(
            f"{name} has shape {tuple(b.shape)}; expected [{num_experts}, {cols}] (one row of {what} per expert)"
        )
    if b.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but {name} is {b.dtype}; cast them to one dtype")
    same_device(x=x, **{name: b})


def ffn_biases(x, w1, w2, b1, b2) -> None:
    """b1 [E, n1] (the first projection's columns, gate then up for GLUs) and b2 [E, d]."""
    bias("b1", b1, w1.shape[0], w1.shape[2], x, "the first projection's outputs")
    bias("b2", b2, w2.shape[0], w2.shape[2], x, "d_model outputs")


def swiglu_options(activation: str, swiglu_limit, swiglu_alpha) -> None:
    """GPT-OSS clamped-SwiGLU options: finite reals, limit > 0; a non-default value with another
    activation is a mistake (it would be ignored)."""
    for name, v in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        if not is_real(v):
            raise TypeError(f"{name} must be a real number, got {type(v).__name__} {v!r}")
        if not finite(v):
            raise ValueError(f"{name}={v!r} must be finite")
    if not swiglu_limit > 0:
        raise ValueError(f"swiglu_limit={swiglu_limit!r} must be > 0 (the clamp bound of gate and up)")
    if activation != "swiglu_oai" and (swiglu_limit != SWIGLU_LIMIT or swiglu_alpha != SWIGLU_ALPHA):
        raise ValueError(
            f"swiglu_limit={swiglu_limit!r} / swiglu_alpha={swiglu_alpha!r} only apply to activation='swiglu_oai', "
            f"not {activation!r}; drop them or use activation='swiglu_oai'"
        )


def counts_values(routing) -> None:
    """routing.counts equals the number of slots routed to each expert (the fused path builds its
    segments from the counts); a value check (host sync)."""
    E = routing.num_experts
    ids = routing.topk_ids.reshape(-1).long()
    ids = torch.where((ids >= 0) & (ids < E), ids, torch.full_like(ids, E))  # unrouted: bin E
    expected = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    expected.scatter_add_(0, ids, torch.ones_like(ids))
    bad = expected[:E] != routing.counts.long()
    if bool(bad.any()):  # host sync: value validation (switch off with set_validation(False))
        e = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"routing.counts[{e}]={int(routing.counts[e])} but {int(expected[e])} slots of routing.topk_ids go to "
            f"expert {e}; counts must match the ids (recompute them after editing topk_ids)"
        )


# ---------------------------------------------------------------------------------------------
# PermuteInfo (users build and slice it: micro-batching, expert parallelism)
# ---------------------------------------------------------------------------------------------


def permute_info_args(info, name: str = "info") -> None:
    """Types, dtypes, shapes and devices of a :class:`PermuteInfo` (always checked, no sync):
    ``expert_offsets`` int32/int64 [E+1], ``counts`` integer [E], ``slot_rows`` int32/int64
    [num_tokens, k], ``pad_to`` a positive int, all on one device."""
    if not isinstance(info, PermuteInfo):
        raise TypeError(f"{name} must be the tritonmoe.PermuteInfo from permute(), got {type(info).__name__}")
    int_tensor(f"{name}.counts", info.counts, 1)
    E = info.counts.shape[0]
    if E == 0:
        raise ValueError(f"{name}.counts is empty; a PermuteInfo describes at least one expert")
    offsets_args(f"{name}.expert_offsets", info.expert_offsets)
    if info.expert_offsets.shape[0] != E + 1:
        raise ValueError(
            f"{name}.expert_offsets has {info.expert_offsets.shape[0]} entries but {name}.counts has {E} "
            f"experts; expected {E + 1} (E+1 segment bounds)"
        )
    int_tensor(f"{name}.slot_rows", info.slot_rows, 2)
    if info.slot_rows.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{name}.slot_rows has dtype {info.slot_rows.dtype}; use int64 (or int32): rows of the permuted "
            "buffer, -1 for a slot that is not routed"
        )
    if not is_int(info.num_tokens):
        raise TypeError(f"{name}.num_tokens must be an int, got {type(info.num_tokens).__name__} {info.num_tokens!r}")
    if info.num_tokens != info.slot_rows.shape[0]:
        raise ValueError(
            f"{name}.num_tokens={info.num_tokens} but {name}.slot_rows has {info.slot_rows.shape[0]} rows "
            "(one per token); slice slot_rows and num_tokens together"
        )
    positive_int(f"{name}.pad_to", info.pad_to)
    same_device(
        **{f"{name}.slot_rows": info.slot_rows, f"{name}.expert_offsets": info.expert_offsets, f"{name}.counts": info.counts}
    )


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True of a 1-D mask, or its length when there is none (no sync)."""
    return torch.cat([mask, mask.new_ones(1)]).to(torch.int8).argmax()


def permute_info_values(info: PermuteInfo, num_rows: int, *, name: str = "info", allow_tail: bool = False) -> None:
    """Values of a :class:`PermuteInfo` against a permuted buffer of ``num_rows`` rows (one host
    sync; run while validation is enabled). Call :func:`permute_info_args` first.

    Checked, in this order (the first failure is reported):

    * ``expert_offsets`` start at 0, never decrease and end at R = ``num_rows`` (with
      ``allow_tail``: at or below it, for a buffer with zero rows past R);
    * ``counts`` are >= 0 and each segment is exactly ``counts[e]`` rounded up to ``pad_to``;
    * every ``slot_rows`` value lies in [-1, R) (``IndexError`` otherwise);
    * every routed row lies in the unpadded part ``[offsets[e], offsets[e] + counts[e])`` of a
      segment, no two slots share a row, and the slots pointing into expert e's segment number
      ``counts[e]``: the routed slots fill the unpadded rows one to one. Inside a segment any
      order of the slots is accepted (unpermute is correct for every such bijection).
    """
    o = info.expert_offsets.detach().long()
    c = info.counts.detach().long()
    rows = info.slot_rows.detach().reshape(-1).long()
    E, pad = c.shape[0], int(info.pad_to)
    R_buf = int(num_rows)
    seg_len = o[1:] - o[:-1]
    padded = (c.clamp_min(0) + pad - 1) // pad * pad
    R = o[-1].clamp(0, R_buf) if allow_tail else o.new_tensor(R_buf)
    in_range = (rows >= -1) & (rows < R)
    ok = (rows >= 0) & in_range
    r = torch.where(ok, rows, torch.zeros_like(rows))
    seg = torch.searchsorted(o[1:].contiguous(), r, right=True).clamp(0, E - 1)
    start = o[seg]
    outside = ok & ((r < start) | (r >= start + c[seg]))
    holders = torch.zeros(R_buf + 1, dtype=torch.int64, device=rows.device)
    holders.scatter_add_(0, torch.where(ok, r, torch.full_like(r, R_buf)), torch.ones_like(r))
    per_expert = torch.zeros(E + 1, dtype=torch.int64, device=rows.device)
    per_expert.scatter_add_(0, torch.where(ok, seg, torch.full_like(seg, E)), torch.ones_like(seg))
    end_bad = (o[-1] > R_buf) if allow_tail else (o[-1] != R_buf)
    firsts = torch.stack(
        [
            (o[0] != 0).long() - 1,  # 0: offsets[0] (0 when bad, -1 when fine)
            _first(seg_len < 0),  # 1: a decreasing step
            end_bad.long() - 1,  # 2: offsets[E]
            _first(c < 0),  # 3: a negative count
            _first(seg_len != padded),  # 4: a segment that is not its padded count
            _first(~in_range),  # 5: a row outside [-1, R)
            _first(outside),  # 6: a row in padding or in no segment
            _first(holders[:R_buf] > 1),  # 7: a row held by two slots
            _first(per_expert[:E] != c),  # 8: slots per expert != counts
        ]
    )
    f = firsts.tolist()  # host sync: value validation (switch off with set_validation(False))
    n_slots, K = rows.shape[0], max(info.slot_rows.shape[1], 1)
    O, C, SR = f"{name}.expert_offsets", f"{name}.counts", f"{name}.slot_rows"
    if f[0] == 0:
        raise ValueError(f"{O}[0]={int(o[0])}; segments start at row 0")
    if f[1] < E:
        e = f[1]
        raise ValueError(f"{O} is not monotone: {O}[{e}]={int(o[e])} > {O}[{e + 1}]={int(o[e + 1])}")
    if f[2] == 0:
        if allow_tail:
            raise ValueError(f"{O}[E]={int(o[-1])} but the buffer has only {R_buf} rows; it needs at least R = {int(o[-1])}")
        raise ValueError(f"{O}[E]={int(o[-1])} but the buffer has {R_buf} rows; the last offset must equal R")
    if f[3] < E:
        raise ValueError(f"{C}[{f[3]}]={int(c[f[3]])} is negative; counts are rows per expert")
    if f[4] < E:
        e = f[4]
        raise ValueError(
            f"{O} gives expert {e} {int(seg_len[e])} rows but {C}[{e}]={int(c[e])} rounded up to pad_to={pad} is "
            f"{int(padded[e])}; offsets must be the exclusive cumsum of the padded counts (rebuild the "
            "PermuteInfo with permute(), or recompute offsets after slicing counts)"
        )
    if f[5] < n_slots:
        s = f[5]
        raise IndexError(
            f"{SR}[{s // K}, {s % K}]={int(rows[s])} is outside [-1, R={int(R)}); slot rows are rows of the "
            "permuted buffer, or -1 for a slot that is not routed"
        )
    if f[6] < n_slots:
        s = f[6]
        e = int(seg[s])
        raise ValueError(
            f"{SR}[{s // K}, {s % K}]={int(rows[s])} is not a data row of any expert: expert {e}'s rows are "
            f"[{int(o[e])}, {int(o[e]) + int(c[e])}) followed by padding up to {int(o[e + 1])}; "
            "point each routed slot at an unpadded row of its expert's segment"
        )
    if f[7] < R_buf:
        row = f[7]
        slots = (rows == row).nonzero().flatten().tolist()[:4]
        where = ", ".join(f"[{s // K}, {s % K}]" for s in slots)
        raise ValueError(
            f"row {row} of the permuted buffer is held by several slots ({SR}{where}); each routed slot "
            "needs its own row"
        )
    if f[8] < E:
        e = f[8]
        raise ValueError(
            f"{C}[{e}]={int(c[e])} but {int(per_expert[e])} slots point into expert {e}'s rows; counts must "
            f"equal the routed slots of each expert (every unpadded row held by one slot)"
        )
