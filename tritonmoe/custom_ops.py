"""tritonmoe's ops as ``torch.library`` custom ops, for ``torch.compile`` and ``torch.export``:
``torch.ops.tritonmoe.route``, ``moe_ffn``, ``moe_ffn_train``, ``permute_metadata``, ``permute``
(static ``num_rows``), ``unpermute``, ``grouped_gemm``, ``grouped_ffn``, ``grouped_ffn_train``.

Each op is one opaque node of a traced graph: a fake implementation gives its output shapes and
dtypes (no data-dependent size: the routing's outputs are [T, k] and [E], the FFN's [T, d]), and
its implementation asks :func:`tritonmoe.backends.implementation` at run time for the Triton
kernel or the reference, so the graph is the same for both backends. The local
:class:`~tritonmoe.MoELayer` calls these ops while ``torch.compile`` traces it
(``torch.compiler.is_compiling()``), in the variant eager runs (``config.ffn_path``: ``moe_ffn``,
or ``permute`` + ``grouped_ffn`` + ``unpermute``): a compiled layer has no graph break, forward
or backward, and dynamic batch sizes trace symbolically (``MoEConfig.capacity`` of a SymInt). In
eager mode the layer calls the implementations directly, as before.

Backward, two forms of the expert FFN:

* Recomputing (``moe_ffn``, ``grouped_ffn`` and the other ops): the gradient is a second custom op
  (``*_backward``) that recomputes the forward with autograd and differentiates it; only inputs
  are saved, the cost is the forward again in backward (both GEMMs).
* Training (``moe_ffn_train``, ``grouped_ffn_train``): the forward also returns the activations
  backward needs (A [rows, F], H [rows, n1]; non-differentiable outputs), which the autograd
  registration saves, and the backward op runs the implementation's explicit backward on them
  (the kernels' ``ffn_backward`` / ``moe_backward``, shared with the eager autograd.Functions):
  no GEMM rerun, the eager memory.

The compiled layer uses the training forms when grad is enabled and :func:`preact_mode` is "save"
(the default), the recomputing ones for inference and under ``TRITONMOE_FFN_PREACT=recompute``.
Custom ops cannot carry the deferred weight gradients of :mod:`tritonmoe.core.exact`, so the
expert-parallel paths (not traceable anyway: collectives with host-side splits) keep calling the
implementations directly, and the layer runs them eagerly inside a compiled model
(``torch.compiler.disable``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from tritonmoe.core.autograd import NotTwiceDifferentiableError, not_twice_differentiable_message
from tritonmoe import backends as dispatch
from tritonmoe.core.types import PermuteInfo, Routing
from tritonmoe.core.settings import resolve_backend

__all__ = ["route", "moe_ffn", "moe_ffn_train", "permute", "unpermute", "grouped_ffn", "grouped_ffn_train", "preact_mode"]

_LIB = "tritonmoe"


@contextlib.contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Let autograd record inside a custom op's implementation (which runs below the autograd
    dispatch keys: the op's own formula has already been applied): the key-set guard PyTorch's
    higher-order ops use to run a differentiable body inside an opaque op."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.ADInplaceOrView
    )
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - keys
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _empty(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return t.new_empty(0, dtype=dtype)


def _not_twice(op: str):
    message = not_twice_differentiable_message(
        f"tritonmoe::{op} (the torch.ops.tritonmoe custom ops of torch.compile)",
        "run the double backward eagerly (not compiled) with backend='torch', whose backward is twice "
        "differentiable, or use torch.func on that backend")

    def backward(ctx, *grads):
        raise NotTwiceDifferentiableError(message)

    return backward


def _setup_nothing(ctx, inputs, output) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------


def _route_impl(logits, expert_bias, top_k, score_func, renormalize, n_groups, topk_groups, capacity, with_aux,
                group_score, routed_scaling_factor, backend, drop_policy="slot") -> Routing:
    impl = dispatch.implementation("route", backend, logits.device, logits.dtype)
    kw = {} if drop_policy == "slot" else {"drop_policy": drop_policy}
    return impl(logits, top_k, score_func=score_func, renormalize=renormalize, expert_bias=expert_bias,
                n_groups=n_groups, topk_groups=topk_groups, capacity=capacity, with_aux=with_aux,
                group_score=group_score, routed_scaling_factor=routed_scaling_factor, **kw)


# Outputs: weights, ids, counts, selected_counts, score_sum, logsumexp (the float output first:
# torch.library.opcheck's autograd check sums the outputs in order).
@torch.library.custom_op(f"{_LIB}::route", mutates_args=())
def _route_op(
    logits: Tensor, expert_bias: Optional[Tensor], top_k: int, score_func: str, renormalize: bool,
    n_groups: Optional[int], topk_groups: Optional[int], capacity: Optional[int], with_aux: bool, group_score: str,
    routed_scaling_factor: float, backend: str, drop_policy: str = "slot",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r = _route_impl(logits.detach(), expert_bias, top_k, score_func, renormalize, n_groups, topk_groups, capacity,
                    with_aux, group_score, routed_scaling_factor, backend, drop_policy)
    acc = r.topk_weights.dtype
    # outputs may not alias each other: without capacity selected_counts is counts
    selected = r.selected_counts if r.selected_counts is not r.counts else r.counts.clone()
    outs = (r.topk_weights.detach(), r.topk_ids, r.counts, selected,
            r.score_sum.detach() if r.score_sum is not None else _empty(logits, acc),
            r.logsumexp.detach() if r.logsumexp is not None else _empty(logits, acc))
    return tuple(t.contiguous() for t in outs)  # the layouts the fake implementation promises


def _weights_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@_route_op.register_fake
def _(logits, expert_bias, top_k, score_func, renormalize, n_groups, topk_groups, capacity, with_aux, group_score,
      routed_scaling_factor, backend, drop_policy="slot"):
    T, E = logits.shape
    acc = _weights_dtype(logits)
    i32 = torch.int32
    return (logits.new_empty(T, top_k, dtype=acc), logits.new_empty(T, top_k, dtype=i32),
            logits.new_empty(E, dtype=i32), logits.new_empty(E, dtype=i32),
            logits.new_empty(E if with_aux else 0, dtype=acc), logits.new_empty(T if with_aux else 0, dtype=acc))


def _route_setup(ctx, inputs, output) -> None:
    logits, expert_bias, *statics = inputs
    ctx.statics = tuple(statics)
    ctx.save_for_backward(logits, expert_bias)


def _route_backward(ctx, d_w, _d_ids, _d_counts, _d_sel, d_ss, d_lse):
    logits, expert_bias = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 13
    z = lambda g, n: g if g is not None else logits.new_zeros(n, dtype=_weights_dtype(logits))  # noqa: E731
    T, E = logits.shape
    top_k, with_aux = ctx.statics[0], ctx.statics[6]
    d_logits = torch.ops.tritonmoe.route_backward(
        logits, expert_bias, z(d_w, (T, top_k)), z(d_ss, (E if with_aux else 0,)), z(d_lse, (T if with_aux else 0,)),
        *ctx.statics,
    )
    return (d_logits,) + (None,) * 12


_route_op.register_autograd(_route_backward, setup_context=_route_setup)


@torch.library.custom_op(f"{_LIB}::route_backward", mutates_args=())
def _route_backward_op(
    logits: Tensor, expert_bias: Optional[Tensor], d_weights: Tensor, d_score_sum: Tensor, d_logsumexp: Tensor,
    top_k: int, score_func: str, renormalize: bool, n_groups: Optional[int], topk_groups: Optional[int],
    capacity: Optional[int], with_aux: bool, group_score: str, routed_scaling_factor: float, backend: str,
    drop_policy: str = "slot",
) -> Tensor:
    with _autograd_inside_op():
        leaf = logits.detach().requires_grad_()
        r = _route_impl(leaf, expert_bias, top_k, score_func, renormalize, n_groups, topk_groups, capacity, with_aux,
                        group_score, routed_scaling_factor, backend, drop_policy)
        outs, grads = [r.topk_weights], [d_weights]
        if with_aux:
            outs += [r.score_sum, r.logsumexp]
            grads += [d_score_sum, d_logsumexp]
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and o.requires_grad]
        if not pairs:
            return torch.zeros_like(logits)
        (g,) = torch.autograd.grad([o for o, _ in pairs], [leaf], [g for _, g in pairs], allow_unused=True)
    return g if g is not None else torch.zeros_like(logits)


@_route_backward_op.register_fake
def _(logits, *args):
    return torch.empty_like(logits)


_route_backward_op.register_autograd(_not_twice("route_backward"), setup_context=_setup_nothing)


def route(logits: Tensor, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
          expert_bias: Optional[Tensor] = None, n_groups: Optional[int] = None, topk_groups: Optional[int] = None,
          capacity: Optional[int] = None, with_aux: bool = False, group_score: str = "top2sum",
          routed_scaling_factor: float = 1.0, backend: Optional[str] = None, drop_policy: str = "slot") -> Routing:
    """``tritonmoe::route`` as a :class:`Routing` (arguments validated by the caller)."""

    w, ids, counts, selected, score_sum, lse = torch.ops.tritonmoe.route(
        logits, expert_bias, top_k, score_func, renormalize, n_groups, topk_groups, capacity, with_aux, group_score,
        float(routed_scaling_factor), resolve_backend(backend), drop_policy,
    )
    return Routing(topk_ids=ids, topk_weights=w, counts=counts, selected_counts=selected, score_func=score_func,
                   score_sum=score_sum if with_aux else None, logsumexp=lse if with_aux else None)


# ---------------------------------------------------------------------------------------------
# moe_ffn
# ---------------------------------------------------------------------------------------------


def _moe_ffn_impl(x, ids, weights, counts, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    routing = Routing(topk_ids=ids, topk_weights=weights, counts=counts, selected_counts=counts)
    impl = dispatch.implementation("moe_ffn", backend, x.device, x.dtype)
    kw = {"swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha} if activation == "swiglu_oai" else {}
    return impl(x, routing, w1, w2, activation, b1, b2, **kw)


@torch.library.custom_op(f"{_LIB}::moe_ffn", mutates_args=())
def _moe_ffn_op(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
    b2: Optional[Tensor], activation: str, swiglu_limit: float, swiglu_alpha: float, backend: str,
) -> Tensor:
    with torch.no_grad():
        return _moe_ffn_impl(x, topk_ids, topk_weights, counts, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha,
                             backend)


@_moe_ffn_op.register_fake
def _(x, topk_ids, topk_weights, counts, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    return torch.empty_like(x)


def _moe_ffn_setup(ctx, inputs, output) -> None:
    x, ids, w, counts, w1, w2, b1, b2, *statics = inputs
    ctx.statics = tuple(statics)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.save_for_backward(x, ids, w, counts, w1, w2, b1, b2)


def _moe_ffn_backward(ctx, d_out):
    x, ids, w, counts, w1, w2, b1, b2 = ctx.saved_tensors
    dx, dw, dw1, dw2, db1, db2 = torch.ops.tritonmoe.moe_ffn_backward(d_out, x, ids, w, counts, w1, w2, b1, b2,
                                                                     *ctx.statics)
    return (dx, None, dw, None, dw1, dw2, db1 if ctx.has_bias[0] else None, db2 if ctx.has_bias[1] else None,
            None, None, None, None)


_moe_ffn_op.register_autograd(_moe_ffn_backward, setup_context=_moe_ffn_setup)


@torch.library.custom_op(f"{_LIB}::moe_ffn_backward", mutates_args=())
def _moe_ffn_backward_op(
    d_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, counts: Tensor, w1: Tensor, w2: Tensor,
    b1: Optional[Tensor], b2: Optional[Tensor], activation: str, swiglu_limit: float, swiglu_alpha: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in (x, topk_weights, w1, w2)]
        bl = [b.detach().requires_grad_() if b is not None else None for b in (b1, b2)]
        out = _moe_ffn_impl(leaves[0], topk_ids, leaves[1], counts, leaves[2], leaves[3], bl[0], bl[1], activation,
                            swiglu_limit, swiglu_alpha, backend)
        wrt = leaves + [b for b in bl if b is not None]
        grads = torch.autograd.grad(out, wrt, d_out, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt)]
    dx, dw, dw1, dw2, *rest = grads
    db1 = rest.pop(0) if b1 is not None else _empty(x)
    db2 = rest.pop(0) if b2 is not None else _empty(x)
    return dx, dw, dw1, dw2, db1, db2


@_moe_ffn_backward_op.register_fake
def _(d_out, x, topk_ids, topk_weights, counts, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(b1) if b1 is not None else _empty(x), torch.empty_like(b2) if b2 is not None else _empty(x))


_moe_ffn_backward_op.register_autograd(_not_twice("moe_ffn_backward"), setup_context=_setup_nothing)


def moe_ffn(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str = "swiglu",
            b1: Optional[Tensor] = None, b2: Optional[Tensor] = None, *, swiglu_limit: float = 7.0,
            swiglu_alpha: float = 1.702, backend: Optional[str] = None) -> Tensor:
    """``tritonmoe::moe_ffn`` (arguments validated by the caller)."""

    return torch.ops.tritonmoe.moe_ffn(x, routing.topk_ids, routing.topk_weights, routing.counts, w1, w2, b1, b2,
                                       activation, float(swiglu_limit), float(swiglu_alpha), resolve_backend(backend))


# ---------------------------------------------------------------------------------------------
# permute_metadata, permute, unpermute, grouped_gemm, grouped_ffn
# ---------------------------------------------------------------------------------------------
#
# The same pattern: a forward op that runs the dispatched implementation, a fake with static
# shapes (permute needs num_rows: its row count is otherwise data-dependent), and a backward op
# that recomputes the forward under autograd (:func:`_recompute_grads`).


def _recompute_grads(fn, args: list, diff: tuple[int, ...], d_outs: list) -> list[Tensor]:
    """Gradients of ``fn(*args)`` w.r.t. ``args[i]`` for i in ``diff`` (zeros where an input
    gets none; empty tensors for absent optional inputs), given the outputs' gradients."""
    with _autograd_inside_op():
        leaves = list(args)
        for i in diff:
            if leaves[i] is not None:
                leaves[i] = leaves[i].detach().requires_grad_()
        outs = fn(*leaves)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, d_outs) if g is not None and isinstance(o, Tensor) and o.requires_grad]
        wrt = [leaves[i] for i in diff if leaves[i] is not None]
        got = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)) \
            if pairs and wrt else [None] * len(wrt)
    out = []
    for i in diff:
        if args[i] is None:
            out.append(d_outs[0].new_empty(0))
        else:
            g = got.pop(0)
            out.append(g if g is not None else torch.zeros_like(args[i]))
    return out


