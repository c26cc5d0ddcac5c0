"""The suites whose ranks are separate processes over gloo: ``lina``, ``memory`` and ``inference``."""

from __future__ import annotations

from ..harness import Work, fill_timing, first_line, new_row
from .common import Context


def describe_lina(ctx: Context) -> list[str]:
    from .. import lina

    d = lina.DEFAULTS
    return [f"P=2 a2a {d['a2a_mb']:g} MB vs {d['grad_mb']:g} MB gradient, training step; fifo, lina {d['chunk_mb']} MB "
            "[bench.lina.run_lina, float32, gloo on CPU processes]"]


def run_lina_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.lina.run_lina`` (2 gloo ranks on CPU): the all-to-all alone and beside a gradient
    reduction (FIFO, Lina), and training steps with each; rows per variant."""
    from .. import lina

    if progress is not None:
        progress.step("lina P=2")
    reps = max(ctx.timer.reps // 2, 5) if ctx.timer is not None else lina.DEFAULTS["reps"]
    try:
        results = lina.run_lina(world_size=2, reps=reps, a2a_reps=max(ctx.timer.reps if ctx.timer else 0, 20),
                                timeout_s=max(ctx.ep_timeout_s, 120.0))
    except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
        row = new_row(suite="lina", case="P=2", mode="a2a", impl="lina", params={})
        row["status"], row["note"] = "error", first_line(exc)
        return [row]
    rows = []
    for d in results:
        params = {k: d.get(k) for k in ("world_size", "chunk_bytes", "a2a_bytes", "grad_bytes", "tokens", "d_model",
                                        "d_ffn", "num_experts", "top_k", "blocks") if d.get(k) is not None}
        params["dtype"] = "float32"
        a2a = d["bench"] == "a2a"
        row = new_row(suite="lina", case=f"P={d['world_size']} {'a2a beside a gradient reduction' if a2a else 'training step'}",
                      mode="a2a" if a2a else "fwd+bwd", impl=d["variant"], params=params)
        fill_timing(row, d["a2a_s"] if a2a else d["step_s"], Work(bytes=d["a2a_bytes"]) if a2a else Work(), None)
        row["extra"] = {k: d[k] for k in ("a2a_slowdown_median", "a2a_slowdown_p90", "a2a_overlap_frac",
                                          "step_speedup_vs_fifo", "grad_micro_ops") if d.get(k) is not None}
        rows.append(row)
    return rows


def describe_memory(ctx: Context) -> list[str]:
    from .. import memory_strategies as memory

    d = memory.DEFAULTS
    return [f"P=2 T/rank={d['tokens']} d={d['d_model']} f={d['d_ffn']} E={d['num_experts']} k={d['top_k']} "
            f"{d['activation']}, n in {d['degrees']}, strategies {', '.join(d['strategies'])} "
            f"with MI buffers {', '.join(str(m) for m in d['mi_buffers'])} (two from n = 3: impl +mi2) "
            "[bench.memory_strategies.run_memory, float32, gloo on CPU processes]"]


def run_memory_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.memory_strategies.run_memory`` (2 gloo ranks on CPU): per (degree, memory strategy), forward +
    backward time and the expert block's saved bytes (counted with saved_tensors_hooks) against
    "keep"."""
    from .. import memory_strategies as memory

    if progress is not None:
        progress.step("memory P=2")
    reps = max(ctx.timer.reps // 2, 3) if ctx.timer is not None else memory.DEFAULTS["reps"]
    try:
        results = memory.run_memory(world_size=2, reps=reps, timeout_s=max(ctx.ep_timeout_s, 180.0))
    except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
        row = new_row(suite="memory", case="P=2", mode="fwd+bwd", impl="keep", params={})
        row["status"], row["note"] = "error", first_line(exc)
        return [row]
    rows = []
    for d in results:
        params = {k: d[k] for k in ("world_size", "tokens", "d_model", "d_ffn", "num_experts", "top_k", "activation",
                                    "dtype")}
        params["pipeline_degree"] = d["n"]
        params["memory_mi_buffers"] = d["mi_buffers"]
        impl = d["strategy"] if d["mi_buffers"] == 1 else f"{d['strategy']}+mi{d['mi_buffers']}"
        row = new_row(suite="memory", case=f"P={d['world_size']} n={d['n']}", mode="fwd+bwd", impl=impl,
                      params=params)
        fill_timing(row, d["step_s"], Work(), None)
        row["extra"] = {k: d.get(k) for k in ("saved_bytes", "model_bytes", "host_bytes", "model_host_bytes",
                                              "time_vs_keep", "saved_vs_keep", "copy_s", "copy_hidden_frac")}
        rows.append(row)
    return rows


def describe_inference(ctx: Context) -> list[str]:
    return ["balance (E=16, P=16 and 4, Zipf max/min 5.56), estimation (correlated/uncorrelated stacks), offload "
            "(host, disk), latency in the simulator (16 GPUs) and on gloo (4 ranks), device expert bytes per rank and "
            "re-plan loads (gloo) [bench.inference.run_inference]"]


def _inference_extra(d: dict) -> dict:
    """The figures of one bench.inference dict, flat, for the row's note."""
    f = d["figure"]
    if f == "balance":
        m = d["max_over_mean"]
        out = {"max/mean": m["mean"], "max/mean_p95": m["p95"]}
        if d.get("replan_rate") is not None:
            out["replan_rate"] = d["replan_rate"]
        return out
    if f == "serving-memory":
        held = d["device_expert_bytes_per_rank"]
        return {"device_expert_bytes_max": max(held), "device_expert_bytes_min": min(held),
                "all_resident_bytes": d["all_resident_bytes"], "max_fraction_of_all": d["max_fraction_of_all"]}
    if f == "replan-load":
        if "bytes_per_forward" in d:
            return {"loads_per_forward_max": max(d["loads_per_forward"]), "bytes_per_forward_max": max(d["bytes_per_forward"]),
                    "seconds_per_forward_max": max(d["seconds_per_forward"]), "forward_p50_s": d["forward_p50_s"]}
        return {"max_bytes": d["max_bytes"], "all_resident_bytes": d["all_resident_bytes"],
                "seconds_median": d["seconds_median"], "seconds_max": d["seconds_max"]}
    keys = {"two-phase": ("replan_rate", "phase1_max_over_mean"),
            "latency-gloo": ("p50_s", "p95_s", "p50_speedup_vs_contiguous", "p95_speedup_vs_contiguous",
                             "max_rows_per_rank_mean"),
            "latency-sim": ("p50_s", "p95_s", "p50_speedup_vs_contiguous", "p95_speedup_vs_contiguous"),
            "estimation": ("l1_conditional", "l1_unconditional", "top2_accuracy_conditional",
                           "top2_accuracy_unconditional"),
            "offload": ("slowdown_vs_resident", "overlap_fraction", "resident_expert_bytes", "all_layers_bytes",
                        "disk_reads", "equal_to_resident")}.get(f, ())
    return {k: d[k] for k in keys if d.get(k) is not None}


def run_inference_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.inference.run_inference``: one row per figure (latency rows carry the times)."""
    from .. import inference

    if progress is not None:
        progress.step("inference")
    rows = []
    for d in inference.run_inference(timeout_s=max(ctx.ep_timeout_s, 300.0)):
        f = d["figure"]
        case = {"balance": "P={world_size} {placement}", "two-phase": "P={world_size} m={path_length}", "latency-gloo": "gloo P={world_size} {placement}",
                "latency-sim": "sim P={world_size} {placement}", "estimation": "{stack}",
                "offload": "{tier}", "serving-memory": "memory P={world_size} {placement}",
                "replan-load": "replan P={world_size} {change}"}.get(f, "{figure}")
        try:
            case = case.format(**d)
        except KeyError:
            case = f
        row = new_row(suite="inference", case=case, mode=f, impl=str(d.get("placement") or d.get("tier") or ("replan" if f == "replan-load" else "lina")),
                      params={k: v for k, v in d.items() if isinstance(v, (int, float, str)) and k in (
                          "world_size", "experts", "tokens", "tokens_per_rank", "d_model", "d_ffn", "layers", "slots")})
        if "error" in d:
            row["status"], row["note"] = "error", d["error"]
        elif d.get("times_s"):
            fill_timing(row, d["times_s"], Work(), None)
        elif "forward_s" in d:
            fill_timing(row, [d["forward_s"]], Work(), None)
        row["extra"] = _inference_extra(d)
        rows.append(row)
    return rows

