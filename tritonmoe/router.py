"""The router: the gate module and the routing step a layer takes before its expert path.

* :class:`Router`: the gate, an ``nn.Linear`` whose fp64 forward is row-invariant.
* :func:`router_logits`: the gate's arithmetic on any weight (a schedule that routes a slice of
  the tokens with a gradient-reduced weight uses it).
* :class:`RouteStep`: one forward's routing, built by :class:`~tritonmoe.MoELayer` from its
  config, its gate and its expert bias, and handed to the expert path. A path whose schedule
  routes by itself (Parm's S1 routes each model-parallel rank's slice) routes through it, so no
  expert path ever receives the layer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from tritonmoe import custom_ops as ops, reference
from tritonmoe.backends import implementation
from tritonmoe.bias import nan_weights_if_nonfinite
from tritonmoe.core.exact import rowwise_mm
from tritonmoe.aux_loss import GlobalBalanceState, balance_losses
from tritonmoe.core.types import Routing

__all__ = ["Router", "RouteStep", "router_logits"]


def router_logits(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, router: nn.Module | None = None, *, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The router's logits ``x @ weight.T (+ bias)``: ``router(x)`` when the module is given (so
    its hooks run, e.g. FSDP's unshard), else the product itself, which in fp64 (the
    exact-reference dtype of the tests) is row-invariant (:func:`tritonmoe.core.exact.rowwise_mm`): a
    token's logits do not depend on how many other tokens share the call, so a schedule that
    routes a slice of the tokens (Parm's S1) makes the same routing decisions as one that routes
    them all. The same arithmetic as :class:`Router` (bias included)."""
    if router is not None:
        return router(x_TD)
    if x_TD.dtype == torch.float64:
        out = rowwise_mm(x_TD, weight_ED.t())
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x_TD, weight_ED, bias)


class Router(nn.Linear):
    """The gate: an ``nn.Linear`` (same parameters and state-dict keys) whose fp64 forward is the
    row-invariant product of :func:`router_logits`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            out = rowwise_mm(x, self.weight.t())
            return out if self.bias is None else out + self.bias
        return super().forward(x)


class RouteStep:
    """One forward's routing step (built per forward by the layer; cheap).

    ``config``: the layer's :class:`~tritonmoe.MoEConfig`; ``router``: its gate;
    ``expert_bias``: the aux-loss-free bias [E] or None; ``on_logits``: called with the logits
    of every routing (the layer keeps the last ones for :attr:`MoELayer.last_router_logits`);
    ``padding_mask``, ``sequence_length``, ``global_balance``, ``aux_loss_group``: what the
    balance losses of ``config.aux_loss_type`` read (:mod:`tritonmoe.aux_loss`)."""

    def __init__(self, config: Any, router: Router, expert_bias: Optional[torch.Tensor],
                 on_logits: Optional[Callable[[torch.Tensor], None]] = None, *,
                 padding_mask: Optional[torch.Tensor] = None, sequence_length: Optional[int] = None,
                 global_balance: Optional[GlobalBalanceState] = None, aux_loss_group: Any = None) -> None:
        self.config = config
        self.router = router
        self.expert_bias = expert_bias
        self._on_logits = on_logits
        #: the forward's flattened padding mask (True = a real token) and sequence length, for the
        #: balance losses; the "global" loss's running counts and their group
        self.padding_mask, self.sequence_length = padding_mask, sequence_length
        self.global_balance, self.aux_loss_group = global_balance, aux_loss_group

    def options(self) -> dict:
        """The keyword options of the route op (every routed layout uses them)."""
        return self.config.router_spec.options(self.expert_bias)

    def input(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The router's input: ``x`` in the router's dtype (``config.router_dtype``)."""
        w = self.router.weight
        return x_TD if x_TD.dtype == w.dtype else x_TD.to(w.dtype)

    def record(self, logits_TE: torch.Tensor) -> None:
        """Hand the logits of a routing to the layer (for ``last_router_logits``)."""
        if self._on_logits is not None:
            self._on_logits(logits_TE)

    def finish(self, routing: Routing, guarded: bool = False) -> Routing:
        """A non-finite expert bias (an update gone wrong) would silently reroute every token:
        the weights become NaN instead, on the device (no host sync on the forward).
        ``guarded``: the route implementation did it already (the Triton router, in its kernel)."""
        if self.expert_bias is not None and not guarded:
            routing.topk_weights = nan_weights_if_nonfinite(routing.topk_weights, self.expert_bias)
        return routing

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """Router logits and routing for flattened tokens (all of them, the config's capacity)."""
        c = self.config
        logits_TE = router_logits(self.input(x_TD), self.router.weight, self.router)
        need_aux = bool(c.aux_losses) or c.z_loss_coef > 0
        # Traced by torch.compile: the custom op (one opaque node; tritonmoe.custom_ops), else the implementation.
        route = ops.route if torch.compiler.is_compiling() else implementation("route", c.backend, x_TD.device,
                                                                                 logits_TE.dtype)
        kw = {"backend": c.backend} if route is ops.route else {}
        routing = route(
            logits_TE, c.top_k, capacity=c.capacity(x_TD.shape[0]), with_aux=need_aux, **self.options(), **kw
        )
        self.record(logits_TE)
        return logits_TE, self.finish(routing, guarded=getattr(route, "fused_bias_guard", False))

    def aux_loss(self, logits_TE: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The weighted balance losses (``config.aux_loss_type``) and the z-loss of one routing
        (of this forward's tokens: the padding mask and sequence length it was given)."""
        c = self.config
        loss = torch.zeros((), device=logits_TE.device, dtype=torch.float32)
        mask, seq = self.padding_mask, self.sequence_length
        if c.aux_losses:
            loss = loss + balance_losses(logits_TE, routing, c.aux_losses, padding_mask=mask, sequence_length=seq,
                                         global_state=self.global_balance, group=self.aux_loss_group,
                                         backend=c.backend)
        if c.z_loss_coef > 0:
            loss = loss + c.z_loss_coef * reference.z_loss(logits_TE, routing, padding_mask=mask)
        return loss

    def parameters(self) -> list[torch.Tensor]:
        """The gate's parameters."""
        return list(self.router.parameters())
