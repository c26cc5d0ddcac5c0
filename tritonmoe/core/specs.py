"""Option specs: the options of each op family, derived once from a config.

:class:`~tritonmoe.MoEConfig` builds a frozen :class:`RouterSpec` and :class:`FFNSpec` when it is
made (``config.router_spec``, ``config.ffn_spec``); the layer, the expert paths and the
schedules take the route and FFN ops' keyword options from them instead of spelling the options
out one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["RouterSpec", "FFNSpec", "ffn_options"]


@dataclass(frozen=True)
class RouterSpec:
    """The router's options (the ``route`` op's, beside the logits and the capacity)."""

    top_k: int
    score_func: str = "softmax"
    renormalize: bool = True
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    group_score: str = "top2sum"
    routed_scaling_factor: float = 1.0
    drop_policy: str = "slot"

    def options(self, expert_bias: Any = None) -> dict:
        """The keyword options of ``route`` (``expert_bias``: the layer's buffer, which can change
        between forwards, so it is passed in); ``drop_policy`` only when it is not the default, so
        the call is the same as before the option existed."""
        opts = dict(score_func=self.score_func, renormalize=self.renormalize, expert_bias=expert_bias,
                    n_groups=self.n_groups, topk_groups=self.topk_groups, group_score=self.group_score,
                    routed_scaling_factor=self.routed_scaling_factor)
        if self.drop_policy != "slot":
            opts["drop_policy"] = self.drop_policy
        return opts


@dataclass(frozen=True)
class FFNSpec:
    """The expert FFN's options (the grouped-FFN ops', beside the rows and the weights)."""

    activation: str
    swiglu_limit: float
    swiglu_alpha: float

    def options(self) -> dict:
        """The keyword options of the FFN ops (the clamped SwiGLU's limit and alpha)."""
        if self.activation == "swiglu_oai":
            return {"swiglu_limit": self.swiglu_limit, "swiglu_alpha": self.swiglu_alpha}
        return {}


def ffn_options(config: Any) -> dict:
    """The keyword options of the expert FFN ops for ``config`` (``config.ffn_spec.options()``)."""
    spec = getattr(config, "ffn_spec", None)
    if spec is None:  # a config-like object without specs (duck-typed callers)
        spec = FFNSpec(config.activation, config.swiglu_limit, config.swiglu_alpha)
    return spec.options()
