"""The expert-parallel step's fixed cost per micro-op on CPU (``python -m bench.step_cost``).

One rank (gloo, this process) runs the pipelined ``MoELayer`` (backend "triton": Triton's
interpreter, which this command switches on) forward + backward at pipeline degrees 1, 2 and 4,
and counts, for one step each:

* ``launches``: Triton kernel launches (every ``*_kernel`` of ``tritonmoe.kernels`` wrapped by a
  counter), by kernel;
* ``aten_ops``: top-level ATen operator calls outside those launches (PyTorch profiler; the
  interpreter's own tensor ops inside a launch are left out), by operator.

The per-micro-op cost is the slope between degrees (what one more micro-op adds). On a GPU
every non-view ATen op is a kernel launch too (fills, copies, adds), so the slope of both counts
is the fixed cost the issue measured (13 launches, ~66 ATen ops per micro-op before issue 29).
:func:`bench.memory_strategies.diagnose_step` adds host syncs and device time on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import pkgutil

__all__ = ["measure"]


def measure(degrees=(1, 2, 4), tokens: int = 64, d_model: int = 32, d_ffn: int = 64, num_experts: int = 4,
            top_k: int = 2) -> dict:
    """Counts per degree and their per-micro-op slopes (TRITON_INTERPRET=1 must be set before
    triton is imported; initializes and destroys a one-rank gloo group)."""
    import torch
    import torch.distributed as dist
    import triton
    from torch.profiler import ProfilerActivity, profile

    import tritonmoe as tm
    import tritonmoe.kernels as K

    launches: collections.Counter = collections.Counter()

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches[self.name] += 1
                with torch.profiler.record_function("TRITON_LAUNCH"):
                    return self.kernel[grid](*args, **kwargs)
            return run

        def __getattr__(self, name):
            return getattr(self.kernel, name)

    patched = []
    for m in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"tritonmoe.kernels.{m.name}")
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.KernelInterface) and attr.endswith("_kernel"):
                setattr(mod, attr, Counted(attr, obj))
                patched.append((mod, attr, obj))

    def outside_launch(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name == "TRITON_LAUNCH":
                return False
            p = p.cpu_parent
        return True

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = {}
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d_model, generator=gen)
        g = torch.randn(tokens, d_model, generator=gen)
        for n in degrees:
            torch.manual_seed(0)
            cfg = tm.MoEConfig(d_model, d_ffn, num_experts, top_k, activation="swiglu", pipeline_degree=n,
                               backend="triton")
            layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD)

            def step():
                xi = x.clone().requires_grad_()
                (layer(xi) * g).sum().backward()

            step()  # compile / warm caches
            launches.clear()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            ops = collections.Counter(
                e.name for e in prof.events() if e.name.startswith("aten::") and outside_launch(e)
                and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
            rows[n] = dict(launches=dict(launches), aten_ops=dict(ops))
    finally:
        for mod, attr, obj in patched:
            setattr(mod, attr, obj)
        if created:
            dist.destroy_process_group()
    out = {"degrees": {n: {"launches": sum(r["launches"].values()), "aten_ops": sum(r["aten_ops"].values())}
                       for n, r in rows.items()}, "detail": rows}
    lo, hi = min(degrees), max(degrees)
    out["per_micro_op"] = {k: (out["degrees"][hi][k] - out["degrees"][lo][k]) / (hi - lo)
                           for k in ("launches", "aten_ops")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the counts here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        import subprocess
        import sys
        cmd = [sys.executable, "-m", "bench.step_cost"] + (["--json", a.json] if a.json else [])
        return subprocess.call(cmd, env=dict(os.environ, TRITON_INTERPRET="1"))
    res = measure()
    for n, r in res["degrees"].items():
        print(f"n={n}: {r['launches']} Triton launches, {r['aten_ops']} top-level ATen ops (outside launches)")
    pm = res["per_micro_op"]
    print(f"per micro-op: {pm['launches']:.1f} launches, {pm['aten_ops']:.1f} ATen ops")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