def _impl(op: str, backend: str, t: Tensor):
    return dispatch.implementation(op, backend, t.device, t.dtype)


@torch.library.custom_op(f"{_LIB}::permute_metadata", mutates_args=())
def _permute_metadata_op(topk_ids: Tensor, num_experts: int, pad_to: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    info = dispatch.implementation("permute_metadata", backend, topk_ids.device)(topk_ids, num_experts, pad_to)
    return info.expert_offsets.contiguous(), info.slot_rows.contiguous(), info.counts.contiguous()


@_permute_metadata_op.register_fake
def _(topk_ids, num_experts, pad_to, backend):
    T, K = topk_ids.shape
    return (topk_ids.new_empty(num_experts + 1, dtype=torch.int64), topk_ids.new_empty(T, K, dtype=torch.int64),
            topk_ids.new_empty(num_experts, dtype=torch.int32))


def _permute_fn(backend):
    def fn(x, ids, num_experts, pad_to, num_rows):
        x_perm, info = _impl("permute", backend, x)(x, ids, num_experts, pad_to=pad_to, num_rows=num_rows)
        return x_perm, info.expert_offsets, info.slot_rows, info.counts

    return fn


@torch.library.custom_op(f"{_LIB}::permute", mutates_args=())
def _permute_op(x: Tensor, topk_ids: Tensor, num_experts: int, pad_to: int, num_rows: int,
                backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with torch.no_grad():
        return tuple(t.contiguous() for t in _permute_fn(backend)(x, topk_ids, num_experts, pad_to, num_rows))


@_permute_op.register_fake
def _(x, topk_ids, num_experts, pad_to, num_rows, backend):
    T, K = topk_ids.shape
    return (x.new_empty(num_rows, x.shape[1]), topk_ids.new_empty(num_experts + 1, dtype=torch.int64),
            topk_ids.new_empty(T, K, dtype=torch.int64), topk_ids.new_empty(num_experts, dtype=torch.int32))


def _save_inputs(ctx, inputs, output) -> None:
    ctx.inputs = inputs  # ints and strings as they are; tensors through save_for_backward
    ctx.tensor_idx = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
    ctx.save_for_backward(*[inputs[i] for i in ctx.tensor_idx])


def _restore_inputs(ctx) -> list:
    args = list(ctx.inputs)
    for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
        args[i] = t
    return args


def _permute_backward(ctx, d_x_perm, *_):
    args = _restore_inputs(ctx)
    dx = torch.ops.tritonmoe.permute_backward(d_x_perm, *args)
    return (dx,) + (None,) * 5


_permute_op.register_autograd(_permute_backward, setup_context=_save_inputs)


@torch.library.custom_op(f"{_LIB}::permute_backward", mutates_args=())
def _permute_backward_op(d_x_perm: Tensor, x: Tensor, topk_ids: Tensor, num_experts: int, pad_to: int, num_rows: int,
                         backend: str) -> Tensor:
    fn = _permute_fn(backend)
    (dx,) = _recompute_grads(fn, [x, topk_ids, num_experts, pad_to, num_rows], (0,), [d_x_perm])
    return dx


@_permute_backward_op.register_fake
def _(d_x_perm, x, *args):
    return torch.empty_like(x)


_permute_backward_op.register_autograd(_not_twice("permute_backward"), setup_context=_setup_nothing)


def _unpermute_fn(backend):
    def fn(y_perm, offsets, slot_rows, counts, weights, num_tokens, pad_to):
        info = PermuteInfo(expert_offsets=offsets, slot_rows=slot_rows, counts=counts, num_tokens=num_tokens,
                           pad_to=pad_to)
        return _impl("unpermute", backend, y_perm)(y_perm, info, weights)

    return fn


@torch.library.custom_op(f"{_LIB}::unpermute", mutates_args=())
def _unpermute_op(y_perm: Tensor, expert_offsets: Tensor, slot_rows: Tensor, counts: Tensor, topk_weights: Tensor,
                  num_tokens: int, pad_to: int, backend: str) -> Tensor:
    with torch.no_grad():
        return _unpermute_fn(backend)(y_perm, expert_offsets, slot_rows, counts, topk_weights, num_tokens, pad_to)


@_unpermute_op.register_fake
def _(y_perm, expert_offsets, slot_rows, counts, topk_weights, num_tokens, pad_to, backend):
    return y_perm.new_empty(slot_rows.shape[0], y_perm.shape[1])


def _unpermute_backward(ctx, d_out):
    args = _restore_inputs(ctx)
    dy, dw = torch.ops.tritonmoe.unpermute_backward(d_out, *args)
    return (dy, None, None, None, dw, None, None, None)


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_save_inputs)


@torch.library.custom_op(f"{_LIB}::unpermute_backward", mutates_args=())
def _unpermute_backward_op(d_out: Tensor, y_perm: Tensor, expert_offsets: Tensor, slot_rows: Tensor, counts: Tensor,
                           topk_weights: Tensor, num_tokens: int, pad_to: int, backend: str) -> tuple[Tensor, Tensor]:
    args = [y_perm, expert_offsets, slot_rows, counts, topk_weights, num_tokens, pad_to]
    return tuple(_recompute_grads(_unpermute_fn(backend), args, (0, 4), [d_out]))


@_unpermute_backward_op.register_fake
def _(d_out, y_perm, expert_offsets, slot_rows, counts, topk_weights, *args):
    return torch.empty_like(y_perm), torch.empty_like(topk_weights)


_unpermute_backward_op.register_autograd(_not_twice("unpermute_backward"), setup_context=_setup_nothing)


def _gemm_fn(backend):
    def fn(x, offsets, w, bias):
        return _impl("grouped_gemm", backend, x)(x, offsets, w, bias)

    return fn


@torch.library.custom_op(f"{_LIB}::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x: Tensor, expert_offsets: Tensor, w: Tensor, bias: Optional[Tensor], backend: str) -> Tensor:
    with torch.no_grad():
        return _gemm_fn(backend)(x, expert_offsets, w, bias)


@_grouped_gemm_op.register_fake
def _(x, expert_offsets, w, bias, backend):
    return x.new_empty(x.shape[0], w.shape[2])


def _grouped_gemm_backward(ctx, d_y):
    args = _restore_inputs(ctx)
    dx, dw, db = torch.ops.tritonmoe.grouped_gemm_backward(d_y, *args)
    return (dx, None, dw, db if args[3] is not None else None, None)


_grouped_gemm_op.register_autograd(_grouped_gemm_backward, setup_context=_save_inputs)


@torch.library.custom_op(f"{_LIB}::grouped_gemm_backward", mutates_args=())
def _grouped_gemm_backward_op(d_y: Tensor, x: Tensor, expert_offsets: Tensor, w: Tensor, bias: Optional[Tensor],
                              backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_recompute_grads(_gemm_fn(backend), [x, expert_offsets, w, bias], (0, 2, 3), [d_y]))


@_grouped_gemm_backward_op.register_fake
def _(d_y, x, expert_offsets, w, bias, backend):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(bias) if bias is not None else x.new_empty(0)


_grouped_gemm_backward_op.register_autograd(_not_twice("grouped_gemm_backward"), setup_context=_setup_nothing)


def _ffn_fn(backend, activation, swiglu_limit, swiglu_alpha):
    kw = {"swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha} if activation == "swiglu_oai" else {}

    def fn(x, offsets, w1, w2, b1, b2):
        return _impl("grouped_ffn", backend, x)(x, offsets, w1, w2, activation, b1, b2, **kw)

    return fn


@torch.library.custom_op(f"{_LIB}::grouped_ffn", mutates_args=())
def _grouped_ffn_op(x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                    b2: Optional[Tensor], activation: str, swiglu_limit: float, swiglu_alpha: float,
                    backend: str) -> Tensor:
    with torch.no_grad():
        return _ffn_fn(backend, activation, swiglu_limit, swiglu_alpha)(x, expert_offsets, w1, w2, b1, b2)


@_grouped_ffn_op.register_fake
def _(x, expert_offsets, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    return x.new_empty(x.shape[0], w2.shape[2])


def _grouped_ffn_backward(ctx, d_y):
    args = _restore_inputs(ctx)
    dx, dw1, dw2, db1, db2 = torch.ops.tritonmoe.grouped_ffn_backward(d_y, *args)
    return (dx, None, dw1, dw2, db1 if args[4] is not None else None, db2 if args[5] is not None else None,
            None, None, None, None)


_grouped_ffn_op.register_autograd(_grouped_ffn_backward, setup_context=_save_inputs)


@torch.library.custom_op(f"{_LIB}::grouped_ffn_backward", mutates_args=())
def _grouped_ffn_backward_op(d_y: Tensor, x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor,
                             b1: Optional[Tensor], b2: Optional[Tensor], activation: str, swiglu_limit: float,
                             swiglu_alpha: float, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    fn = _ffn_fn(backend, activation, swiglu_limit, swiglu_alpha)
    return tuple(_recompute_grads(fn, [x, expert_offsets, w1, w2, b1, b2], (0, 2, 3, 4, 5), [d_y]))


@_grouped_ffn_backward_op.register_fake
def _(d_y, x, expert_offsets, w1, w2, b1, b2, *args):
    e = x.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(b1) if b1 is not None else e, torch.empty_like(b2) if b2 is not None else e)


_grouped_ffn_backward_op.register_autograd(_not_twice("grouped_ffn_backward"), setup_context=_setup_nothing)


# ---------------------------------------------------------------------------------------------
# Python entry points of the row movers and the grouped FFN (the layer's unfused path while
# torch.compile traces it; arguments validated by the caller)
# ---------------------------------------------------------------------------------------------


def permute(x: Tensor, topk_ids: Tensor, num_experts: int, *, num_rows: int, pad_to: int = 1,
            backend: Optional[str] = None) -> tuple[Tensor, PermuteInfo]:
    """``tritonmoe::permute`` as ``(x_perm [num_rows, d], PermuteInfo)``; ``num_rows`` (at least
    :func:`tritonmoe.max_permuted_rows`) keeps the shape static."""

    x_perm, offsets, slot_rows, counts = torch.ops.tritonmoe.permute(x, topk_ids, num_experts, pad_to, num_rows,
                                                                     resolve_backend(backend))
    info = PermuteInfo(expert_offsets=offsets, slot_rows=slot_rows, counts=counts, num_tokens=topk_ids.shape[0],
                       pad_to=pad_to)
    return x_perm, info


def unpermute(y_perm: Tensor, info: PermuteInfo, topk_weights: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """``tritonmoe::unpermute``."""

    return torch.ops.tritonmoe.unpermute(y_perm, info.expert_offsets, info.slot_rows, info.counts, topk_weights,
                                         info.slot_rows.shape[0], info.pad_to, resolve_backend(backend))


def grouped_ffn(x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                b1: Optional[Tensor] = None, b2: Optional[Tensor] = None, *, swiglu_limit: float = 7.0,
                swiglu_alpha: float = 1.702, backend: Optional[str] = None) -> Tensor:
    """``tritonmoe::grouped_ffn``."""

    return torch.ops.tritonmoe.grouped_ffn(x, expert_offsets, w1, w2, b1, b2, activation, float(swiglu_limit),
                                           float(swiglu_alpha), resolve_backend(backend))


# ---------------------------------------------------------------------------------------------
# Training forms: moe_ffn_train, grouped_ffn_train
# ---------------------------------------------------------------------------------------------
#
# moe_ffn / grouped_ffn above save only their inputs and their backward ops rerun the forward
# under autograd: the smallest memory, at the price of the first GEMM (and the second) again in
# every backward. The training forms return the activations the backward needs as extra outputs
# (A [rows, F] and the pre-activation H [rows, N1], marked non-differentiable), which the autograd
# registration saves; their backward ops take them and run the implementation's explicit
# backward (the Triton kernels' ffn_backward / moe_backward, the same functions the eager
# autograd.Functions call, so a compiled step's gradients are the eager ones bit for bit; or
# the reference's per-expert GEMMs, equal to its autograd to rounding): no GEMM is rerun.
# Which form the compiled layer uses follows the kernels' pre-activation mode
# (:func:`preact_mode`): "save" (the default) -> the training forms, as eager saves H;
# "recompute" (``TRITONMOE_FFN_PREACT=recompute``) -> the recomputing forms, for memory.


def preact_mode() -> str:
    """The FFN backward's pre-activation mode: ``tritonmoe.kernels._gemm_config.ffn_preact_mode``
    (the ``TRITONMOE_FFN_PREACT`` variable or its ``preact_mode`` context), read from the
    environment alone where triton does not import."""
    try:
        from tritonmoe.kernels._gemm_config import ffn_preact_mode
    except ImportError:
        import os

        v = os.environ.get("TRITONMOE_FFN_PREACT", "save").strip().lower()
        return v if v in ("save", "recompute") else "save"
    return ffn_preact_mode()


def _n1_f(w1: Tensor, w2: Tensor) -> tuple[int, int]:
    return w1.shape[2], w2.shape[1]


def _opt(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else _empty(like)


def _kw(activation: str, swiglu_limit: float, swiglu_alpha: float) -> dict:
    return {"swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha} if activation == "swiglu_oai" else {}


@torch.library.custom_op(f"{_LIB}::moe_ffn_train", mutates_args=())
def _moe_ffn_train_op(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
    b2: Optional[Tensor], activation: str, swiglu_limit: float, swiglu_alpha: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    routing = Routing(topk_ids=topk_ids, topk_weights=topk_weights, counts=counts, selected_counts=counts)
    with torch.no_grad():
        out, a, h = _impl("moe_ffn_train", backend, x)(x, routing, w1, w2, activation, b1, b2,
                                                       **_kw(activation, swiglu_limit, swiglu_alpha))
    return out.contiguous(), a.contiguous(), h.contiguous()


@_moe_ffn_train_op.register_fake
def _(x, topk_ids, topk_weights, counts, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    rows = topk_ids.shape[0] * topk_ids.shape[1]
    n1, f = _n1_f(w1, w2)
    return torch.empty_like(x), x.new_empty(rows, f), x.new_empty(rows, n1)


def _moe_ffn_train_setup(ctx, inputs, output) -> None:
    x, ids, w, counts, w1, w2, b1, b2, *statics = inputs
    _, a, h = output
    ctx.mark_non_differentiable(a, h)
    ctx.statics = tuple(statics)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.save_for_backward(x, ids, w, counts, w1, w2, b1, b2, a, h)


def _moe_ffn_train_backward(ctx, d_out, _d_a, _d_h):
    x, ids, w, counts, w1, w2, b1, b2, a, h = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[i]) for i in (0, 2, 4, 5, 6, 7)]
    dx, dw, dw1, dw2, db1, db2 = torch.ops.tritonmoe.moe_ffn_train_backward(
        d_out, x, ids, w, counts, w1, w2, b1, b2, a, h, needs, *ctx.statics
    )
    keep = lambda g, i: g if needs[i] else None  # noqa: E731
    return (keep(dx, 0), None, keep(dw, 1), None, keep(dw1, 2), keep(dw2, 3),
            keep(db1, 4) if ctx.has_bias[0] else None, keep(db2, 5) if ctx.has_bias[1] else None,
            None, None, None, None)


_moe_ffn_train_op.register_autograd(_moe_ffn_train_backward, setup_context=_moe_ffn_train_setup)


@torch.library.custom_op(f"{_LIB}::moe_ffn_train_backward", mutates_args=())
def _moe_ffn_train_backward_op(
    d_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, counts: Tensor, w1: Tensor, w2: Tensor,
    b1: Optional[Tensor], b2: Optional[Tensor], a: Tensor, h: Tensor, needs: list[bool], activation: str,
    swiglu_limit: float, swiglu_alpha: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    routing = Routing(topk_ids=topk_ids, topk_weights=topk_weights, counts=counts, selected_counts=counts)
    with _autograd_inside_op():  # the reference differentiates its elementwise activation
        grads = _impl("moe_ffn_train_backward", backend, x)(
            d_out, x, routing, w1, w2, b1, b2, a, h, activation, needs=tuple(needs),
            **_kw(activation, swiglu_limit, swiglu_alpha),
        )
    likes = (x, topk_weights, w1, w2, b1, b2)
    return tuple(g.detach().contiguous() if g is not None else _empty(x) for g, t in zip(grads, likes))


@_moe_ffn_train_backward_op.register_fake
def _(d_out, x, topk_ids, topk_weights, counts, w1, w2, b1, b2, a, h, needs, *args):
    likes = (x, topk_weights, w1, w2, b1, b2)
    return tuple(torch.empty_like(t) if (t is not None and n) else _empty(x) for t, n in zip(likes, needs))


_moe_ffn_train_backward_op.register_autograd(_not_twice("moe_ffn_train_backward"), setup_context=_setup_nothing)


@torch.library.custom_op(f"{_LIB}::grouped_ffn_train", mutates_args=())
def _grouped_ffn_train_op(x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                          b2: Optional[Tensor], activation: str, swiglu_limit: float, swiglu_alpha: float,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        y, a, h = _impl("grouped_ffn_train", backend, x)(x, expert_offsets, w1, w2, activation, b1, b2,
                                                         **_kw(activation, swiglu_limit, swiglu_alpha))
    return y.contiguous(), a.contiguous(), h.contiguous()


@_grouped_ffn_train_op.register_fake
def _(x, expert_offsets, w1, w2, b1, b2, activation, swiglu_limit, swiglu_alpha, backend):
    n1, f = _n1_f(w1, w2)
    R = x.shape[0]
    return x.new_empty(R, w2.shape[2]), x.new_empty(R, f), x.new_empty(R, n1)


def _grouped_ffn_train_setup(ctx, inputs, output) -> None:
    x, offsets, w1, w2, b1, b2, *statics = inputs
    _, a, h = output
    ctx.mark_non_differentiable(a, h)
    ctx.statics = tuple(statics)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.save_for_backward(x, offsets, w1, w2, b1, b2, a, h)


def _grouped_ffn_train_backward(ctx, d_y, _d_a, _d_h):
    x, offsets, w1, w2, b1, b2, a, h = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[i]) for i in (0, 2, 3, 4, 5)]
    dx, dw1, dw2, db1, db2 = torch.ops.tritonmoe.grouped_ffn_train_backward(d_y, x, offsets, w1, w2, b1, b2, a, h,
                                                                           needs, *ctx.statics)
    keep = lambda g, i: g if needs[i] else None  # noqa: E731
    return (keep(dx, 0), None, keep(dw1, 1), keep(dw2, 2), keep(db1, 3) if ctx.has_bias[0] else None,
            keep(db2, 4) if ctx.has_bias[1] else None, None, None, None, None)


_grouped_ffn_train_op.register_autograd(_grouped_ffn_train_backward, setup_context=_grouped_ffn_train_setup)


@torch.library.custom_op(f"{_LIB}::grouped_ffn_train_backward", mutates_args=())
def _grouped_ffn_train_backward_op(
    d_y: Tensor, x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor],
    a: Tensor, h: Tensor, needs: list[bool], activation: str, swiglu_limit: float, swiglu_alpha: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with _autograd_inside_op():  # the reference differentiates its elementwise activation
        grads = _impl("grouped_ffn_train_backward", backend, x)(
            d_y, x, expert_offsets, w1, w2, b1, b2, a, h, activation, needs=tuple(needs),
            **_kw(activation, swiglu_limit, swiglu_alpha),
        )
    return tuple(g.detach().contiguous() if g is not None else _empty(x) for g in grads)


@_grouped_ffn_train_backward_op.register_fake
def _(d_y, x, expert_offsets, w1, w2, b1, b2, a, h, needs, *args):
    likes = (x, w1, w2, b1, b2)
    return tuple(torch.empty_like(t) if (t is not None and n) else _empty(x) for t, n in zip(likes, needs))


_grouped_ffn_train_backward_op.register_autograd(_not_twice("grouped_ffn_train_backward"),
                                                 setup_context=_setup_nothing)


def moe_ffn_train(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                  b1: Optional[Tensor] = None, b2: Optional[Tensor] = None, *, swiglu_limit: float = 7.0,
                  swiglu_alpha: float = 1.702, backend: Optional[str] = None) -> Tensor:
    """``tritonmoe::moe_ffn_train``'s output (its saved activations stay with autograd)."""

    out, _, _ = torch.ops.tritonmoe.moe_ffn_train(x, routing.topk_ids, routing.topk_weights, routing.counts, w1, w2,
                                                  b1, b2, activation, float(swiglu_limit), float(swiglu_alpha),
                                                  resolve_backend(backend))
    return out


def grouped_ffn_train(x: Tensor, expert_offsets: Tensor, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                      b1: Optional[Tensor] = None, b2: Optional[Tensor] = None, *, swiglu_limit: float = 7.0,
                      swiglu_alpha: float = 1.702, backend: Optional[str] = None) -> Tensor:
    """``tritonmoe::grouped_ffn_train``'s output (its saved activations stay with autograd)."""

    y, _, _ = torch.ops.tritonmoe.grouped_ffn_train(x, expert_offsets, w1, w2, b1, b2, activation, float(swiglu_limit),
                                                    float(swiglu_alpha), resolve_backend(backend))
    return y
