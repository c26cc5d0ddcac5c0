"""Host overhead of the launchers: CPU microseconds that tritonmoe's own Python spends around
each Triton launch (``python -m bench host``).

Every ``@triton.jit`` kernel of the launcher modules is replaced by a stub that counts the
launch and does nothing, and the public op is called in a loop on CPU tensors (Triton's
interpreter mode, so the dispatch takes the Triton launcher without a GPU). The figure is the
calling thread's CPU time per call (``time.thread_time``: other processes on the machine do not
inflate it), the minimum over 5 rounds. What it leaves out: Triton's own launcher (argument
binding, the kernel-cache lookup, the driver call), which this measurement cannot see, and the
device work. Only ops whose host code reads no kernel output are measured (the router), since
stubbed kernels write nothing.

Use it to see what a change to the launcher's Python costs or saves; on a GPU the time a
host-bound op takes is this plus Triton's launcher per launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

__all__ = ["main", "measure"]

CASES = (
    ("route softmax T=4096 E=128 k=8", dict(T=4096, E=128, k=8, kw={})),
    ("route sigmoid+bias 8 groups/4 E=256 k=8", dict(T=4096, E=256, k=8,
                                                     kw=dict(score_func="sigmoid", n_groups=8, topk_groups=4),
                                                     bias=True)),
    ("route softmax capacity T=4096 E=64 k=2", dict(T=4096, E=64, k=2, kw=dict(capacity=160))),
)


def measure(calls: int = 2000, rounds: int = 5) -> list[dict]:
    """Run in this process (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import importlib
    import time

    import torch
    import triton

    import tritonmoe as tm

    launches = [0]

    class _Stub:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches[0] += 1

            return run

    for name in ("routing", "permute", "grouped_gemm", "partition", "_grouped_gemm_persistent"):
        mod = importlib.import_module(f"tritonmoe.kernels.{name}")
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.KernelInterface):
                setattr(mod, attr, _Stub(obj))
    out = []
    with tm.validation(False):
        for label, c in CASES:
            x = torch.randn(c["T"], c["E"])
            bias = torch.zeros(c["E"]) if c.get("bias") else None

            def call():
                return tm.route(x, c["k"], expert_bias=bias, backend="triton", **c["kw"])

            for _ in range(200):
                call()
            launches[0] = 0
            per_call = []
            for _ in range(rounds):
                t0 = time.thread_time()
                for _ in range(calls):
                    call()
                per_call.append((time.thread_time() - t0) / calls)
            out.append(dict(case=label, host_us=1e6 * min(per_call), host_us_median=1e6 * sorted(per_call)[rounds // 2],
                            launches_per_call=launches[0] / (rounds * calls)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench host", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.calls < 1:
        p.error(f"--calls {a.calls}: need at least 1 call per round")
    if not a.in_process:  # the stubs and the interpreter need a fresh process
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "bench.host", "--in-process", "--calls", str(a.calls)]
        if a.json:
            cmd += ["--json", a.json]
        return subprocess.call(cmd, env=env)
    rows = measure(a.calls)
    print(f"{'case':45s} {'host us/call':>12s} {'median':>8s} {'launches':>8s}")
    for r in rows:
        print(f"{r['case']:45s} {r['host_us']:12.1f} {r['host_us_median']:8.1f} {r['launches_per_call']:8.0f}")
    print("(tritonmoe's Python around the launches, thread CPU time; Triton's own launcher is not included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
