"""Regenerate the AOT tables of docs/kernels-aot.md: compile the persistent grouped-GEMM variants
of tests/test_aot_compile.py for sm_90a (no GPU needed) with this environment's Triton and,
optionally, with a second Triton install, and print the Markdown tables (```text blocks).

    python scripts/aot_table.py                                   # the installed Triton
    python scripts/aot_table.py --other /tmp/t36venv/lib/python3.11/site-packages
    python scripts/aot_table.py --filter "[persistent" --filter "[wide" > /tmp/aot.md

``--other`` is a site-packages directory holding another triton (e.g. ``pip install
triton==3.6.0`` into a separate venv): it is put first on PYTHONPATH of the compile subprocess,
which otherwise runs this interpreter (and its torch). Each compile runs in a subprocess without
TRITON_INTERPRET, as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = os.path.join(ROOT, "tests", "test_aot_compile.py")
DEFAULT_FILTERS = ("[persistent", "[wide")

COLUMNS = [
    ("variant", lambda r: r["name"]),
    ("regs", lambda r: str(r["registers"])),
    ("stack", lambda r: str(r["stack_bytes"])),
    ("loop spills", lambda r: str(r["loop_spills"])),
    ("shared KiB", lambda r: f"{r['shared'] / 1024:.1f}"),
    ("wgmma", lambda r: ",".join(s for s in r.get("mma_shapes", ())) or "-"),
    ("wait", lambda r: str(r["wgmma_wait_depth"])),
    ("bar (loop)", lambda r: f"{r['barriers']} ({r.get('main_loop_barriers', '?')})"),
    ("TMA ld/st", lambda r: f"{r['tma_loads']}/{r['tma_stores']}"),
]


def compile_records(filters: list[str], other: str | None) -> tuple[str, list[dict]]:
    """(triton version, JSON records) of one compile subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if other:
        env["PYTHONPATH"] = os.pathsep.join([other, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, TEST, *filters], env=env, capture_output=True, text=True, timeout=1800)
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return version, [r for r in recs if "name" in r]


def table(version: str, records: list[dict]) -> str:
    rows = [[h for h, _ in COLUMNS]]
    for r in records:
        rows.append([f(r) for _, f in COLUMNS] if r.get("ok") else [r["name"], "FAILED: " + r["error"][:60]])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(COLUMNS))]
    lines = [f"triton {version}, sm_90a"]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "```text\n" + "\n".join(lines) + "\n```\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--filter", action="append", help="variant name substrings (default: persistent and wide)")
    ap.add_argument("--other", help="site-packages of a second triton to compile with as well")
    ap.add_argument("--records", action="append", metavar="VERSION=FILE",
                    help="format saved compile output (JSON lines of tests/test_aot_compile.py) instead of compiling")
    args = ap.parse_args(argv)
    filters = args.filter or list(DEFAULT_FILTERS)
    out = []
    if args.records:
        for spec in args.records:
            version, path = spec.split("=", 1)
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.startswith("{")]
            recs = [r for r in recs if "name" in r and any(x in r["name"] for x in filters)]
            out.append(table(version, recs))
        print("\n".join(out))
        return 0
    for other in [None] + ([args.other] if args.other else []):
        version, recs = compile_records(filters, other)
        out.append(table(version, recs))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
