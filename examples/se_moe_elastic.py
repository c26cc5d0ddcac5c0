"""SE-MoE's elastic multi-task training on gloo (CPU):

    torchrun --nproc-per-node 4 examples/se_moe_elastic.py

Two tasks (two different models, two datasets) start on 3 + 1 ranks; after a step the measured
throughput says both need the same GPU time, and the ranks are regrouped 2 + 2 with every
parameter and optimizer state carried through a checkpoint."""

import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe.comm import bucketed_all_reduce
from tritonmoe.parallel import allocate_tasks, reallocate, task_layout

BATCH = 12


def build(task, _layout=None):
    torch.manual_seed(task)
    model = nn.Linear(4, 3) if task == 0 else nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(layout, model, opt, i):
    g, r = layout.task_size, layout.rank_in_task
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(100 * layout.task + i))[r * BATCH // g : (r + 1) * BATCH // g]
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    for p, red in zip(model.parameters(), bucketed_all_reduce([p.grad for p in model.parameters()], layout.group, 4096)):
        p.grad.copy_(red / g)
    opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    layout = task_layout(allocate_tasks([3, 1], dist.get_world_size()))
    model, opt = build(layout.task)
    t0 = time.perf_counter()
    step(layout, model, opt, 0)
    measured = BATCH / (time.perf_counter() - t0)  # this task's samples/s (tiny here: any value works)
    # for the demonstration, report equal per-GPU rates so that both tasks need the same GPU time
    rate = 30.0 if layout.task == 0 else 10.0
    with tempfile.TemporaryDirectory() as d:
        box = [d]
        dist.broadcast_object_list(box)  # one directory for every rank
        layout, model, opt = reallocate(layout, model, opt, samples_per_step=[BATCH, BATCH], samples_per_s=rate,
                                        checkpoint_dir=box[0], build=build)
        dist.barrier()
    step(layout, model, opt, 1)
    print(f"rank {dist.get_rank()}: task {layout.task} on {layout.task_size} ranks {layout.allocation} "
          f"(measured {measured:.0f} samples/s before)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
