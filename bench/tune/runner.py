"""The sweep: compile and check candidates in worker processes, time them by successive
halving, write the table as it goes.

Per job (one target at one shape bucket, :mod:`bench.tune.space`):

1. the heuristic config (what the policy picks with no table: ``override("table", None)``) and
   up to ``max_candidates - 1`` others;
2. with ``workers`` > 0, a process pool (spawned; each worker imports torch and Triton once)
   launches every candidate once on the job's problem: Triton compiles there, in parallel,
   into the shared on-disk cache, and candidates that fail to compile (shared memory overflow,
   out of resources) are dropped before any timing (as many at a time as device memory allows);
3. the main process runs each remaining candidate once, with its outputs' memory poisoned, and
   checks it against the fp64 reference again (a wrong answer is never written to the table,
   whatever the workers said), recording the config that actually launched (after clamping;
   duplicates are dropped);
4. successive halving with the interleaved device timer (:data:`bench.tune.timer.MEASURE`):
   ``rounds`` rotated rounds of every survivor, the faster half (by median) goes on with twice
   the rounds, until one is left; then the winner and the heuristic run ``final_rounds`` more
   rounds together, and the entry records the median of the per-round ratios;
5. the entry (winner, its median / p20 / p80 time, rounds, the heuristic's time and the ratio,
   candidates tried, invalid ones with their reasons) is merged into the table file, written to
   a temporary file and renamed over it, so a run cut off at any point leaves a valid table.

``--resume`` skips the jobs the file already has (done or failed); without it they are measured
again and replaced. ``--budget-s`` stops before a stage that would start after the budget (the
job in progress is not written; ``--resume`` redoes it).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import triton

from tritonmoe.kernels import config as CF

from . import problems, space, timer
from .space import Job

__all__ = ["TuneOptions", "tune", "new_doc", "read_doc", "write_doc"]


class TuneOptions:
    """Knobs of a sweep (see :func:`tune`)."""

    def __init__(self, *, max_candidates: int = 24, rounds: int = 5, final_rounds: int = 30, workers: int = 0,
                 budget_s: Optional[float] = None, resume: bool = False, seed: int = 0) -> None:
        if max_candidates < 1 or rounds < 1 or final_rounds < 1 or workers < 0:
            raise ValueError("max_candidates, rounds and final_rounds must be >= 1 and workers >= 0")
        self.max_candidates = max_candidates
        self.rounds = rounds
        self.final_rounds = final_rounds
        self.workers = workers
        self.budget_s = budget_s
        self.resume = resume
        self.seed = seed


# ---------------------------------------------------------------------------------------------
# The table file
# ---------------------------------------------------------------------------------------------


def new_doc(device_name: str) -> dict:
    return {"format": CF.FORMAT, "device": device_name, "meta": _meta(), "entries": {}, "invalid": {}, "failed": {}}


def _meta() -> dict:
    return {"torch": torch.__version__, "triton": triton.__version__,
            "updated_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def read_doc(path: Path, device_name: str) -> dict:
    """The table at ``path`` to merge into, or a new one (a file that does not parse is kept
    aside as ``<path>.bad`` and a new table started)."""
    if not path.exists():
        return new_doc(device_name)
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != CF.FORMAT or not isinstance(doc.get("entries"), dict):
            raise ValueError("not a format-1 table")
    except ValueError:
        os.replace(path, str(path) + ".bad")
        return new_doc(device_name)
    for k in ("invalid", "failed"):
        doc.setdefault(k, {})
    return doc


def write_doc(path: Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file in the same folder, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc["meta"] = _meta()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _slot(doc: dict, section: str, job: Job) -> dict:
    return doc[section].setdefault(job.target, {}).setdefault(job.group, {})


def _has(doc: dict, job: Job) -> bool:
    b = str(job.bucket)
    return any(b in doc[s].get(job.target, {}).get(job.group, {}) for s in ("entries", "failed"))


# ---------------------------------------------------------------------------------------------
# Running and checking candidates
# ---------------------------------------------------------------------------------------------


def _launch(prob: problems.Problem, cfg: Any) -> Callable[[], Any]:
    target = prob.job.target

    def fn():
        with CF.override(target, cfg):
            return prob.run()

    return fn


def _checked_run(prob: problems.Problem, cfg: Any, device: torch.device) -> tuple[str, Any, str]:
    """Run ``cfg`` once (outputs' memory poisoned first) and check it -> (status, effective
    config or None, detail); status "ok", "wrong" or "error"."""
    problems.poison(prob.out_bytes * 2, device)
    try:
        with CF.recording() as ran:
            out = _launch(prob, cfg)()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - compile failures, out of resources: recorded, skipped
        return "error", None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    ok, detail = prob.check(out)
    eff = next((r.config for r in ran if r.target == prob.job.target), cfg)
    return ("ok" if ok else "wrong"), eff, detail


def _heuristic(prob: problems.Problem) -> Any:
    """The config the policy picks with no table and no override, as it launches."""
    with CF.override("table", None), CF.recording() as ran:
        prob.run()
    for r in ran:
        if r.target == prob.job.target:
            return r.config
    raise RuntimeError(f"{prob.job.target}: the problem's launch made no choice of this target")


# Worker processes: build the job's problem, launch the candidate once (Triton compiles it into
# its on-disk cache, which the main process then loads instead of compiling), free everything.
# No reference here: the main process checks every candidate itself.


def _worker_init(device_index: Optional[int]) -> None:
    os.environ["TRITONMOE_AUTOTUNE"] = "0"
    if device_index is not None:
        torch.cuda.set_device(device_index)


def _worker_compile(job: Job, cfg: Any, seed: int, device: str) -> tuple[str, str]:
    dev = torch.device(device)
    prob = problems.build(job, dev, seed)
    try:
        _launch(prob, cfg)()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return "ok", "compiled"
    except Exception as e:  # noqa: BLE001 - compile failures, out of resources: recorded, skipped
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        del prob
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _compile_in_pool(pool, workers: int, job: Job, cands: list, seed: int, device: torch.device,
                     per_task_bytes: int) -> dict:
    """Run every candidate once in the workers, at most as many at a time as the device memory
    allows (half the free memory over one problem's inputs and outputs) -> {index: (status,
    detail)}."""
    width = workers
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        width = max(1, min(width, int(0.5 * free // max(1, per_task_bytes))))
    res: dict = {}
    for lo in range(0, len(cands), width):
        futs = {i: pool.submit(_worker_compile, job, cands[i], seed, str(device))
                for i in range(lo, min(len(cands), lo + width))}
        for i, f in futs.items():
            try:
                res[i] = f.result()
            except Exception as e:  # noqa: BLE001 - a worker that died (e.g. a fault in a kernel)
                res[i] = ("error", f"worker: {type(e).__name__}: {e}")
    return res


def _pool(workers: int, device: torch.device) -> Optional[cf.ProcessPoolExecutor]:
    if workers <= 0:
        return None
    idx = device.index if device.type == "cuda" and device.index is not None else (0 if device.type == "cuda" else None)
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                  initargs=(idx,))


# ---------------------------------------------------------------------------------------------
# Successive halving
# ---------------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _halve(fns: list[Callable], opts: TuneOptions, device, deadline: float, log) -> Optional[int]:
    """Index of the fastest of ``fns`` by successive halving, or None when the budget ran out."""
    alive = list(range(len(fns)))
    r = opts.rounds
    while len(alive) > 1:
        if time.perf_counter() > deadline:
            return None
        times = timer.MEASURE([fns[i] for i in alive], device=device, rounds=r)
        med = {i: statistics.median(t) for i, t in zip(alive, times)}
        alive.sort(key=lambda i: med[i])
        alive = alive[: max(1, (len(alive) + 1) // 2)]
        log(f"    halving: {len(times)} -> {len(alive)} candidates ({r} rounds)")
        r *= 2
    return alive[0]


def _run_job(job: Job, prob: problems.Problem, pool, opts: TuneOptions, device, deadline: float, log):
    """-> (entry or None, invalid list, finished?)."""
    heur = _heuristic(prob)
    cands = space.candidates(job, heur, interpreter=device.type != "cuda", max_candidates=opts.max_candidates,
                             seed=opts.seed)
    invalid = []
    pre = {}
    if pool is not None:
        pre = _compile_in_pool(pool, opts.workers, job, cands, opts.seed, device, prob.in_bytes + 2 * prob.out_bytes)
    runnable, seen = [], set()
    for i, c in enumerate(cands):
        status, detail = pre.get(i, ("ok", ""))
        eff = c
        if status == "ok":
            status, eff, detail = _checked_run(prob, c, device)
        if status != "ok":
            invalid.append({"config": CF.config_dict(c), "status": status, "reason": detail})
            if i == 0:
                log(f"    the heuristic config failed its check: {detail}")
            continue
        key = json.dumps(CF.config_dict(eff), sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        runnable.append(eff)
    if time.perf_counter() > deadline:
        return None, invalid, False
    if not runnable:
        return None, invalid, True
    fns = [_launch(prob, c) for c in runnable]
    best = _halve(fns, opts, device, deadline, log)
    if best is None:
        return None, invalid, False
    heur_eff = runnable[0] if CF.config_dict(runnable[0]) == CF.config_dict(heur) else None
    pair = [fns[best]] + ([fns[0]] if heur_eff is not None and best != 0 else [])
    times = timer.MEASURE(pair, device=device, rounds=opts.final_rounds)
    t = times[0]
    entry = {"config": CF.config_dict(runnable[best]), "us": statistics.median(t) * 1e6,
             "p20_us": _pct(t, 0.2) * 1e6, "p80_us": _pct(t, 0.8) * 1e6, "rounds": len(t),
             "candidates": len(cands), "valid": len(runnable), "op": job.op, "layer": job.layer.name,
             "timer": "cuda-graph" if device.type == "cuda" else "interpreter (not a GPU time)"}
    if len(times) == 2:
        ratios = [a / b for a, b in zip(times[0], times[1]) if b > 0]
        entry["heuristic_us"] = statistics.median(times[1]) * 1e6
        entry["vs_heuristic"] = statistics.median(ratios) if ratios else None
        if entry["vs_heuristic"] is not None and entry["vs_heuristic"] > 1.0:
            # measured side by side, the halving's pick lost to the heuristic: the table keeps the
            # heuristic (never a config slower than what runs without a table)
            h = times[1]
            entry.update(config=CF.config_dict(runnable[0]), us=entry["heuristic_us"], p20_us=_pct(h, 0.2) * 1e6,
                         p80_us=_pct(h, 0.8) * 1e6, vs_heuristic=1.0, note="halving's pick was slower in the final rounds")
    elif heur_eff is not None:
        entry["heuristic_us"], entry["vs_heuristic"] = entry["us"], 1.0
    return entry, invalid, True


def tune(jobs: list[Job], out: Path, *, device: torch.device, device_name: str, opts: TuneOptions,
         log: Callable[[str], None] = print) -> dict:
    """Run ``jobs`` and merge their entries into the table at ``out`` (see the module
    docstring); returns the table document."""
    start = time.perf_counter()
    deadline = start + opts.budget_s if opts.budget_s is not None else float("inf")
    doc = read_doc(out, device_name)
    todo = [j for j in jobs if not (opts.resume and _has(doc, j))]
    log(f"tune: {len(todo)} of {len(jobs)} jobs to run -> {out}" + (" (resuming)" if opts.resume else ""))
    os.environ["TRITONMOE_AUTOTUNE"] = "0"  # candidates launch exactly as configured
    pool = _pool(opts.workers, device) if todo else None
    try:
        for n, job in enumerate(todo, 1):
            if time.perf_counter() > deadline:
                log(f"tune: budget spent after {n - 1} jobs; rerun with --resume to continue")
                break
            log(f"[{n}/{len(todo)}] {job.id} ({job.op}, {job.layer.name}, {job.dtype})")
            prob = problems.build(job, device, opts.seed)
            entry, invalid, finished = _run_job(job, prob, pool, opts, device, deadline, log)
            if not finished:
                log("tune: budget spent inside a job (not written); rerun with --resume to continue")
                break
            b = str(job.bucket)
            _slot(doc, "invalid", job)[b] = invalid
            if entry is None:
                _slot(doc, "failed", job)[b] = {"reason": "no candidate passed its check"}
                _slot(doc, "entries", job).pop(b, None)
            else:
                _slot(doc, "entries", job)[b] = entry
                _slot(doc, "failed", job).pop(b, None)
                log(f"    -> {entry['config']} {entry['us']:.2f} us"
                    + (f" (x{entry['vs_heuristic']:.3f} of the heuristic)" if entry.get("vs_heuristic") else ""))
            write_doc(out, doc)
            del prob
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return doc
