"""A MoE layer as the FFN of a small model, trained for a few steps in one process.

    python examples/layer.py            # CUDA if there is a GPU (Triton kernels), else CPU

docs/layer.md describes every option of MoEConfig.
"""

from __future__ import annotations

import argparse

import torch

import tritonmoe as tm
from _common import pick_device


class Block(torch.nn.Module):
    """Pre-norm residual block whose FFN is a MoE layer."""

    def __init__(self, cfg: tm.MoEConfig, device, dtype):
        super().__init__()
        self.norm = torch.nn.RMSNorm(cfg.d_model, device=device, dtype=dtype)
        self.ffn = tm.MoELayer(cfg, device=device, dtype=dtype)

    def forward(self, x):
        return x + self.ffn(self.norm(x))


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    device = pick_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = tm.MoEConfig(d_model=64, d_ffn=128, num_experts=8, top_k=2, activation="swiglu", aux_loss_coef=1e-2)
    model = torch.nn.Sequential(Block(cfg, device, dtype), Block(cfg, device, dtype)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(8, 32, cfg.d_model, device=device, dtype=dtype)
    target = torch.roll(x, 1, dims=-1)          # a toy task: rotate the features by one
    losses = []
    for step in range(args.steps):
        y = model(x)
        mse = (y.float() - target.float()).pow(2).mean()
        aux = sum(b.ffn.aux_loss for b in model)  # the routers' load-balancing losses
        (mse + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mse.item())
        if step % 5 == 0 or step == args.steps - 1:
            load = model[0].ffn.last_routing.counts.tolist()
            print(f"step {step:3d}  loss {mse.item():.4f}  tokens per expert (block 0) {load}")
    print(f"device {device}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses[-1] / losses[0]


if __name__ == "__main__":
    main()
