"""The planner for a real model, offline: which pipeline degree and memory strategy the
simulator picks for Mixtral-8x7B's or DeepSeek-V3's MoE layer on a cluster of H100 nodes, and
what each candidate costs. Runs anywhere (a simulation; no GPU, no process group).

    python examples/plan_model.py                               # Mixtral-8x7B, one DGX-H100 node (8 GPUs)
    python examples/plan_model.py --model deepseek-v3 --nodes 8 --tokens 8192

docs/planner.md explains the cost model and the simulator; `python -m tritonmoe.plan --help` is
the same from the shell.
"""

from __future__ import annotations

import argparse

import tritonmoe as tm
from tritonmoe.plan import Cluster, choose, choose_memory

MODELS = {
    # The MoE layer of each model (d_model, expert hidden width, experts, top-k).
    "mixtral-8x7b": dict(d_model=4096, d_ffn=14336, num_experts=8, top_k=2),
    "qwen3-30b-a3b": dict(d_model=2048, d_ffn=768, num_experts=128, top_k=8),
    "deepseek-v3": dict(d_model=7168, d_ffn=2048, num_experts=256, top_k=8, score_func="sigmoid",
                        n_groups=8, topk_groups=4, expert_bias=True),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mixtral-8x7b")
    p.add_argument("--cluster", default="dgx-h100", help="a preset of tritonmoe.plan.Cluster (python -m tritonmoe.plan clusters)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (the world size must divide the experts)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--budget-mib", type=int, default=None, help="device memory the expert block may keep for backward")
    args = p.parse_args(argv)

    cluster = Cluster.preset(args.cluster, nodes=args.nodes)
    world = cluster.nodes * cluster.gpus_per_node
    cfg = tm.MoEConfig(**MODELS[args.model], pipeline_degree="auto")
    print(f"{args.model} on {world} GPUs ({args.cluster} x {args.nodes} nodes), {args.tokens} tokens per rank, bf16")

    plan = choose(cfg, args.tokens, cluster, world_size=world, dtype="bfloat16", pipeline_degree=(1, 2, 4, 8))
    print(plan.table())
    print(f"-> {plan.choice}, predicted step {plan.step_time * 1e3:.2f} ms")

    budget = args.budget_mib << 20 if args.budget_mib else None
    mem = choose_memory(cfg, args.tokens, cluster, world_size=world, dtype="bfloat16", budget_bytes=budget,
                        degrees=(1, 2, 4))
    print(mem.table())
    return plan


if __name__ == "__main__":
    main()
