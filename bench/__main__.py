"""First cut of the harness: MoELayer forward+backward against a per-expert torch loop."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tritonmoe as tm
from bench.baselines import per_expert_loop_moe

CONFIGS = {
    "small": dict(tokens=1024, d_model=256, d_ffn=512, num_experts=8, top_k=2),
    "medium": dict(tokens=4096, d_model=1024, d_ffn=2048, num_experts=16, top_k=2),
}


def _time(fn, reps: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device={device} dtype={dtype} torch={torch.__version__}")
    print(f"{'config':8} {'tritonmoe ms':>14} {'loop ms':>10} {'speedup':>8}")
    for name, c in CONFIGS.items():
        torch.manual_seed(0)
        cfg = tm.MoEConfig(c["d_model"], c["d_ffn"], c["num_experts"], c["top_k"])
        layer = tm.MoELayer(cfg, device=device, dtype=dtype)
        x = torch.randn(c["tokens"], c["d_model"], device=device, dtype=dtype, requires_grad=True)

        def run_layer():
            layer(x).sum().backward()

        def run_loop():
            per_expert_loop_moe(x, layer.router.weight, layer.w1, layer.w2, c["top_k"]).sum().backward()

        a = statistics.median(_time(run_layer, args.reps, args.warmup, device)) * 1e3
        b = statistics.median(_time(run_loop, args.reps, args.warmup, device)) * 1e3
        print(f"{name:8} {a:14.2f} {b:10.2f} {b / a:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
