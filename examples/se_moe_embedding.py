"""SE-MoE's embedding partition in data parallelism on gloo (CPU):

    torchrun --nproc-per-node 2 examples/se_moe_embedding.py

Each rank holds 1/N of the table's rows; a lookup sends ids to their owners and rows back (two
all-to-alls), the backward sends gradients to the owners (one all-to-all); nothing all-reduces
the table."""

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe.parallel import PartitionedEmbedding, full_state_dict


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    emb = PartitionedEmbedding(1000, 16, padding_idx=0)
    print(f"rank {rank}: rows [{emb.row_start}, {emb.row_end}) of 1000, weight {tuple(emb.weight.shape)}")
    head = nn.Linear(16, 1)
    opt = torch.optim.Adam(list(emb.parameters()) + list(head.parameters()), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 1000, (4, 7), generator=torch.Generator().manual_seed(step * P + rank))
        loss = head(emb(ids)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in head.parameters():  # the dense head is replicated: reduce it as DDP would
            dist.all_reduce(p.grad)
            p.grad /= P
        opt.step()
    table = full_state_dict(nn.ModuleDict({"emb": emb}))["emb.weight"]  # collective
    if rank == 0:
        print("full table:", tuple(table.shape))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
