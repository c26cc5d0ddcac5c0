"""What every example shares: the device, and the process group under torchrun."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def pick_device() -> str:
    """CUDA when there is a GPU, else the CPU (the reference path; gloo for distributed runs)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 120.0) -> tuple[int, int, str]:
    """Join the group torchrun describes (NCCL on GPUs, gloo on CPU); (rank, world size, device).

    Without torchrun (no ``WORLD_SIZE``) it makes a group of one process, so every example also
    runs as a plain ``python examples/<name>.py``.
    """
    device = pick_device()
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    # Every wait is bounded: a rank that dies makes the others raise instead of hanging.
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)        # torchrun's rendezvous
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device
