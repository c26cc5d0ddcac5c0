"""Data parallelism x expert parallelism with checkpoints: train on a ("dp", "ep") mesh, save
with torch.distributed.checkpoint (DCP), resume on another layout or world size.

    torchrun --nproc-per-node 2 examples/train_dp_ep.py --ep 2 --save ckpt     # 1 replica x 2 EP ranks
    torchrun --nproc-per-node 2 examples/train_dp_ep.py --ep 1 --resume ckpt   # 2 replicas x 1 rank
    python examples/train_dp_ep.py --resume ckpt                               # one process

Experts are checkpointed by global index (DTensors of shape [E, ...]), so DCP reshards them to
whatever layout loads them; the optimizer's per-expert state (Adam's moments) goes the same way.
The script prints the checkpoint's checksum when it saves and the loaded model's when it resumes
(the same number: nothing lost in the resharding). docs/data-parallel.md explains the gradient
semantics and Lina's priority communication (--comm lina).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tritonmoe as tm
from tritonmoe.parallel import MoEMesh, data_parallel
from _common import init_distributed

D_MODEL = 32


def build(mesh: MoEMesh, device) -> torch.nn.Module:
    torch.manual_seed(0)   # every rank alike: the dense layers and the router are replicated
    cfg = tm.MoEConfig(d_model=D_MODEL, d_ffn=64, num_experts=4, top_k=2)
    return torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_MODEL), tm.MoELayer(cfg, mesh=mesh)).to(device)


def checksum(model: torch.nn.Module) -> float:
    """A number of the global model (collective: every rank calls it; experts gathered)."""
    full = tm.parallel.full_state_dict(model)
    return float(sum(t.double().sum() * (i + 1) for i, t in enumerate(v for _, v in sorted(full.items()))))


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: the world size); dp = world / ep")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--comm", choices=("fifo", "lina"), default="lina")
    p.add_argument("--save", metavar="DIR", help="save a DCP checkpoint here after training")
    p.add_argument("--resume", metavar="DIR", help="load this DCP checkpoint before training")
    args = p.parse_args(argv)
    rank, world, device = init_distributed()
    try:
        ep = args.ep or world
        mesh = MoEMesh.build(dp=world // ep, ep=ep)
        model = build(mesh, device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if args.resume:
            # Adam's state must exist before loading into it: one zero-gradient step creates it.
            for q in model.parameters():
                q.grad = torch.zeros_like(q)
            opt.step()
            state = {"model": model.state_dict(), "optim": tm.parallel.optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=args.resume)    # each rank reads its experts of this layout
            model.load_state_dict(state["model"])
            tm.parallel.load_optimizer_state_dict(model, opt, state["optim"])
            total = checksum(model)
            if rank == 0:
                print(f"resumed {args.resume} on dp={world // ep} x ep={ep}: checksum {total:.10e}")
        ddp = data_parallel(model, mesh, comm=args.comm)
        g = torch.Generator().manual_seed(100 + rank)          # this rank's batches
        for step in range(args.steps):
            x = torch.randn(16, D_MODEL, generator=g).to(device)
            loss = (ddp(x) - x.flip(-1)).pow(2).mean()
            loss.backward()        # dense grads averaged over all ranks, expert grads over replicas
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"rank {rank} step {step}: loss {loss.item():.5f}")
        if args.save:
            dcp.save({"model": model.state_dict(), "optim": tm.parallel.optimizer_state_dict(model, opt)},
                     checkpoint_id=args.save)
            total = checksum(model)
            if rank == 0:
                print(f"saved {args.save} from dp={world // ep} x ep={ep}: checksum {total:.10e}")
        return loss.item()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
