"""Option specs: the keyword options each op family takes, derived once from a config."""

from __future__ import annotations

from typing import Any

__all__ = ["ffn_options"]


def ffn_options(config: Any) -> dict:
    """The keyword options of the expert FFN ops for ``config`` (the clamped SwiGLU's)."""
    if config.activation == "swiglu_oai":
        return {"swiglu_limit": config.swiglu_limit, "swiglu_alpha": config.swiglu_alpha}
    return {}
