"""``make gpu-tests`` / ``python -m bench gpu-tests``: the ``gpu``-marked tests as several
concurrent pytest processes on one GPU.

One pytest process runs the gpu tests one after another, and on a cold Triton cache nearly all
of their time is the JIT compilation of each kernel variant, which is single-threaded: the first
H100 run got through 23 of 87 tests in 210 s on a 16-core machine. Here the tests are collected
once (``pytest -m gpu --collect-only``), split into shards balanced by an estimate of each
test's time (longest first onto the least loaded shard), and every shard runs as its own pytest
process at the same time (compilation then uses the machine's cores; the GPU is shared, which
costs the tests nothing since none times itself). Standard library only (subprocess, timeouts).

* Isolation: a shard is a process (started in its own session, so the runner can kill it and
  whatever it started); a test that crashes its process (segfault, a CUDA error that poisons
  the context, a failed CUDA-graph capture) takes only its own shard down, and the tests of that
  shard that had not started yet are run again in a new shard if time is left.
* Hangs: a test running longer than ``--test-timeout-s`` has its shard killed (pytest's
  faulthandler dumps its stack into the shard log first); it is reported "timed out" and the
  shard's remaining tests go to a new shard.
* Stuck outside a test (collection, or at exit: a non-daemon thread, a process group's
  teardown): a shard with no test running that writes no event for ``idle_timeout_s`` is
  killed; its tests keep their results.
* One deadline (``--deadline-s``) for the whole run: shards still running then are killed; their
  test in progress reads "timed out", the ones not started "not run". No shard starts when less
  than ``MIN_START_S`` is left.
* Tests known to need a lot of GPU memory (:data:`HEAVY`) share one shard, so they never run at
  the same time.

Every shard writes one JSON line per test event through :mod:`bench._shard_plugin`, flushed as
it happens, so even a killed shard says which tests passed, failed or were running. The merged
summary (per test: status, shard, duration, message; per shard: its tests, wall time, exit
status, the tail of its output when it failed) is written as ``<prefix>.json`` and
``<prefix>.md`` (each shard's whole output in ``<prefix>-logs/``, or under the ignored
``bench/out/gpu-tests-logs/`` for a summary in ``bench/results/``), and printed.

Balancing estimates: measured durations from an earlier summary (``--estimates FILE``, or the
newest ``*-gpu-tests.json`` in the results directory, else in ``bench/results``), else
:data:`ESTIMATES`, else :data:`DEFAULT_ESTIMATE_S`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Shards by default: as many as 8, one core each at least.
DEFAULT_SHARDS = max(1, min(8, os.cpu_count() or 1))
#: The whole run's deadline by default (a device call may run 10 minutes; set-up comes first).
DEFAULT_DEADLINE_S = 480.0
#: A single test running longer than this is taken as hung (its shard is killed).
DEFAULT_TEST_TIMEOUT_S = 240.0
#: No shard starts when less than this is left before the deadline (imports and collection alone
#: take several seconds).
MIN_START_S = 20.0
#: Seconds the collection pass may take.
COLLECT_TIMEOUT_S = 180.0
#: Seconds between SIGTERM and SIGKILL when a shard is stopped.
KILL_GRACE_S = 5.0

#: Estimated seconds per test function on one H100 with a cold Triton cache ("file::function",
#: the parameters left out), from the first H100 run (23 tests in 210 s: the smoke test, the two
#: compile tests and 19 of the fused-FFN kernel tests) and the kernel variants each compiles.
ESTIMATES = {
    "tests/test_bench.py::test_gpu_smoke": 40.0,
    "tests/test_compile.py::test_gpu_compiled_layer_equals_eager": 45.0,
    "tests/test_ep.py::test_static_mode_captures_in_a_cuda_graph": 20.0,
    "tests/test_kernels_ffn.py::test_gpu_moe_ffn_matches_reference": 7.0,
    "tests/test_kernels_ffn.py::test_gpu_grouped_ffn_configs": 15.0,
    "tests/test_kernels_permute.py::test_gpu_realistic_shapes": 6.0,
    "tests/test_kernels_permute.py::test_gpu_large_index_math": 10.0,
    "tests/test_kernels_permute.py::test_gpu_sync_free_path": 6.0,
    "tests/test_kernels_permute.py::test_gpu_sync_free_permute_op": 6.0,
    "tests/test_kernels_permute.py::test_gpu_layer_runs_the_permute_kernels_on_its_unfused_path": 10.0,
    "tests/test_kernels_persistent.py::test_gpu_persistent_matches_reference_and_tile": 10.0,
    "tests/test_kernels_routing.py::test_gpu_canonical_values_bitwise": 5.0,
    "tests/test_kernels_routing.py::test_gpu_near_ties_select_identically": 4.0,
    "tests/test_kernels_routing.py::test_gpu_production_shapes": 4.0,
    "tests/test_kernels_routing.py::test_gpu_offsets_past_int32": 15.0,
    "tests/test_layer_kernels.py::test_layer_triton_bf16_on_gpu": 20.0,
    "tests/test_offload.py::test_cuda_ring_equals_resident": 15.0,
    "tests/test_ops_train.py::test_gpu_train_ops_equal_eager_kernels_bitwise": 20.0,
    "tests/test_replicated.py::test_cuda_hosted_slots_copy_stream": 10.0,
}
#: Seconds for a test the table does not know.
DEFAULT_ESTIMATE_S = 10.0
#: Test functions that allocate several GiB of GPU memory (2^31-element tensors): one shard.
HEAVY = frozenset({
    "tests/test_kernels_permute.py::test_gpu_large_index_math",
    "tests/test_kernels_routing.py::test_gpu_offsets_past_int32",
})

#: Per-test statuses, in the order summaries list them.
STATUSES = ("passed", "failed", "error", "crashed", "timed out", "skipped", "xfailed", "not run")
#: Statuses that make the run fail.
BAD = ("failed", "error", "crashed")


def function_of(nodeid: str) -> str:
    """The test function of a node id: ``file::name`` without the ``[parameters]``."""
    return nodeid.split("[", 1)[0]


def estimate_of(nodeid: str, measured: dict[str, float]) -> float:
    """Seconds expected for a test: measured earlier, else the table, else the default."""
    if nodeid in measured:
        return max(0.5, measured[nodeid])
    return ESTIMATES.get(function_of(nodeid), DEFAULT_ESTIMATE_S)


def plan_shards(ids: list[str], n: int, measured: Optional[dict[str, float]] = None,
                heavy: frozenset = HEAVY) -> list[list[str]]:
    """Split ``ids`` into at most ``n`` shards of balanced estimated time: the heavy tests all in
    shard 0, then longest first onto the least loaded shard. Inside a shard the tests keep their
    collection order (module fixtures are set up once per file). No empty shard."""
    measured = measured or {}
    n = max(1, min(n, len(ids)))
    order = {t: i for i, t in enumerate(ids)}
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for t in ids:
        if function_of(t) in heavy:
            shards[0].append(t)
            load[0] += estimate_of(t, measured)
    rest = sorted((t for t in ids if function_of(t) not in heavy), key=lambda t: (-estimate_of(t, measured), order[t]))
    for t in rest:
        i = min(range(n), key=lambda j: (load[j], j))
        shards[i].append(t)
        load[i] += estimate_of(t, measured)
    return [sorted(s, key=order.__getitem__) for s in shards if s]


def load_measured(path: Optional[str | Path]) -> dict[str, float]:
    """Per-test durations of an earlier summary (tests that passed, failed or were skipped)."""
    if not path:
        return {}
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {t["id"]: float(t["duration_s"]) for t in doc.get("tests", [])
            if t.get("status") in ("passed", "failed", "skipped", "xfailed") and t.get("duration_s") is not None}


def newest_summary(results_dir: str | Path) -> Optional[Path]:
    """The newest ``*-gpu-tests.json`` in ``results_dir``, else in the repository's
    ``bench/results`` (where a session commits them); None when there is none."""
    for d in (Path(results_dir), REPO_ROOT / "bench" / "results"):
        files = sorted(d.glob("*-gpu-tests.json"), key=lambda p: p.stat().st_mtime)
        if files:
            return files[-1]
    return None


# ---------------------------------------------------------------------------------------------
# Collection
# ---------------------------------------------------------------------------------------------


@dataclass
class Options:
    """What to run and how: ``root`` is pytest's working directory, ``paths`` what it collects,
    ``marker`` the -m expression, ``pytest_args`` extra arguments for every pytest call."""

    python: str = sys.executable
    root: Path = REPO_ROOT
    paths: tuple[str, ...] = ("tests",)
    marker: str = "gpu"
    pytest_args: tuple[str, ...] = ()
    shards: int = DEFAULT_SHARDS
    deadline_s: float = DEFAULT_DEADLINE_S
    test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_TEST_TIMEOUT_S
    min_start_s: float = MIN_START_S
    threads_per_shard: Optional[int] = None
    heavy: frozenset = HEAVY
    env: dict = field(default_factory=dict)


def _base_cmd(opt: Options) -> list[str]:
    cmd = [opt.python, "-m", "pytest", "-p", "no:cacheprovider"]
    if opt.marker:
        cmd += ["-m", opt.marker]
    return cmd + list(opt.pytest_args)


def _child_env(opt: Options, extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(opt.env)
    env.update(extra)
    return env


def collect(opt: Options, timeout_s: float) -> tuple[list[str], str]:
    """The node ids ``pytest -m <marker> --collect-only -q`` finds, and an error ("" if none).

    The ids come from :mod:`bench._shard_plugin`'s "collected" events (exact, whatever the
    verbosity or output: ``-- -v`` or ``-- -q`` change what ``--collect-only`` prints); the
    printed list is read only when the plugin wrote nothing."""
    import tempfile

    cmd = _base_cmd(opt) + ["-p", "bench._shard_plugin", "--collect-only", "-q", *opt.paths]
    with tempfile.TemporaryDirectory(prefix="tritonmoe-collect-") as tmp:
        events = Path(tmp) / "collect.events"
        try:
            proc = subprocess.run(cmd, cwd=opt.root, capture_output=True, text=True, timeout=timeout_s,
                                  env=_child_env(opt, {"TRITONMOE_SHARD_EVENTS": str(events)}))
        except subprocess.TimeoutExpired:
            return [], f"collection did not finish in {timeout_s:.0f} s"
        except OSError as exc:
            return [], f"collection could not start: {exc}"
        try:
            lines = events.read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
    out = proc.stdout + proc.stderr
    if "No module named pytest" in out:
        return [], "pytest is not installed"
    ids: list[str] = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("e") == "collected" and ev["id"] not in ids:
            ids.append(ev["id"])
    for line in ([] if lines else proc.stdout.splitlines()):  # the ids, one a line, up to the first blank or ==== line
        if not line.strip() or line.startswith("="):
            break  # (a warnings summary after it names node ids again)
        if "::" in line and not line.startswith(" ") and line.strip() not in ids:
            ids.append(line.strip())
    if proc.returncode == 5:  # nothing selected
        return [], ""
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        return ids, f"collection failed (pytest exit {proc.returncode}):\n{tail}"
    return ids, ""


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


@dataclass
class Shard:
    """One pytest process over ``ids``; ``label`` "3" or, for the rest of a shard that died,
    "3.1"."""

    label: str
    ids: list[str]
    estimate_s: float
    log_path: Path
    events_path: Path
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    ended: float = 0.0
    rc: Optional[int] = None
    stopped: str = ""  # "", "test timeout", "deadline"
    culprit: Optional[str] = None  # the test in progress when it was stopped or died
    retries: int = 0
    results: dict = field(default_factory=dict)  # its own tests' results once it ended

    def events(self) -> list[dict]:
        try:
            lines = self.events_path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
        return out

    def running(self, events: list[dict]) -> Optional[tuple[str, float]]:
        """(node id, start time) of the test in progress, from the events so far."""
        current = None
        for ev in events:
            if ev.get("e") == "start":
                current = (ev["id"], float(ev["t"]))
            elif ev.get("e") == "finish" and current and ev["id"] == current[0]:
                current = None
        return current

    def idle_s(self) -> float:
        """Seconds since the shard last wrote an event (or started: its events file is created
        then)."""
        try:
            return time.time() - self.events_path.stat().st_mtime
        except OSError:
            return 0.0

    def tail(self, lines: int = 40) -> str:
        """The end of the shard's output; where the faulthandler dumped a stack (a crash, or a
        test past pytest's faulthandler_timeout) the start of that dump, which names the
        test's innermost frames, and then the end."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
        except OSError:
            return ""
        marks = [i for i, line in enumerate(text) if line.startswith(("Fatal Python error", "Timeout ("))]
        if marks and marks[0] < len(text) - lines:
            head = text[marks[0]:marks[0] + lines // 2]
            return "\n".join(head + ["..."] + text[-(lines // 2):])
        return "\n".join(text[-lines:])


def _start(shard: Shard, opt: Options, now: float) -> None:
    threads = opt.threads_per_shard or max(1, (os.cpu_count() or 1) // max(1, opt.shards))
    timeout = max(1, int(opt.test_timeout_s) - 5)
    cmd = _base_cmd(opt) + ["-p", "bench._shard_plugin", "-o", f"faulthandler_timeout={timeout}", "-q",
                            *shard.ids]
    # each test phase's own limit (tests/_timeouts.py, armed by tests/conftest.py): fails the test
    # in its shard a little before the runner would kill the shard for it
    env = _child_env(opt, {"TRITONMOE_SHARD_EVENTS": str(shard.events_path), "OMP_NUM_THREADS": str(threads),
                           "PYTHONFAULTHANDLER": "1", "TRITONMOE_GPU_TEST_TIMEOUT_S": str(max(1, timeout - 5))})
    shard.events_path.write_text("")
    with open(shard.log_path, "w", encoding="utf-8") as log:
        log.write(f"# shard {shard.label}: {len(shard.ids)} tests, estimated {shard.estimate_s:.0f} s\n")
        log.write("# " + " ".join(cmd[:12]) + (" ..." if len(cmd) > 12 else "") + "\n")
        log.flush()
        shard.proc = subprocess.Popen(cmd, cwd=opt.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
    shard.started = now


def _stop(shard: Shard) -> None:
    """SIGTERM to the shard's process group, SIGKILL after the grace period; waits for it."""
    proc = shard.proc
    if proc is None:
        return
    if proc.poll() is not None:  # it exited on its own meanwhile: what it started may not have
        _kill_group(proc)
        return
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to what is left of a shard's process group (children that outlived pytest; the
    group keeps its id, which the kernel does not reuse while a member lives)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit(143) in the block (main thread only), so the runner's cleanup
    runs; the previous handler is restored after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _outcome(reports: list[dict]) -> tuple[str, str, float]:
    """(status, message, seconds) of a test from its phase reports."""
    status, msg = "passed", ""
    dur = sum(float(r.get("dur", 0.0)) for r in reports)
    for r in reports:
        if r["outcome"] == "failed":
            if r["when"] == "call":
                return "failed", r.get("msg", ""), dur
            status, msg = "error", f"{r['when']}: {r.get('msg', '')}"
        elif r["outcome"] == "skipped" and status == "passed":
            status, msg = ("xfailed" if r.get("xfail") else "skipped"), r.get("msg", "")
    return status, msg, dur


def _results_of(shard: Shard, events: list[dict]) -> tuple[dict[str, dict], list[str]]:
    """Per-test results of a finished shard, and its tests that never started."""
    reports: dict[str, list[dict]] = {}
    started: set[str] = set()
    collect_errors = [ev for ev in events if ev.get("e") == "collect_error"]
    for ev in events:
        if ev.get("e") == "start":
            started.add(ev["id"])
        elif ev.get("e") == "report":
            reports.setdefault(ev["id"], []).append(ev)
    results, unstarted = {}, []
    for t in shard.ids:
        rec = dict(id=t, shard=shard.label, duration_s=None, message="")
        if t == shard.culprit:
            failed = [r for r in reports.get(t, []) if r["outcome"] == "failed"]
            if failed:
                rec["status"], rec["message"], rec["duration_s"] = _outcome(reports[t])
            elif shard.stopped:
                rec["status"] = "timed out"
                rec["message"] = (f"killed after {shard.ended - shard.started:.0f} s of its shard ({shard.stopped})")
            else:
                rec["status"] = "crashed"
                rec["message"] = f"its shard's process died (exit status {shard.rc}) while it ran"
        elif t in reports:
            rec["status"], rec["message"], rec["duration_s"] = _outcome(reports[t])
        else:
            rec["status"] = "not run"
            if collect_errors and t not in started:
                rec["status"] = "error"  # its shard failed to collect it: pytest ran none of them
                rec["message"] = "collection error: " + collect_errors[0].get("msg", "")
            elif shard.stopped or shard.culprit:
                rec["message"] = f"its shard stopped before it ({shard.stopped or 'crashed'})"
            elif shard.rc not in (0, 1, 5) and not started:
                # pytest ran none of the shard's tests and says why in its log (a usage error,
                # "not found: <id>" for an id the collection pass had, or an internal error)
                rec["status"] = "error"
                rec["message"] = f"its shard exited (status {shard.rc}) before any test started (see its log)"
            else:
                rec["message"] = f"its shard exited (status {shard.rc}) without running it"
            if t not in started:
                unstarted.append(t)
        results[t] = rec
    return results, unstarted


#: Where shard logs go when the summary is written into the committed ``bench/results/``: an
#: ignored folder (results and their write-ups are committed, the shards' raw logs are not).
SHARD_LOGS_ROOT = REPO_ROOT / "bench" / "out" / "gpu-tests-logs"


def shard_logs_dir(out_prefix: str | Path) -> Path:
    """The shard logs' folder of a summary written to ``<out_prefix>.{json,md}``:
    ``<out_prefix>-logs/`` beside it, except for a summary in the repository's ``bench/results/``,
    whose logs go to ``bench/out/gpu-tests-logs/<name>-logs/`` (ignored by git)."""
    prefix = Path(out_prefix).absolute()
    if prefix.parent.resolve() == (REPO_ROOT / "bench" / "results").resolve():
        return SHARD_LOGS_ROOT / f"{prefix.name}-logs"
    return Path(f"{prefix}-logs")


def _log_dir(out_prefix: Optional[str | Path], logs_dir: Optional[str | Path]) -> Path:
    """The shard logs' folder, created: ``logs_dir``, else :func:`shard_logs_dir` of the prefix,
    else (no prefix) a temporary directory that is kept. Absolute: the shards' cwd is opt.root."""
    if logs_dir is not None:
        log_dir = Path(logs_dir).absolute()
    elif out_prefix is None:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="tritonmoe-gpu-tests-"))
    else:
        log_dir = shard_logs_dir(out_prefix)
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def _plan(opt: Options, ids: list[str], measured: dict[str, float], log_dir: Path,
          log: Callable[[str], None]) -> list[Shard]:
    """The shards to run, balanced by the measured (or estimated) durations."""
    pending: list[Shard] = []
    for i, s in enumerate(plan_shards(ids, opt.shards, measured, opt.heavy)):
        pending.append(Shard(str(i), s, sum(estimate_of(t, measured) for t in s),
                             log_dir / f"shard-{i}.log", log_dir / f"shard-{i}.events"))
        log(f"  shard {i}: {len(s)} tests, estimated {pending[-1].estimate_s:.0f} s")
    return pending


def _new_summary(opt: Options, log_dir: Path) -> dict:
    return dict(kind="tritonmoe gpu-tests", marker=opt.marker, paths=list(opt.paths),
                pytest_args=list(opt.pytest_args), shards_planned=0, jobs=opt.shards, deadline_s=opt.deadline_s,
                test_timeout_s=opt.test_timeout_s, logs=str(log_dir), collection="", tests=[], shards=[])


def run(opt: Options, out_prefix: Optional[str | Path] = None, log: Callable[[str], None] = print,
        measured: Optional[dict[str, float]] = None, clock: Callable[[], float] = time.monotonic,
        logs_dir: Optional[str | Path] = None) -> dict:
    """Collect, shard, run and merge (see the module docstring). Returns the summary dict;
    writes ``<out_prefix>.json`` / ``.md`` when ``out_prefix`` is given, and the shard logs to
    ``logs_dir``, by default :func:`shard_logs_dir` of the prefix (without a prefix, a temporary
    directory that is kept)."""
    t0 = clock()
    deadline = t0 + opt.deadline_s
    log_dir = _log_dir(out_prefix, logs_dir)
    summary = _new_summary(opt, log_dir)

    ids, error = collect(opt, min(COLLECT_TIMEOUT_S, max(1.0, opt.deadline_s - 1.0)))
    log(f"gpu-tests: collected {len(ids)} tests (-m {opt.marker!r}) in {clock() - t0:.0f} s"
        + (f"; {error.splitlines()[0]}" if error else ""))
    summary["collection"] = error
    if error and not ids:
        summary["status"] = "not run" if "not installed" in error else "failed"
        return _finish(summary, opt, t0, clock, out_prefix, log)

    measured = measured or {}
    pending = _plan(opt, ids, measured, log_dir, log)
    summary["shards_planned"] = len(pending)
    running: list[Shard] = []
    done: list[Shard] = []
    results: dict[str, dict] = {}

    def finish(shard: Shard) -> None:
        events = shard.events()
        if shard.culprit is None:
            # a test that started and never finished: the process died in it, whatever its exit
            # status (os._exit(1), LLVM's fatal errors exit 1: its setup report alone must not
            # read "passed")
            cur = shard.running(events)
            shard.culprit = cur[0] if cur else None
        res, unstarted = _results_of(shard, events)
        shard.results = res
        results.update(res)
        done.append(shard)
        counts = _counts(res.values())
        log(f"  shard {shard.label} {'stopped (' + shard.stopped + ')' if shard.stopped else 'exited ' + str(shard.rc)}"
            f" after {shard.ended - shard.started:.0f} s: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
        # the rest of a shard that died mid-test (or was killed for one hung test) runs again
        if shard.culprit and unstarted and shard.stopped != "deadline":
            if deadline - clock() >= opt.min_start_s:
                label = f"{shard.label.split('.')[0]}.{shard.retries + 1}"
                base = log_dir / f"shard-{label}"
                pending.append(Shard(label, unstarted, sum(estimate_of(t, measured) for t in unstarted),
                                     Path(f"{base}.log"), Path(f"{base}.events"), retries=shard.retries + 1))
                log(f"  shard {label}: the {len(unstarted)} tests shard {shard.label} had not started")

    # A shard runs in its own session (so it can be killed with what it started): an interrupt
    # (Ctrl-C, or SIGTERM from a device call's time limit) does not reach it, so the runner stops
    # the running shards itself before it goes.
    try:
        with _sigterm_as_exit():
            while pending or running:
                now = clock()
                while pending and len(running) < opt.shards and deadline - now >= opt.min_start_s:
                    shard = pending.pop(0)
                    _start(shard, opt, now)
                    running.append(shard)
                if not running:
                    break  # what is pending cannot start before the deadline
                if now >= deadline:
                    for shard in running:
                        shard.stopped = "deadline"
                        cur = shard.running(shard.events())
                        shard.culprit = cur[0] if cur else None
                        _stop(shard)
                        shard.ended, shard.rc = clock(), shard.proc.returncode
                        finish(shard)
                    running = []
                    break
                for shard in list(running):
                    rc = shard.proc.poll()
                    if rc is not None:
                        _kill_group(shard.proc)  # what its tests started and left running
                        shard.ended, shard.rc = clock(), rc
                        running.remove(shard)
                        finish(shard)
                        continue
                    cur = shard.running(shard.events())
                    if cur is not None and time.time() - cur[1] > opt.test_timeout_s:
                        shard.stopped = f"test timeout {opt.test_timeout_s:.0f} s"
                        shard.culprit = cur[0]
                    elif cur is None and shard.idle_s() > opt.idle_timeout_s:
                        # no test running and no event for that long: stuck in collection or at
                        # exit (a non-daemon thread, a process group's teardown)
                        shard.stopped = f"no test running for {opt.idle_timeout_s:.0f} s"
                    if shard.stopped:
                        _stop(shard)
                        shard.ended, shard.rc = clock(), shard.proc.returncode
                        running.remove(shard)
                        finish(shard)
                time.sleep(0.2)
    except BaseException:
        for shard in running:
            _stop(shard)
        raise
    for shard in pending:  # never started: the deadline came first
        for t in shard.ids:
            results[t] = dict(id=t, shard=shard.label, status="not run", duration_s=None,
                              message="the deadline came before its shard could start")
        done.append(shard)

    summary["tests"] = [results[t] for t in ids if t in results]
    done.sort(key=lambda sh: tuple(int(x) for x in sh.label.split(".")))
    summary["shards"] = [_shard_record(s, results) for s in done]
    counts = _counts(summary["tests"])
    if any(counts[k] for k in BAD) or error:
        summary["status"] = "failed"
    elif counts["timed out"] or counts["not run"]:
        summary["status"] = "timed out"
    else:
        summary["status"] = "passed"
    return _finish(summary, opt, t0, clock, out_prefix, log)


def _counts(tests) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for t in tests:
        counts[t["status"]] += 1
    return counts


def _shard_record(shard: Shard, results: dict[str, dict]) -> dict:
    counts = _counts(shard.results.values() if shard.results else [results[t] for t in shard.ids if t in results])
    bad = any(counts[k] for k in BAD + ("timed out",)) or (shard.rc not in (None, 0, 1, 5))
    if shard.proc is None:
        status = "not started"
    elif shard.stopped:
        status = "stopped: " + shard.stopped
    elif shard.culprit:
        status = f"crashed (exit status {shard.rc})"
    else:
        status = f"exited {shard.rc}"
    return dict(label=shard.label, tests=len(shard.ids), estimate_s=round(shard.estimate_s, 1),
                wall_s=round(max(0.0, shard.ended - shard.started), 1) if shard.proc else 0.0, rc=shard.rc,
                status=status, counts={k: n for k, n in counts.items() if n}, log=str(shard.log_path),
                tail=shard.tail() if bad else "")


def _finish(summary: dict, opt: Options, t0: float, clock, out_prefix, log) -> dict:
    summary["wall_s"] = round(clock() - t0, 1)
    counts = _counts(summary["tests"])
    summary["counts"] = counts
    summary["summary"] = (", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no tests") + \
        f" in {summary['wall_s']:.0f} s ({len(summary['shards'])} shards)"
    if summary["collection"] and not summary["tests"]:
        summary["summary"] = summary["collection"].splitlines()[0]
    summary["failing"] = [t for t in summary["tests"] if t["status"] in BAD + ("timed out", "not run")]
    if out_prefix is not None:
        Path(f"{out_prefix}.json").parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{out_prefix}.json.tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(f"{out_prefix}.json")
        Path(f"{out_prefix}.md").write_text(render_markdown(summary))
        summary["files"] = [f"{out_prefix}.json", f"{out_prefix}.md", summary["logs"]]
    for line in render_text(summary):
        log(line)
    return summary


def render_text(summary: dict, max_tests: int = 25) -> list[str]:
    """The summary for a terminal: the counts, then each test that did not pass (status, shard,
    message), then the tail of each failing shard's output."""
    out = [f"gpu-tests: {summary['status']}: {summary['summary']}"]
    failing = summary.get("failing") or []
    for t in failing[:max_tests]:
        out.append(f"  {t['status']:<9} [shard {t['shard']}] {t['id']}" + (f": {t['message'][:160]}" if t["message"] else ""))
    if len(failing) > max_tests:
        out.append(f"  ... and {len(failing) - max_tests} more (see the summary file)")
    if summary.get("collection"):
        out += ["  " + line for line in summary["collection"].splitlines()[-15:]]
    for s in summary["shards"]:
        if s["tail"]:
            out.append(f"  --- shard {s['label']} ({s['status']}), last lines of {s['log']}:")
            tail = s["tail"].splitlines()
            out += ["  | " + line for line in (tail[:8] + ["..."] + tail[-8:] if len(tail) > 17 else tail)]
    return out


def render_markdown(summary: dict) -> str:
    out = ["# tritonmoe gpu-tests", "",
           f"- status: **{summary['status']}**: {summary['summary']}",
           f"- `pytest -m {summary['marker']}` over {', '.join(summary['paths'])}"
           + (f" with {' '.join(summary['pytest_args'])}" if summary["pytest_args"] else "")
           + f"; up to {summary['jobs']} shards at once, deadline {summary['deadline_s']:.0f} s, "
           f"a test hung after {summary['test_timeout_s']:.0f} s; logs in `{summary['logs']}`", ""]
    if summary.get("collection"):
        out += ["## Collection", "", "```", summary["collection"], "```", ""]
    out += ["## Shards", "", "| shard | tests | est. s | wall s | status | outcome |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for s in summary["shards"]:
        outcome = ", ".join(f"{n} {k}" for k, n in s["counts"].items())
        out.append(f"| {s['label']} | {s['tests']} | {s['estimate_s']:.0f} | {s['wall_s']:.0f} | {s['status']} | {outcome} |")
    out += ["", "## Tests", "", "| test | status | shard | s | message |", "| --- | --- | --- | ---: | --- |"]
    for t in summary["tests"]:
        dur = "" if t["duration_s"] is None else f"{t['duration_s']:.1f}"
        msg = (t["message"] or "").replace("|", "\\|").replace("\n", " ")[:200]
        out.append(f"| `{t['id']}` | {t['status']} | {t['shard']} | {dur} | {msg} |")
    tails = [s for s in summary["shards"] if s["tail"]]
    if tails:
        out += ["", "## Output of the shards that failed", ""]
        for s in tails:
            out += [f"### shard {s['label']} ({s['status']})", "", "```", s["tail"], "```", ""]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench gpu-tests", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every pytest call (e.g. -- -k routing -x).")
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS, help=f"concurrent pytest processes (default {DEFAULT_SHARDS})")
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help=f"wall time of the whole run (default {DEFAULT_DEADLINE_S:.0f})")
    p.add_argument("--test-timeout-s", type=float, default=DEFAULT_TEST_TIMEOUT_S,
                   help=f"a test running longer is taken as hung (default {DEFAULT_TEST_TIMEOUT_S:.0f})")
    p.add_argument("--marker", default="gpu", help="pytest -m expression (default gpu)")
    p.add_argument("--root", default=str(REPO_ROOT), help="pytest's working directory (default the repository)")
    p.add_argument("--paths", default="tests", help="comma-separated paths to collect, relative to --root")
    p.add_argument("--results-dir", default="bench/results", metavar="DIR",
                   help="write <gpu>-<date>-gpu-tests.{json,md} and the shard logs here")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.json, PREFIX.md, PREFIX-logs/ instead")
    p.add_argument("--logs-dir", metavar="DIR", help="write the shard logs here (default: PREFIX-logs/ beside the "
                   "summary, or bench/out/gpu-tests-logs/ for a summary in bench/results, which keeps no logs)")
    p.add_argument("--estimates", metavar="FILE", help="an earlier summary whose durations balance the shards "
                   "(default: the newest *-gpu-tests.json in --results-dir, else in bench/results)")
    p.add_argument("--without-cuda", action="store_true",
                   help="run even without a CUDA device (the gpu tests then skip; to try the runner)")
    return p


def _default_prefix(results_dir: str) -> str:
    """``<results-dir>/<gpu>-<date>-gpu-tests`` (the name gpu-check's files get)."""
    import datetime

    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    # a stem whose gpu-check result (<stem>.json) exists belongs to an earlier run: never file
    # these tests under it, so that the check run beside them gets the same stem
    return free_stem(Path(results_dir) / f"{slug}-{date}", tails=("", "-gpu-tests")) + "-gpu-tests"


def free_stem(base: Path, tails: tuple[str, ...] = ("",)) -> str:
    """``<base>``, or ``<base>-2``, ``-3``, ... : the first where no ``<stem><tail>.json`` exists
    for any of ``tails``, so that a second run on the same day (another commit, a later session)
    does not overwrite the first one's files. ``bench check`` asks with ``("",)`` (a stem that
    has only the tests' file is the one a ``make gpu-tests`` just before it wrote: its own
    run); ``bench gpu-tests`` with ``("", "-gpu-tests")``."""
    n = 1
    while True:
        stem = f"{base}{'' if n == 1 else f'-{n}'}"
        if not any(Path(f"{stem}{t}.json").exists() for t in tails):
            return stem
        n += 1


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if not args.without_cuda:
        import torch

        if not torch.cuda.is_available():
            print("CPU MODE: no CUDA device: the gpu-marked tests would all be skipped, nothing run "
                  "(`make test` runs the CPU suite; --without-cuda runs this anyway).")
            return 0
    opt = Options(root=Path(args.root), paths=tuple(p for p in args.paths.split(",") if p), marker=args.marker,
                  pytest_args=tuple(extra), shards=max(1, args.shards), deadline_s=args.deadline_s,
                  test_timeout_s=args.test_timeout_s, idle_timeout_s=args.test_timeout_s)
    prefix = args.out or _default_prefix(args.results_dir)
    est = args.estimates or newest_summary(Path(prefix).parent)
    measured = load_measured(est)
    if measured:
        print(f"gpu-tests: balancing with the durations measured in {est}")
    summary = run(opt, out_prefix=prefix, measured=measured, logs_dir=args.logs_dir)
    print(f"gpu-tests: {prefix}.json, {prefix}.md, logs in {summary['logs']}")
    return 0 if summary["status"] == "passed" else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
