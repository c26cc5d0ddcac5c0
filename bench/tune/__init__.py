"""``python -m bench tune``: sweep the kernels' configs per shape bucket into the tuned table of
this device, ``kernels/configs/<device name>.json`` (see docs/tuning.md).

  python -m bench tune [--preset P,...] [--ops gemm1,gemm2,...] [--dtype bf16]
                       [--gemm-buckets 256,4096] [--token-buckets ...] [--decode-buckets ...]
                       [--max-candidates 24] [--rounds 5] [--final-rounds 30]
                       [--workers 16] [--budget-s 300] [--resume] [--out FILE] [--dry-run]

Modules: :mod:`.space` (jobs and candidates), :mod:`.problems` (inputs, launch, fp64
reference), :mod:`.timer` (the interleaved CUDA-graph timer), :mod:`.runner` (workers,
successive halving, the table file).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from tritonmoe.kernels import config as CF

from ..presets import PRESETS
from . import space
from .runner import TuneOptions, tune

__all__ = ["main", "build_parser"]

#: Presets tuned when --preset is not given (issue 16's two targets first).
DEFAULT_PRESETS = ("mixtral-8x7b-like", "qwen3-30b-a3b-like")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _names(choices):
    def parse(text: str) -> list[str]:
        vals = [t.strip() for t in text.split(",") if t.strip()]
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return vals

    return parse


def _layer(text: str) -> space.Layer:
    """``E=8,D=256,F=512,k=2[,act=swiglu][,G=1]`` -> a Layer named ``custom``."""
    try:
        kv = dict(p.split("=", 1) for p in text.split(","))
        return space.Layer("custom", int(kv["E"]), int(kv["D"]), int(kv["F"]), int(kv["k"]), kv.get("act", "swiglu"),
                           int(kv.get("G", 1)))
    except (KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--layer wants E=..,D=..,F=..,k=..[,act=..][,G=..], got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", type=_names(tuple(PRESETS)), default=None,
                   help=f"layer presets (default: {', '.join(DEFAULT_PRESETS)})")
    p.add_argument("--layer", type=_layer, action="append", default=[],
                   help="a custom layer E=..,D=..,F=..,k=..[,act=..][,G=..] (repeatable)")
    p.add_argument("--ops", type=_names(space.OPS), default=list(space.OPS), help="ops to tune (default: all)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--gemm-buckets", type=_ints, default=None, help=f"rows per expert (default {space.GEMM_BUCKETS})")
    p.add_argument("--token-buckets", type=_ints, default=None, help=f"permute/route tokens ({space.TOKEN_BUCKETS})")
    p.add_argument("--decode-buckets", type=_ints, default=None, help=f"decode tokens ({space.DECODE_BUCKETS})")
    p.add_argument("--max-candidates", type=int, default=24, help="candidates per job, the heuristic included")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the first halving stage (doubling)")
    p.add_argument("--final-rounds", type=int, default=30, help="rounds of the winner against the heuristic")
    p.add_argument("--workers", type=int, default=None,
                   help="compile/check worker processes (default: min(16, CPUs) on a GPU, 0 on CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting work after this many seconds")
    p.add_argument("--resume", action="store_true", help="skip the jobs the table already has")
    p.add_argument("--out", type=Path, default=None, help="table file (default kernels/configs/<device>.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="list the jobs and candidate counts, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = CF.device_name(device) if cuda else "cpu_interpreter"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("tune: no CUDA device; set TRITON_INTERPRET=1 to exercise the tuner in the interpreter "
              "(its times are not GPU times)")
        return 2
    presets = list(args.layer) + list(args.preset or ([] if args.layer else DEFAULT_PRESETS))
    buckets = {k: v for k, v in (("gemm", args.gemm_buckets), ("tokens", args.token_buckets),
                                 ("decode", args.decode_buckets)) if v}
    jobs = space.jobs_for(presets, args.ops, args.dtype, buckets=buckets)
    if args.out is None and not cuda and not args.dry_run:
        print("tune: in the interpreter give --out FILE (kernels/configs/ holds GPU tables only)")
        return 2
    out = args.out or CF.table_path(name)
    if args.dry_run:
        for j in jobs:
            print(j.id, j.op, j.layer.name)
        print(f"{len(jobs)} jobs -> {out}")
        return 0
    workers = args.workers if args.workers is not None else (min(16, os.cpu_count() or 1) if cuda else 0)
    opts = TuneOptions(max_candidates=args.max_candidates, rounds=args.rounds, final_rounds=args.final_rounds,
                       workers=workers, budget_s=args.budget_s, resume=args.resume, seed=args.seed)
    doc = tune(jobs, out, device=device, device_name=name, opts=opts)
    n = sum(len(b) for g in doc["entries"].values() for b in g.values())
    print(f"tune: {out} holds {n} entries")
    return 0
