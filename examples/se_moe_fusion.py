"""SE-MoE's fusion communication on gloo (CPU):

    torchrun --nproc-per-node 2 examples/se_moe_fusion.py

Fuses several tensors into one all-gather, reduces many small tensors in a few buckets, and
trains a small model whose gradients go through GradientBuckets (one all-reduce per bucket,
started when the bucket's last gradient is ready)."""

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe.comm import GradientBuckets, bucketed_all_reduce, fused_all_gather, plan_buckets


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    slices = [torch.full((2, 3), float(rank)), torch.full((4,), 10.0 + rank)]
    gathered = fused_all_gather(slices)  # one all-gather for both
    assert gathered[0].shape == (2 * P, 3) and gathered[1][4 * (P - 1)] == 10.0 + P - 1

    small = [torch.ones(n) * (rank + 1) for n in (3, 5, 2, 700, 4)]
    reduced = bucketed_all_reduce(small, bucket_bytes=64)
    if rank == 0:
        print("buckets of 64 bytes:", plan_buckets([t.numel() * 4 for t in small], 64))
        print("reduced[0] =", reduced[0].tolist())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    params = list(model.parameters())[::-1]  # the order autograd readies them
    buckets = GradientBuckets(params, bucket_bytes=256, divisor=P)  # the plan is agreed here
    buckets.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # gradients are reduced (mean over ranks) on return
        opt.step()
    if rank == 0:
        print(f"{len(buckets)} gradient buckets for {len(params)} parameters; trained 3 steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
