"""tritonmoe: fast Mixture-of-Experts layers.

Fused Triton kernels for routing, token permutation and the grouped expert FFN
(:mod:`tritonmoe.kernels`), communication building blocks for expert parallelism on
torch.distributed (:mod:`tritonmoe.comm`), plain-PyTorch references of every op
(:mod:`tritonmoe.reference`) and a drop-in :class:`MoELayer`.
"""

from tritonmoe.core.settings import (
    get_backend,
    interpreter_enabled,
    set_backend,
    set_validation,
    use_backend,
    validation,
    validation_enabled,
)
from .aux_loss import attach_aux_loss, set_aux_loss_scale
from .core.autograd import NotTwiceDifferentiableError
from .bias import ExpertBiasError, check_expert_bias, expert_bias_finite, update_expert_bias
from .config import MoEConfig
from .functional import (
    grouped_ffn,
    grouped_gemm,
    load_balancing_loss,
    max_permuted_rows,
    moe_ffn,
    permute,
    route,
    unpermute,
    z_loss,
)
from .fp8 import FP8Experts, fp8_moe_ffn, load_fp8_experts, quantize_experts
from .layer import MoELayer
from .parm_layout import LayoutError, ParmGroups, ParmLayout
from tritonmoe.core.types import PermuteInfo, Routing
from . import comm, fp8, parallel, reference

__version__ = "0.1.0"

__all__ = [
    "attach_aux_loss",
    "set_aux_loss_scale",
    "check_expert_bias",
    "comm",
    "expert_bias_finite",
    "interpreter_enabled",
    "update_expert_bias",
    "ExpertBiasError",
    "FP8Experts",
    "fp8",
    "fp8_moe_ffn",
    "load_fp8_experts",
    "quantize_experts",
    "MoEConfig",
    "MoELayer",
    "LayoutError",
    "NotTwiceDifferentiableError",
    "ParmGroups",
    "ParmLayout",
    "PermuteInfo",
    "Routing",
    "get_backend",
    "grouped_ffn",
    "grouped_gemm",
    "load_balancing_loss",
    "max_permuted_rows",
    "moe_ffn",
    "parallel",
    "permute",
    "reference",
    "route",
    "set_backend",
    "set_validation",
    "unpermute",
    "use_backend",
    "validation",
    "validation_enabled",
    "z_loss",
]
