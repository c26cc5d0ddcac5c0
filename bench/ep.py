"""Expert-parallel benchmark: dispatch / combine bandwidth, layer time and pipelining efficiency.

``run_ep(...)`` measures the expert-parallel MoELayer's forward+backward for every EP size and
pipeline degree and returns one dict per (world_size, pipeline_degree). Two ways to run:

* Plain process (the CPU default): for each world size P it spawns P local ranks on gloo over
  loopback (CPU tensors), each with ``cpu_count // P`` intra-op threads.
* Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set): the calling process is one rank;
  NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, else gloo; ``world_sizes`` is ignored
  (the launched world is used) and every rank returns the same list.

Measurements (per rep, all ranks start together after a barrier; a rep's value is the max
over ranks):

* ``layer_fwd_bwd_s``: wall time of ``layer(x)`` + backward (CUDA: synchronized).
* ``dispatch_s`` / ``combine_s``: summed spans of the forward's dispatch / combine micro-ops
  from the layer's :class:`~tritonmoe.comm.Timeline`. With n >= 2 they run concurrently with
  expert compute, so they include contention.
* ``dispatch_bytes``: bytes each rank sends in the forward dispatch (all permuted rows,
  including those for its own experts, as nccl-tests counts an alltoall buffer), mean over ranks.
* ``algbw_GBps`` = dispatch_bytes / median(dispatch_s); ``busbw_GBps`` = algbw * (P-1)/P (the
  nccl-tests alltoall convention).
* ``pipeline_efficiency``: the timeline's fraction of communication time (forward+backward)
  during which expert compute runs, mean over ranks and reps.
* ``partition_overhead_frac``: time of the re-layout copies (``copy_segments``) / layer time. The
  forward's partition spans are doubled because the backward runs the same copies in reverse
  (inside autograd, where they are not timed separately).
* ``speedup_vs_n1``: median layer time at n=1 / median layer time at this n (same world size).

``python -m bench.ep`` runs it standalone (``--preset quick`` by default, ~30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ep", "PRESETS"]

#: Shapes (tokens are per rank) and rep counts. "quick" keeps the CPU harness run short.
PRESETS = {
    "quick": dict(tokens=256, d_model=64, d_ffn=128, num_experts=8, top_k=2, reps=5, warmup=1),
    "small": dict(tokens=1024, d_model=256, d_ffn=512, num_experts=8, top_k=2, reps=10, warmup=2),
    "medium": dict(tokens=4096, d_model=1024, d_ffn=2048, num_experts=16, top_k=2, reps=5, warmup=1),
}

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _measure_rank(rank: int, P: int, spec: dict, device: torch.device, progress) -> list[dict]:
    """This rank's per-rep measurements for every pipeline degree (collective: all ranks).

    The degrees are measured round-robin inside each rep (rep 0 of every degree, then rep 1,
    ...), so a machine whose load drifts during the run biases no degree against another."""
    import tritonmoe as tm
    from tritonmoe.comm import Timeline

    dtype = _DTYPES[spec["dtype"]]
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    x = torch.randn(spec["tokens"], spec["d_model"], generator=g).to(device=device, dtype=dtype)
    x.requires_grad_()
    dy = torch.randn(spec["tokens"], spec["d_model"], generator=g).to(device=device, dtype=dtype)
    layers = {}
    for n in spec["degrees"]:
        cfg = tm.MoEConfig(spec["d_model"], spec["d_ffn"], spec["num_experts"], spec["top_k"], pipeline_degree=n)
        torch.manual_seed(0)  # the replicated router must match on every rank (and across degrees)
        layers[n] = tm.MoELayer(cfg, ep_group=dist.group.WORLD, device=device, dtype=dtype)
        layers[n].timeline = Timeline()
    reps: dict[int, list[dict]] = {n: [] for n in spec["degrees"]}
    for it in range(spec["warmup"] + spec["reps"]):
        for n, layer in layers.items():
            tl = layer.timeline
            x.grad = None
            layer.zero_grad(set_to_none=True)
            tl.clear()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            layer(x).backward(dy)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            if it < spec["warmup"]:
                continue
            rows = int(layer.last_routing.counts.sum())  # kept slots = rows dispatched
            reps[n].append(
                {
                    "layer_s": elapsed,
                    "dispatch_s": tl.total("dispatch", "fwd"),
                    "combine_s": tl.total("combine", "fwd"),
                    "partition_s": 2.0 * tl.total("partition", "fwd"),
                    "efficiency": tl.pipeline_efficiency(),
                    "dispatch_bytes": rows * spec["d_model"] * x.element_size(),
                }
            )
            progress()
    return [{"pipeline_degree": n, "reps": reps[n]} for n in spec["degrees"]]


def _aggregate(per_rank: list[list[dict]], spec: dict, P: int, backend: str) -> list[dict]:
    """One result dict per degree: per-rep maxima over ranks and the derived figures."""
    results = []
    for j, n in enumerate(spec["degrees"]):
        ranks = [r[j]["reps"] for r in per_rank]
        nrep = min(len(x) for x in ranks)

        def per_rep_max(key):
            return [max(ranks[r][i][key] for r in range(P)) for i in range(nrep)]

        layer_s = per_rep_max("layer_s")
        dispatch_s = per_rep_max("dispatch_s")
        combine_s = per_rep_max("combine_s")
        dispatch_bytes = statistics.fmean(ranks[r][i]["dispatch_bytes"] for r in range(P) for i in range(nrep))
        med = statistics.median(dispatch_s) if dispatch_s else 0.0
        algbw = dispatch_bytes / med / 1e9 if med > 0 else 0.0
        effs = [ranks[r][i]["efficiency"] for r in range(P) for i in range(nrep) if ranks[r][i]["efficiency"] is not None]
        part = [
            sum(ranks[r][i]["partition_s"] for i in range(nrep)) / sum(ranks[r][i]["layer_s"] for i in range(nrep))
            for r in range(P)
            if nrep
        ]
        results.append(
            {
                "name": f"ep/P{P}/n{n}",
                "world_size": P,
                "pipeline_degree": n,
                "tokens_per_rank": spec["tokens"],
                "d_model": spec["d_model"],
                "d_ffn": spec["d_ffn"],
                "num_experts": spec["num_experts"],
                "top_k": spec["top_k"],
                "dtype": spec["dtype"],
                "backend": backend,
                "layer_fwd_bwd_s": layer_s,
                "dispatch_s": dispatch_s,
                "combine_s": combine_s,
                "dispatch_bytes": dispatch_bytes,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * (P - 1) / P,
                "pipeline_efficiency": statistics.fmean(effs) if effs else None,
                "partition_overhead_frac": statistics.fmean(part) if part else None,
            }
        )
    base = next((r for r in results if r["pipeline_degree"] == 1), None)
    for r in results:
        r["speedup_vs_n1"] = (
            statistics.median(base["layer_fwd_bwd_s"]) / statistics.median(r["layer_fwd_bwd_s"])
            if base is not None and r["layer_fwd_bwd_s"]
            else None
        )
    return results


def _spawned_rank(rank: int, P: int, port: int, spec: dict, outdir: str, timeout_s: float, measure=None) -> None:
    """A spawned rank: init gloo, run ``measure(rank, P, spec, device, progress)`` (default: this
    module's), write its result for the parent."""
    from tritonmoe.comm.rendezvous import init_local

    measure = measure or _measure_rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    heartbeat = os.path.join(outdir, f"progress{rank}")

    def progress() -> None:
        with open(heartbeat, "a") as f:
            f.write(".")

    try:
        init_local(rank, P, port, timeout_s)
        progress()
        result = {"ok": measure(rank, P, spec, torch.device("cpu"), progress)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    tmp = os.path.join(outdir, f"rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    if "ok" in result:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        os._exit(0)
    os._exit(1)


def run_spawned(P: int, spec: dict, timeout_s: float, measure=None, what: str = "bench.ep") -> list:
    """Spawn P gloo ranks running ``measure`` (default: this module's); kill them if none makes
    progress for timeout_s seconds. Every rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        from tritonmoe.comm.rendezvous import local_store

        store = local_store(P, timeout_s + 60.0)  # served until the ranks have ended (no free-port race)
        port = store.port
        procs = [
            ctx.Process(target=_spawned_rank, args=(r, P, port, spec, outdir, timeout_s, measure), daemon=True)
            for r in range(P)
        ]
        for p in procs:
            p.start()
        last, last_change = -1, time.monotonic()
        stall_limit = timeout_s + 30.0  # + process start-up (imports) before the first heartbeat
        while any(p.is_alive() for p in procs):
            time.sleep(0.2)
            done = 0
            for r in range(P):
                path = os.path.join(outdir, f"progress{r}")
                done += os.path.getsize(path) if os.path.exists(path) else 0
            if done != last:
                last, last_change = done, time.monotonic()
            elif time.monotonic() - last_change > stall_limit:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
        for p in procs:
            p.join(5)
        per_rank, errors = [], []
        for r in range(P):
            path = os.path.join(outdir, f"rank{r}.json")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (died or killed after {stall_limit:.0f} s without progress)")
                continue
            with open(path) as f:
                res = json.load(f)
            if "ok" in res:
                per_rank.append(res["ok"])
            else:
                errors.append(f"rank {r}:\n{res['error']}")
        if errors:
            raise RuntimeError(f"{what} with {P} ranks failed:\n" + "\n".join(errors))
        return per_rank


def _run_torchrun(spec: dict, timeout_s: float) -> list[dict]:
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    mine = _measure_rank(rank, P, spec, device, lambda: None)
    gathered: list = [None] * P
    dist.all_gather_object(gathered, mine)
    return _aggregate(gathered, spec, P, backend)


def run_ep(
    *,
    world_sizes=(2, 4),
    degrees=(1, 2, 4, 8),
    tokens: int,
    d_model: int,
    d_ffn: int,
    num_experts: int,
    top_k: int,
    dtype=torch.float32,
    reps: int = 20,
    warmup: int = 3,
    timeout_s: float = 60.0,
) -> list[dict]:
    """Benchmark the expert-parallel MoELayer; one dict per (world_size, pipeline_degree).

    ``tokens`` is per rank. ``timeout_s`` bounds init and every collective, and a spawned group
    that makes no progress for that long (plus start-up) is killed and reported. See the module
    docstring for the keys.
    """
    dtype_name = next((k for k, v in _DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise ValueError(f"dtype={dtype} is not supported; use one of {', '.join(_DTYPES)}")
    spec = dict(
        tokens=tokens,
        d_model=d_model,
        d_ffn=d_ffn,
        num_experts=num_experts,
        top_k=top_k,
        dtype=dtype_name,
        reps=reps,
        warmup=warmup,
        degrees=list(degrees),
    )
    if _in_torchrun():
        return _run_torchrun(spec, timeout_s)
    results = []
    for P in world_sizes:
        if num_experts % P:
            raise ValueError(f"num_experts={num_experts} is not divisible by world size {P}")
        results += _aggregate(run_spawned(P, spec, timeout_s), spec, P, "gloo")
    return results


def _print_table(results: list[dict]) -> None:
    print(
        f"{'name':12} {'layer ms':>9} {'vs n1':>6} {'disp ms':>8} {'comb ms':>8} {'algbw GB/s':>10} "
        f"{'busbw GB/s':>10} {'pipe eff':>8} {'partition':>9}"
    )
    for r in results:
        eff = "-" if r["pipeline_efficiency"] is None else f"{r['pipeline_efficiency']:.2f}"
        part = "-" if r["partition_overhead_frac"] is None else f"{100 * r['partition_overhead_frac']:.2f}%"
        print(
            f"{r['name']:12} {1e3 * statistics.median(r['layer_fwd_bwd_s']):9.2f} {r['speedup_vs_n1']:6.2f} "
            f"{1e3 * statistics.median(r['dispatch_s']):8.2f} {1e3 * statistics.median(r['combine_s']):8.2f} "
            f"{r['algbw_GBps']:10.3f} {r['busbw_GBps']:10.3f} {eff:>8} {part:>9}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8])
    for name in ("tokens", "d_model", "d_ffn", "num_experts", "top_k", "reps", "warmup"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    kw = dict(PRESETS[args.preset])
    for name in ("tokens", "d_model", "d_ffn", "num_experts", "top_k", "reps", "warmup"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    t0 = time.perf_counter()
    results = run_ep(
        world_sizes=tuple(args.world_sizes),
        degrees=tuple(args.degrees),
        dtype=_DTYPES[args.dtype],
        timeout_s=args.timeout,
        **kw,
    )
    if _in_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    print(f"bench.ep preset={args.preset} {kw} dtype={args.dtype} torch={torch.__version__}")
    _print_table(results)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


_run_spawned = run_spawned  # the old private name
