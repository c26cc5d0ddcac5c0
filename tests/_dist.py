"""Spawned gloo process groups for the distributed tests.

``run_group(P, fn, *args)`` starts P fresh processes (spawn), each initializes a gloo group on
loopback (rendezvous on a TCPStore the parent serves on a port the kernel assigned as it bound
it, so concurrent groups and other processes of a busy machine cannot take it between choosing
and binding; ``timeout`` on init and on every collective), runs ``fn(rank, P, *args)``
and writes its outcome to a file. The parent joins them with a deadline and kills stragglers,
so a hang becomes a test failure, never a hung test run. Spawning costs seconds on the shared
CPU machine: batch many checks into one call (a table of cases per group).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

from tritonmoe.comm.rendezvous import local_store


@dataclass
class RankResult:
    rank: int
    status: str  # "ok", "error" (fn raised; ``value`` is the traceback) or "missing" (died/killed)
    value: Any = None


def _entry(rank: int, P: int, port: int, pg_timeout_s: float, fn: Callable, args: tuple, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    from tritonmoe.comm.rendezvous import init_local

    torch.set_num_threads(1)
    ok = False
    try:
        init_local(rank, P, port, pg_timeout_s)  # the parent serves the store on `port`
        result = ("ok", fn(rank, P, *args))
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    tmp = os.path.join(outdir, f"rank{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.pkl"))
    if ok:
        try:
            dist.barrier()  # every rank is done with its collectives before any connection closes
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        os._exit(0)
    os._exit(1)  # a broken group: never wait on it


def run_group(
    world_size: int,
    fn: Callable,
    *args,
    deadline_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> tuple[list[RankResult], float]:
    """Run ``fn(rank, world_size, *args)`` on a fresh gloo group; (per-rank results, wall seconds).

    ``fn`` must be importable by a spawned child (a module-level function of a test helper
    module). Ranks still running after ``deadline_s`` are killed and reported "missing".
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        store = local_store(world_size, deadline_s)  # served until every rank has ended
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, store.port, pg_timeout_s, fn, args, outdir), daemon=True)
            for r in range(world_size)
        ]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, t0 + deadline_s - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        wall = time.monotonic() - t0
        del store
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
                results.append(RankResult(r, status, value))
            else:
                results.append(RankResult(r, "missing"))
    return results, wall


def values_or_fail(results: list[RankResult]) -> list[Any]:
    """Every rank's return value; a readable assertion error naming each failed rank otherwise."""
    bad = [r for r in results if r.status != "ok"]
    if bad:
        msg = "\n".join(f"--- rank {r.rank}: {r.status}\n{r.value or ''}" for r in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{msg}")
    return [r.value for r in results]
