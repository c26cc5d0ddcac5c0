"""The ``ep`` suite (expert parallelism over torch.distributed, :mod:`bench.ep`) and the ``plan`` suite."""

from __future__ import annotations

import importlib

import torch

from ..harness import Work, fill_timing, first_line, new_row
from ..presets import PRESETS, Preset
from ..roofs import dtype_name
from .common import Context


def load_ep():
    """bench.ep, imported when the ep suite runs; raises ImportError while it does not exist."""
    return importlib.import_module("bench.ep")


def ep_cases(ctx: Context) -> tuple[list[tuple[Preset, int]], torch.dtype, str]:
    """The (preset, tokens per rank) runs of the ep suite, their dtype, and where they run.

    With a GPU per rank, ranks run on NCCL at the run's presets and dtype. Otherwise ranks are
    CPU processes over gloo, in fp32, at the small preset unless presets were chosen (a model
    preset's expert FFN on CPU would take minutes per call). Each token count spawns every
    world size's processes again, so without --tokens only the preset's largest count runs.
    """
    gpus = torch.cuda.device_count() if ctx.is_cuda else 0
    if gpus >= max(ctx.ep_world_sizes):
        presets, dev, dtype, where = ctx.presets, ctx.device, ctx.dtype, f"NCCL on {gpus} GPUs"
    else:
        presets = ctx.presets if ctx.presets_chosen else [PRESETS["small"]]
        dev, dtype, where = torch.device("cpu"), torch.float32, "gloo on CPU processes"
    runs = [(p, T) for p in presets for T in (ctx.tokens or (max(p.tokens(dev)),))]
    return runs, dtype, where


def run_ep_suite(ctx: Context, progress=None) -> list[dict]:
    """Run ``bench.ep.run_ep`` for each preset and token count and turn its dicts into rows."""
    try:
        ep = load_ep()
    except ImportError as exc:
        note = f"bench/ep.py (the expert-parallel issue) is not importable: {first_line(exc)}"
        ctx.log(f"ep: unavailable ({note})")
        row = new_row(suite="ep", case="expert parallelism", mode="fwd+bwd", impl="ep", params={})
        row["status"], row["note"] = "unavailable", note
        return [row]
    runs, dtype, where = ep_cases(ctx)
    ctx.log(f"ep: world sizes {','.join(map(str, ctx.ep_world_sizes))}, pipeline degrees "
            f"{','.join(map(str, ctx.ep_degrees))}, {where}")
    rows: list[dict] = []
    for p, T in runs:
        if progress is not None:
            progress.step(f"ep {p.name} T/rank={T}")
        try:
            results = ep.run_ep(
                world_sizes=tuple(ctx.ep_world_sizes), degrees=tuple(ctx.ep_degrees), tokens=T,
                d_model=p.d_model, d_ffn=p.d_ffn, num_experts=p.num_experts, top_k=p.top_k, dtype=dtype,
                reps=ctx.timer.reps, warmup=ctx.timer.warmup, timeout_s=ctx.ep_timeout_s,
            )
        except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
            row = new_row(suite="ep", case=f"{p.name} T/rank={T}", mode="fwd+bwd", impl="ep",
                          params=dict(preset=p.name, T=T))
            row["status"], row["note"] = "error", first_line(exc)
            rows.append(row)
            continue
        rows.extend(ep_rows(results, preset=p.name))
    return rows


def _ep_row(d: dict, preset: str | None, mode: str, impl: str, times, work: Work, extra: dict) -> dict:
    ws, n = d.get("world_size"), d.get("pipeline_degree")
    params = {
        "preset": preset,
        "world_size": ws,
        "pipeline_degree": n,
        "T": d.get("tokens_per_rank"),
        "d": d.get("d_model"),
        "f": d.get("d_ffn"),
        "E": d.get("num_experts"),
        "k": d.get("top_k"),
        "dtype": str(d.get("dtype")).replace("torch.", ""),
    }
    case = f"{d.get('name', preset)} P={ws} n={n} T/rank={params['T']}"
    row = new_row(suite="ep", case=case, mode=mode, impl=impl, params=params)
    row["extra"] = {k: v for k, v in extra.items() if v is not None}
    times = [float(t) for t in (times or [])]
    if not times:
        row["status"], row["note"] = "error", f"run_ep returned no {mode} times"
        return row
    fill_timing(row, times, work, None)
    return row


def ep_rows(results: list[dict], preset: str | None = None) -> list[dict]:
    """Rows from ``run_ep`` dicts: the layer's forward+backward per (world size, pipeline
    degree) with its pipelining efficiency, partition overhead and speedup over degree 1, and
    the dispatch and combine all-to-alls with bytes/s (algbw and busbw per nccl-tests)."""
    rows = []
    for d in results:
        nbytes = d.get("dispatch_bytes")
        layer = _ep_row(d, preset, "fwd+bwd", "ep-layer", d.get("layer_fwd_bwd_s"), Work(), {
            "pipeline_efficiency": d.get("pipeline_efficiency"),
            "partition_overhead_frac": d.get("partition_overhead_frac"),
        })
        rows.append(layer)
        comm = {"algbw_GBps": d.get("algbw_GBps"), "busbw_GBps": d.get("busbw_GBps")}
        rows.append(_ep_row(d, preset, "dispatch", "all-to-all", d.get("dispatch_s"), Work(bytes=nbytes), comm))
        rows.append(_ep_row(d, preset, "combine", "all-to-all", d.get("combine_s"), Work(bytes=nbytes), comm))
    # Speedup of pipelining: the degree-1 layer time over each degree's, per world size and case.
    base = {}
    for r in rows:
        if r["impl"] == "ep-layer" and r["status"] == "ok" and r["params"]["pipeline_degree"] == 1:
            base[_ep_key(r)] = r["time_s"]["median"]
    for r in rows:
        if r["impl"] == "ep-layer" and r["status"] == "ok" and _ep_key(r) in base:
            r["extra"]["speedup_vs_degree1"] = base[_ep_key(r)] / r["time_s"]["median"]
    return rows


def run_plan_rows(ctx: Context, progress=None) -> list[dict]:
    from ..plan_fidelity import run_plan_suite

    return run_plan_suite(ctx, progress)


def _ep_key(r: dict):
    p = r["params"]
    return (p["preset"], p["world_size"], p["T"], p["d"], p["f"], p["E"], p["k"], p["dtype"])



def describe_ep(ctx: Context) -> list[str]:
    """The ep suite's runs, one line each (``--list`` and the progress count)."""
    runs, dt, where = ep_cases(ctx)
    return [f"{pr.name} T/rank={T} world sizes {ctx.ep_world_sizes} degrees {ctx.ep_degrees} "
            f"[bench.ep.run_ep, {dtype_name(dt)}, {where}]" for pr, T in runs]

