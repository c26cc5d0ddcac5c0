"""The expert-path seam: :class:`ExpertWeights` and the :class:`ExpertPath` interface every
parallel layout implements (``path(x_TD, routing, weights) -> y_TD``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tritonmoe.backends import implementation
from tritonmoe.config import MoEConfig
from tritonmoe.core.types import Routing


#: The parameter dtypes the distributed paths exchange, by their code in agreement checks.
DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s index in :data:`DTYPE_CODES` (-1: none of them)."""
    return DTYPE_CODES.index(dtype) if dtype in DTYPE_CODES else -1


@dataclass(frozen=True)
class ExpertWeights:
    """The expert parameters of a layer (this rank's experts under expert parallelism):
    ``w1`` [E_local, d_model, n1], ``w2`` [E_local, d_ffn, d_model], and the optional biases
    ``b1`` [E_local, n1] and ``b2`` [E_local, d_model]. ``fp8``: the layer's experts held in
    e4m3 (:func:`tritonmoe.layer.hold_fp8_experts`; then ``w1``/``w2`` are empty placeholders and
    the FP8 paths run these), else None."""

    w1: torch.Tensor
    w2: torch.Tensor
    b1: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    fp8: Optional[Any] = None

    def params(self) -> tuple[torch.Tensor, ...]:
        """The tensors a schedule differentiates (in a fixed order: w1, w2, then the biases
        present)."""
        return (self.w1, self.w2) + tuple(b for b in (self.b1, self.b2) if b is not None)

    def with_params(self, params) -> "ExpertWeights":
        """The weights with :meth:`params` replaced by ``params`` (same order and presence)."""
        w1, w2, *rest = params
        rest = list(rest)
        b1 = rest.pop(0) if self.b1 is not None else None
        b2 = rest.pop(0) if self.b2 is not None else None
        return ExpertWeights(w1, w2, b1, b2, self.fp8)


class ExpertPath:
    """Base of the expert paths: ``path(x_TD, routing, weights) -> y_TD``.

    Attributes:
        config: the layer's :class:`~tritonmoe.MoEConfig`.
        num_local_experts: experts held on this rank (E_local; E without expert parallelism).
        expert_start: global index of this rank's first expert.
        path_used: the variant the last call ran ("fused", "unfused", "expert_parallel", ...),
            None before the first call.
        timeline: a :class:`~tritonmoe.comm.Timeline` the path records its schedule into, or None.
        input_error: set by the layer for one step when this rank refused its input while the
            path reports refused inputs (:attr:`reports_input_errors`): the step then runs on an
            empty batch and the path sends the error in the step's first exchange, which raises
            it on every rank (:class:`~tritonmoe.comm.errors.RankInputError`).
    """

    #: Whether the path carries a rank's refused input into its step's first exchange (so the
    #: layer runs the step on an empty batch instead of raising on that rank alone).
    reports_input_errors = False

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.num_local_experts = config.num_experts
        self.expert_start = 0
        self.path_used: Optional[str] = None
        self.timeline = None
        self.input_error: Optional[BaseException] = None

    def impl(self, op: str, x: torch.Tensor):
        """The implementation of ``op`` for the layer's backend and ``x``'s device and dtype."""
        return implementation(op, self.config.backend, x.device, x.dtype)

    def weight_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of this rank's ``w1`` and ``w2`` (a layout that shards the experts' hidden
        dimension holds a slice of it)."""
        c = self.config
        return (self.num_local_experts, c.d_model, c.n1), (self.num_local_experts, c.d_ffn, c.d_model)

    def step(self, x_TD: torch.Tensor, router: Any, weights: ExpertWeights) -> tuple[torch.Tensor, Routing, torch.Tensor]:
        """The layer's step on flattened tokens: ``(output, routing, aux_loss)``.

        ``router`` is the layer's :class:`~tritonmoe.router.RouteStep` (the path never sees the
        layer). The default routes every token, runs this path on them and computes the
        auxiliary loss. A path whose schedule routes differently overrides it (Parm's S1 routes
        only this model-parallel rank's slice and reduces the counts over the MP group)."""
        logits_TE, routing = router.route(x_TD)
        aux = router.aux_loss(logits_TE, routing)
        return self(x_TD, routing, weights), routing, aux

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        raise NotImplementedError


