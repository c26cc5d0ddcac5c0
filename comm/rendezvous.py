"""Rendezvous of process groups spawned on one machine, without a free-port race.

Choosing a free port (bind to port 0, read it, close it) and having rank 0 bind it again later
races with every other socket of the machine: gloo's listening sockets, other groups starting
at the same time, other users' processes. On a busy machine the port is sometimes taken in
between (rank 0 fails to bind) or, worse, two groups pick the same one and meet on one store.
Here the parent binds the store itself on a kernel-assigned port and serves it until the ranks
are done; the ranks connect to it as clients.

    store = local_store(P, timeout_s)           # in the parent; keep it alive
    ... start P processes with store.port ...
    init_local(rank, P, port, timeout_s)        # in each rank
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["local_store", "init_local"]

HOST = "127.0.0.1"


def local_store(world_size: int, timeout_s: float) -> "dist.TCPStore":
    """A TCPStore served by this process on loopback, on a port the kernel assigns as it binds
    (``.port``); the rendezvous of ``world_size`` ranks started on this machine. Keep the object
    alive until the ranks have ended (they use it to create every group)."""
    return dist.TCPStore(HOST, 0, world_size=world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_local(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    """``init_process_group`` of one rank on the store :func:`local_store` serves on ``port``,
    with ``timeout_s`` for the rendezvous and as the group's collective timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, world_size=world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
