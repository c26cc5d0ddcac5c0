"""Expert weights held in e4m3: :class:`FP8ExpertStore`, the submodule of a layer whose routed
experts are an FP8 checkpoint's (not quantized from 16-bit master weights at each call).

A layer holds one through :func:`tritonmoe.layer.hold_fp8_experts` (what :func:`tritonmoe.hf.apply`
does with ``fp8_experts=``): its buffers are the checkpoint's tensors in the checkpoint layout
(``w1`` e4m3 [E_local, 2f, d], gate rows then up rows; ``w2`` e4m3 [E_local, d, f]; the fp32
scales), so the state dict saves them as they were loaded. Moving the layer moves them; casting
it (``.half()``, ``.to(torch.bfloat16)``) casts the layer's other tensors and leaves these in
their dtypes: an e4m3 weight cast to 16 bits without its scale would be a different weight, and
an fp32 scale rounded to 16 bits a wrong one.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonmoe.fp8_reference import FP8Experts

__all__ = ["FP8ExpertStore"]


class FP8ExpertStore(nn.Module):
    """Buffers ``w1``, ``w1_scale``, ``w2``, ``w2_scale`` of :class:`~tritonmoe.fp8.FP8Experts`
    in ``format``; :meth:`experts` gives them back as one."""

    def __init__(self, experts: FP8Experts) -> None:
        super().__init__()
        self.format = experts.format
        for name in ("w1", "w1_scale", "w2", "w2_scale"):
            self.register_buffer(name, getattr(experts, name).contiguous())

    def experts(self) -> FP8Experts:
        return FP8Experts(self.w1, self.w1_scale, self.w2, self.w2_scale, self.format)

    def extra_repr(self) -> str:
        E, N1, D = self.w1.shape
        return f"format={self.format}, num_experts={E}, d_model={D}, d_ffn={N1 // 2}"

    def _apply(self, fn, recurse: bool = True):
        # only the device of fn's result is taken (fn of an empty tensor shows it): dtypes stay
        for name, t in list(self._buffers.items()):
            if t is not None:
                self._buffers[name] = t.to(fn(t.new_empty(0)).device)
        return self
