"""Every expert on this device: :class:`LocalExperts` (the fused ``moe_ffn``, or permute ->
grouped FFN -> unpermute) and the choice between them."""

from __future__ import annotations

from typing import Optional

import torch

from tritonmoe import custom_ops as ops
from tritonmoe import reference
from tritonmoe.backends import implementation
from tritonmoe.core.specs import ffn_options
from tritonmoe import fp8, fp8_reference
from tritonmoe.core.types import Routing, max_permuted_rows

from .base import ExpertPath, ExpertWeights


class LocalExperts(ExpertPath):
    """All E experts on this device.

    The variant comes from ``config.ffn_path``: "fused" runs :func:`tritonmoe.moe_ffn` (token
    gather and weighted combine inside the expert GEMMs); "unfused" runs permute -> grouped FFN
    -> unpermute; "auto" picks per call (:func:`auto_ffn_path`):

    * "unfused" on the reference backend, where both are the same plain-PyTorch composition;
    * on CUDA with the Triton kernels, "unfused" when a backward will follow (grad enabled and x,
      the expert weights or the gate weights require grad) and "fused" otherwise. Measured on
      one H100 (bf16, ``bench/results/nvidia-h100-80gb-hbm3-2026-11-26.md``): forward + backward
      the unfused path is faster (Mixtral-like T=16k 65.4 against 83.5 ms, Qwen3-30B-A3B-like
      T=32k 18.0 against 20.5 ms), forward alone the fused one, which skips the permuted copy
      of x and the expert-ordered y, is as fast or faster (20.4 against 20.8 ms, 5.38 against
      6.06 ms; decode T <= 64 faster). The price of training unfused is those buffers, held for
      backward: peak 7.8 against 5.9 GiB at Qwen3-like T=32k (pass ``ffn_path="fused"`` where
      memory is the limit);
    * "fused" elsewhere (the Triton kernels in the interpreter: no timing to go by).
    """

    def choose(self, x_TD: torch.Tensor, routing: Optional[Routing] = None,
               weights: Optional[ExpertWeights] = None) -> str:
        """The variant for ``x_TD`` ("fused" or "unfused"): ``config.ffn_path``, or for "auto" the
        rule above. The same decision eager and compiled (under ``torch.compile`` it is taken once
        at trace time, see :func:`_local_ffn_path`: grad mode and ``requires_grad`` are static
        there, and guarded, so a compiled layer called under ``no_grad`` after training retraces
        and takes the forward choice)."""
        c = self.config
        return _local_ffn_path(c.ffn_path, c.backend, x_TD.device.type, x_TD.dtype,
                               _needs_backward(x_TD, routing, weights))

    def fp8_forward(self, x_TD: torch.Tensor, routing: Routing, w: ExpertWeights) -> torch.Tensor:
        """``config.expert_dtype="fp8_e4m3"``: the layer's weights are the master weights."""
        c = self.config
        if fp8_training(c, x_TD, routing, w):
            self.path_used = "fp8_train"
            T, k = routing.topk_ids.shape
            rows = max_permuted_rows(T, k, c.num_experts)
            x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts, num_rows=rows)
            y_perm = fp8.fp8_grouped_ffn_train(x_perm, info.expert_offsets, w.w1, w.w2, backend=c.backend)
            return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)
        self.path_used = "fp8"
        # the layer's weights, quantized without quantize_experts' finiteness check (a host sync)
        experts = w.fp8 if w.fp8 is not None else fp8_experts_of(w, c.fp8_recipe)
        return fp8.fp8_moe_ffn(x_TD, routing, experts, backend=c.backend)

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        c = self.config
        w, kw = weights, ffn_options(c)
        if c.expert_dtype is not None:
            return self.fp8_forward(x_TD, routing, w)
        path = self.choose(x_TD, routing, w)
        self.path_used = path
        # Traced by torch.compile: the custom ops (tritonmoe.custom_ops; one opaque node each, no graph
        # break), the same variant and implementations as eager.
        compiling = torch.compiler.is_compiling()
        # Training (grad enabled) in the "save" pre-activation mode: the ops that return the
        # activations backward needs, so the compiled backward reruns no GEMM, as eager; else
        # (inference, or TRITONMOE_FFN_PREACT=recompute for memory) the recomputing ops.
        train = compiling and torch.is_grad_enabled() and _saves_activations()
        if path == "fused":
            if train:
                return ops.moe_ffn_train(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            if compiling:
                return ops.moe_ffn(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            return self.impl("moe_ffn", x_TD)(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, **kw)
        # num_rows: the static bound of the permuted rows, so permute needs no host sync
        T, k = routing.topk_ids.shape
        rows = reference.max_permuted_rows(T, k, c.num_experts)
        if compiling:
            x_perm, info = ops.permute(x_TD, routing.topk_ids, c.num_experts, num_rows=rows, backend=c.backend)
            ffn = ops.grouped_ffn_train if train else ops.grouped_ffn
            y_perm = ffn(x_perm, info.expert_offsets, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            return ops.unpermute(y_perm, info, routing.topk_weights, backend=c.backend)
        x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts, num_rows=rows)
        y_perm = self.impl("grouped_ffn", x_TD)(x_perm, info.expert_offsets, w.w1, w.w2, c.activation, w.b1, w.b2, **kw)
        return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)


def fp8_training(c, x_TD: torch.Tensor, routing: Routing, w: ExpertWeights) -> bool:
    """Whether an FP8 expert call trains (a backward follows: ``fp8_grouped_ffn_train``) or not
    (the inference ops); raises for what the FP8 paths do not run. Local checks, the same on
    every rank of an expert-parallel group (grad mode and ``requires_grad`` are the model's)."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("expert_dtype='fp8_e4m3' runs eagerly only (the FP8 ops are not custom ops "
                                  "yet); call the layer outside torch.compile")
    if w.fp8 is not None:
        if torch.is_grad_enabled() and (x_TD.requires_grad or routing.topk_weights.requires_grad):
            raise ValueError("this layer's experts are held in e4m3 (hold_fp8_experts: an FP8 checkpoint's) and run "
                             "without a backward; call it under torch.no_grad() (inference), or train a layer "
                             "with 16-bit master weights and expert_dtype='fp8_e4m3'")
        return False
    if not _needs_backward(x_TD, routing, w):
        return False
    if c.fp8_recipe != "block128" or c.d_ffn % 128:
        raise ValueError(f"FP8 training needs fp8_recipe='block128' and d_ffn a multiple of 128; this layer "
                         f"has {c.fp8_recipe!r} and d_ffn={c.d_ffn} (run it under torch.no_grad() for "
                         "inference)")
    return True


def fp8_experts_of(w: ExpertWeights, recipe: str) -> "fp8.FP8Experts":
    """The experts an FP8 forward runs: the held e4m3 ones, or the master weights quantized
    (without quantize_experts' finiteness check, a host sync)."""
    if w.fp8 is not None:
        return w.fp8
    return fp8_reference.quantize_experts(w.w1.detach(), w.w2.detach(), "e4m3_" + recipe)


@torch._dynamo.assume_constant_result
def _saves_activations() -> bool:
    """Whether the compiled layer's expert FFN saves its activations for backward (the
    ``*_train`` custom ops) rather than recomputing them: :func:`tritonmoe.custom_ops.preact_mode`,
    read once at trace time."""
    return ops.preact_mode() == "save"


#: Device types where "auto" trains on the unfused path (measured on CUDA; a test widens it to
#: run the rule on CPU in Triton's interpreter).
_TRAIN_UNFUSED_DEVICES = frozenset({"cuda"})


def _needs_backward(x_TD: torch.Tensor, routing: Optional[Routing], weights: Optional[ExpertWeights]) -> bool:
    """Whether autograd will run a backward through this call's expert FFN: grad enabled and x,
    an expert weight (or bias) or the gate weights require grad. Plain Python on tensor metadata:
    under ``torch.compile`` these are trace-time constants (dynamo guards on grad mode and on
    ``requires_grad``), so the choice adds no graph break."""
    if not torch.is_grad_enabled():
        return False
    tensors = [x_TD]
    if routing is not None:
        tensors.append(routing.topk_weights)
    if weights is not None:
        tensors += [weights.w1, weights.w2, weights.b1, weights.b2]
    return any(t is not None and t.requires_grad for t in tensors)


def auto_ffn_path(backend: Optional[str], device_type: str, dtype: torch.dtype, backward: bool) -> str:
    """What ``ffn_path="auto"`` runs (see :class:`LocalExperts`): "unfused" on the reference
    backend and for training on CUDA, "fused" otherwise."""
    impl = implementation("moe_ffn", backend, torch.device(device_type), dtype)
    if impl is reference.moe_ffn:
        return "unfused"
    if backward and device_type in _TRAIN_UNFUSED_DEVICES:
        return "unfused"
    return "fused"


@torch._dynamo.assume_constant_result
def _local_ffn_path(ffn_path: str, backend: Optional[str], device_type: str, dtype: torch.dtype,
                    backward: bool = False) -> str:
    """:meth:`LocalExperts.choose` from plain values. Marked ``assume_constant_result``: under
    ``torch.compile`` it runs once at trace time (the dispatch table is Python state dynamo need
    not trace) and its answer is a constant of the graph, like the backend the custom ops are
    given; changing the process default backend afterwards does not retrace a compiled layer.
    ``backward`` (:func:`_needs_backward`) is itself a trace-time constant."""
    if ffn_path != "auto":
        return ffn_path
    return auto_ffn_path(backend, device_type, dtype, backward)


