"""Expert parallelism: each rank holds E/P experts and its own tokens; the layer exchanges rows
with all-to-alls (pipelined in micro-batches), and equals one process holding every expert.

    torchrun --nproc-per-node 2 examples/expert_parallel.py     # gloo on CPU, NCCL on GPUs
    python examples/expert_parallel.py                           # a group of one process

docs/expert-parallel.md explains the schedule and the static (graph-capturable) mode.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist

import tritonmoe as tm
from _common import init_distributed


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pipeline-degree", type=int, default=2)
    args = p.parse_args(argv)
    rank, world, device = init_distributed()
    try:
        cfg = tm.MoEConfig(d_model=64, d_ffn=128, num_experts=4 * world, top_k=2,
                           pipeline_degree=args.pipeline_degree)
        torch.manual_seed(0)   # expert e's weights depend on the seed and e only, on any layout
        layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD, device=device)
        torch.manual_seed(0)
        # one process holding every expert (not pipelined: nothing to overlap), for the check
        whole = tm.MoELayer(dataclasses.replace(cfg, pipeline_degree=1), device=device)
        print(f"rank {rank}/{world}: experts {layer.w1.shape[0]} of {cfg.num_experts} (w1 {tuple(layer.w1.shape)})")

        g = torch.Generator().manual_seed(1 + rank)           # every rank its own batch (ragged)
        x = torch.randn(24 + 8 * rank, cfg.d_model, generator=g).to(device)
        diff = (layer(x) - whole(x)).abs().max().item()
        print(f"rank {rank}: max |expert-parallel - single process| = {diff:.2e}")

        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        for step in range(args.steps):
            loss = layer(x).pow(2).mean()
            loss.backward()
            # Router gradients are per rank: average them like a data-parallel wrapper would
            # (docs/data-parallel.md does it with tritonmoe.parallel.data_parallel).
            dist.all_reduce(layer.router.weight.grad)
            layer.router.weight.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"rank {rank} step {step}: loss {loss.item():.5f}")
        return diff
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
