"""Second-order autograd: which backward passes are themselves differentiable, and a clear
error, never a silent zero, where they are not.

A gradient penalty (``torch.autograd.grad(..., create_graph=True)`` then a second backward)
needs every op's backward to be recorded by autograd. The plain-PyTorch reference
(``backend="torch"``, every dtype) is: its backward is made of differentiable torch ops. The
Triton kernels' backward passes are kernels, and the schedulers' backward passes run
collectives: they are first-order only.

``torch.autograd.function.once_differentiable`` is not enough to say so. It attaches its error
only when an incoming gradient requires grad; in the common penalty ``g = grad(f(x).sum(), x,
create_graph=True)`` the incoming gradient is a constant, so ``g`` came back without a graph and
the penalty's gradient with respect to the weights was ``None``: silently zero. :func:`first_order`
also anchors the error on every saved input that requires grad, so the second backward raises
:class:`NotTwiceDifferentiableError` as soon as it reaches the op, and only then (a
``create_graph=True`` backward whose result is never differentiated again runs as usual).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["NotTwiceDifferentiableError", "first_order", "not_twice_differentiable_message"]

#: What a user whose model needs second-order gradients can do instead.
FIX = ("use backend='torch' (tritonmoe.use_backend('torch') or MoEConfig(backend='torch')), whose backward is "
       "twice differentiable in every dtype, or compute the penalty with torch.func on that backend")


class NotTwiceDifferentiableError(RuntimeError):
    """A second backward (double backward, a gradient penalty, a Hessian-vector product) reached
    an op whose backward is first-order only."""


def not_twice_differentiable_message(op: str, fix: str = FIX) -> str:
    return (f"tritonmoe: {op} is not twice differentiable (its backward is a Triton kernel or a scheduled "
            f"collective, which autograd does not record), so a gradient of its gradient would be silently "
            f"zero; {fix}")


class _SecondOrderGuard(torch.autograd.Function):
    """Returns the first ``n`` tensors unchanged; differentiating them raises. The remaining inputs
    are anchors: tensors the gradients depend on, so that the outputs require grad whenever one
    of them does."""

    @staticmethod
    def forward(ctx, message, n, *tensors):
        ctx.message = message
        ctx.num_anchors = len(tensors) - n
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise NotTwiceDifferentiableError(ctx.message)


def _tensors_requiring_grad(ctx, grads) -> list:
    found = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
    found += [t for t in ctx.saved_tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    # tensors kept as attributes of ctx (parameters a schedule refers to by identity)
    for v in getattr(ctx, "__dict__", {}).values():
        items = v if isinstance(v, (tuple, list)) else (v,)
        found += [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    return found


def guard_outputs(outputs, anchors: list, message: str):
    """``outputs`` (a backward's tuple, Nones allowed) with every tensor behind a
    :class:`_SecondOrderGuard` anchored on ``anchors``; unchanged when no anchor requires grad."""
    single = not isinstance(outputs, tuple)
    outs = (outputs,) if single else outputs
    idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if not anchors or not idx:
        return outputs
    with torch.enable_grad():
        guarded = _SecondOrderGuard.apply(message, len(idx), *[outs[i] for i in idx], *anchors)
    res = list(outs)
    for i, g in zip(idx, guarded):
        res[i] = g
    return res[0] if single else tuple(res)


def first_order(op: str, fix: str = FIX) -> Callable:
    """Decorator for the ``backward`` of a ``torch.autograd.Function`` whose backward autograd
    cannot record (a kernel, a collective). Outside ``create_graph`` it is the plain backward.
    Under ``create_graph=True`` the backward runs without recording, and its gradients come back
    requiring grad (when an incoming gradient or a saved input does) behind a node whose own
    backward raises :class:`NotTwiceDifferentiableError` naming ``op`` and ``fix``."""
    message = not_twice_differentiable_message(op, fix)

    def deco(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            anchors = _tensors_requiring_grad(ctx, grads)
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            return guard_outputs(outputs, anchors, message)

        wrapper.first_order_op = op
        return wrapper

    return deco
