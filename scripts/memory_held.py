"""Bytes the MPMoE memory strategies hold between forward and backward, by the allocator's count.

Runs ``tests/_memory_cases.allocator_held`` (malloc's mallinfo2 counters around the forward, the
smaller of two warm passes, beside the saved-tensor hooks' count and the memory model) on 2
spawned gloo ranks and prints one table per rank. Defaults: the configuration of issue 35 (E=8,
d=256, f=512 SwiGLU, k=2, T=2048 tokens per rank, pipeline_degree=4, fp32); override with
``key=value`` (tokens, d_model, d_ffn, num_experts, top_k, n)::

    python scripts/memory_held.py
    python scripts/memory_held.py tokens=1024
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _dist import run_group, values_or_fail  # noqa: E402

import _memory_cases  # noqa: E402


def main(argv: list[str]) -> None:
    spec = {"tokens": 2048}
    for a in argv:
        k, v = a.split("=", 1)
        spec[k] = int(v)
    res, wall = run_group(2, _memory_cases.allocator_held, spec, deadline_s=900)
    MiB = 2 ** 20
    for r, v in enumerate(values_or_fail(res)):
        keep = v["allocator"]["keep"]
        print(f"rank {r} (rows received per micro-op {v['rows']}):")
        print("| strategy | held, malloc (MiB) | vs keep | block's saved storages after forward, hooks (MiB) "
              "| model: held + host (MiB) |")
        print("|---|---|---|---|---|")
        for s, b in v["allocator"].items():
            m = v["model"][s]
            print(f"| {s} | {b / MiB:.2f} | {b / keep:.3f}x | {v['hooks'][s] / MiB:.2f} | "
                  f"{(m['held'] + m['host']) / MiB:.2f} |")
    print(f"({wall:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
