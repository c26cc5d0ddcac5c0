"""Inference with popular experts replicated across ranks (Lina's placement) and a stack of
layers served from fewer device slots than layers (SE-MoE's ring offloading). Both give the
outputs of the plain layers.

    torchrun --nproc-per-node 2 examples/inference.py    # gloo on CPU, NCCL on GPUs
    python examples/inference.py                          # one process

docs/inference.md covers popularity estimation, EPLB, the Lina scheduler and the disk tier.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.inference import OffloadedExperts, ReplicatedMoELayer, lina_placement
from _common import init_distributed


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layer-slots", type=int, default=2, help="device slots of the offloaded stack (< --layers)")
    args = p.parse_args(argv)
    rank, world, device = init_distributed()
    try:
        torch.manual_seed(0)
        cfg = tm.MoEConfig(d_model=32, d_ffn=64, num_experts=8, top_k=2)
        layers = [tm.MoELayer(cfg, device=device) for _ in range(args.layers)]
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(64, cfg.d_model, generator=g).to(device)

        with torch.no_grad():
            # 1. Replicas: plan from the routing's load, then serve with the experts spread over ranks.
            layers[0](x)                                # a profiling batch: tokens per expert
            load = layers[0].last_routing.counts.double()
            dist.all_reduce(load)                       # the same placement on every rank
            placement = lina_placement(load, num_devices=world)
            served = ReplicatedMoELayer(layers[0], group=dist.group.WORLD, placement=placement)
            diff_rep = (served(x) - layers[0](x)).abs().max().item()
            print(f"rank {rank}: hosts experts {placement.hosted[rank]}; "
                  f"max |replicated - plain| = {diff_rep:.2e}")

            # 2. Offloading: the stack's experts in host memory, --layer-slots layers on the device.
            want = x
            for layer in layers:
                want = layer(want)
            stack = OffloadedExperts(layers, layer_slots=args.layer_slots)
            try:
                got = x
                for layer in layers:                    # forward hooks swap the experts in and out
                    got = layer(got)
                diff_off = (got - want).abs().max().item()
                print(f"rank {rank}: {args.layers} layers from {args.layer_slots} device slots; "
                      f"max |offloaded - resident| = {diff_off:.2e}; device expert bytes {stack.resident_bytes()}")
            finally:
                stack.close()
        return max(diff_rep, diff_off)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
