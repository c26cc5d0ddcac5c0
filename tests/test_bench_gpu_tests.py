"""``python -m bench gpu-tests`` (make gpu-tests; the tests part of make gpu-check): the gpu
tests as concurrent pytest shards.

The runner is exercised for real on a small fake test directory (no torch in it, so each shard
starts in about a second): passing, failing, skipped and parametrized tests, a test that
segfaults its process, one that hangs past the per-test timeout, one still running at the
overall deadline, and a file that fails to collect. The summary must say what happened to every
test and in which shard, and the tests a crash or hang left unstarted must run in a new shard.
"""

from __future__ import annotations

import json
import time

import pytest

from bench import check
from bench import gpu_tests as GT

PYTEST_INI = "[pytest]\nmarkers =\n    gpu: fake gpu tests\n"

FILES = {
    "test_a.py": '''
import pytest
pytestmark = pytest.mark.gpu

def test_pass():
    pass

def test_fail():
    assert 1 == 2, "boom"

def test_skip():
    pytest.skip("no device here")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_setup_error(broken):
    pass

@pytest.mark.parametrize("i", range(3))
def test_param(i):
    pass
''',
    # one shard (HEAVY below): a crash, then a hang, each followed by tests that must still run
    "test_b.py": '''
import os, signal, time, pytest
pytestmark = pytest.mark.gpu

def test_before():
    pass

def test_crash():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_after_crash():
    pass

def test_hang():
    time.sleep(120)

def test_after_hang():
    pass
''',
    "test_cpu.py": '''
def test_unmarked():
    pass
''',
}
B_TESTS = ("test_before", "test_crash", "test_after_crash", "test_hang", "test_after_hang")


def _fake_tree(tmp_path, files):
    root = tmp_path / "fake"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text(PYTEST_INI)
    for name, text in files.items():
        (root / "tests" / name).write_text(text)
    return root


def test_plan_shards_balances_and_keeps_heavy_together():
    ids = [f"tests/t.py::test_{i}" for i in range(20)] + ["tests/h.py::test_big[0]", "tests/h.py::test_big[1]"]
    measured = {f"tests/t.py::test_{i}": float(1 + i % 7) for i in range(20)}
    heavy = frozenset({"tests/h.py::test_big"})
    shards = GT.plan_shards(ids, 4, measured, heavy)
    assert sorted(t for s in shards for t in s) == sorted(ids)  # each test exactly once
    assert set(ids[-2:]) <= set(shards[0])  # the heavy ones together, in shard 0
    order = {t: i for i, t in enumerate(ids)}
    assert all(s == sorted(s, key=order.__getitem__) for s in shards)  # collection order inside a shard
    loads = [sum(GT.estimate_of(t, measured) for t in s) for s in shards]
    assert max(loads) - min(loads) <= 7.0  # longest first: within the largest single estimate
    assert len(GT.plan_shards(ids[:3], 8)) == 3  # no empty shard
    assert GT.estimate_of("tests/test_kernels_ffn.py::test_gpu_grouped_ffn_configs[4-x]", {}) == \
        GT.ESTIMATES["tests/test_kernels_ffn.py::test_gpu_grouped_ffn_configs"]
    assert GT.estimate_of("tests/unknown.py::test_x", {}) == GT.DEFAULT_ESTIMATE_S


def test_runner_reports_every_test_through_crash_and_hang(tmp_path):
    root = _fake_tree(tmp_path, FILES)
    heavy = frozenset(f"tests/test_b.py::{n}" for n in B_TESTS)
    opt = GT.Options(root=root, shards=3, test_timeout_s=4, min_start_s=1, deadline_s=90, heavy=heavy)
    lines = []
    t0 = time.monotonic()
    s = GT.run(opt, out_prefix=tmp_path / "out" / "sum", log=lines.append)
    assert time.monotonic() - t0 < 60
    by_id = {t["id"]: t for t in s["tests"]}
    want = {
        "tests/test_a.py::test_pass": "passed", "tests/test_a.py::test_fail": "failed",
        "tests/test_a.py::test_skip": "skipped", "tests/test_a.py::test_xfail": "xfailed",
        "tests/test_a.py::test_setup_error": "error",
        **{f"tests/test_a.py::test_param[{i}]": "passed" for i in range(3)},
        "tests/test_b.py::test_before": "passed", "tests/test_b.py::test_crash": "crashed",
        "tests/test_b.py::test_after_crash": "passed", "tests/test_b.py::test_hang": "timed out",
        "tests/test_b.py::test_after_hang": "passed",
    }
    assert {k: v["status"] for k, v in by_id.items()} == want  # the unmarked test was not collected
    assert by_id["tests/test_a.py::test_fail"]["message"] == "AssertionError: boom"
    assert "no device here" in by_id["tests/test_a.py::test_skip"]["message"]
    assert "fixture broke" in by_id["tests/test_a.py::test_setup_error"]["message"]
    assert "exit status -11" in by_id["tests/test_b.py::test_crash"]["message"]
    assert "test timeout 4 s" in by_id["tests/test_b.py::test_hang"]["message"]
    # the crash's shard, then a new shard for what it had not started, then one after the hang
    assert by_id["tests/test_b.py::test_crash"]["shard"] == "0"
    assert by_id["tests/test_b.py::test_after_crash"]["shard"] == by_id["tests/test_b.py::test_hang"]["shard"] == "0.1"
    assert by_id["tests/test_b.py::test_after_hang"]["shard"] == "0.2"
    assert s["status"] == "failed" and s["counts"]["passed"] == 7 and s["counts"]["crashed"] == 1
    shards = {r["label"]: r for r in s["shards"]}
    assert shards["0"]["status"] == "crashed (exit status -11)" and shards["0"]["counts"] == {
        "passed": 1, "crashed": 1, "not run": 3}
    assert shards["0.1"]["status"] == "stopped: test timeout 4 s"
    assert shards["0.2"]["status"] == "exited 0" and not shards["0.2"]["tail"]
    # the tails say where: the faulthandler's dump names the test's frame
    assert "Fatal Python error" in shards["0"]["tail"] and "in test_crash" in shards["0"]["tail"]
    assert "Timeout" in shards["0.1"]["tail"] and "in test_hang" in shards["0.1"]["tail"]
    failing = {t["id"] for t in s["failing"]}
    assert failing == {k for k, v in want.items() if v in ("failed", "error", "crashed", "timed out")}
    # files: the summary (JSON and markdown) and each shard's whole log
    doc = json.loads((tmp_path / "out" / "sum.json").read_text())
    assert doc["status"] == "failed" and len(doc["tests"]) == len(want)
    md = (tmp_path / "out" / "sum.md").read_text()
    assert "| `tests/test_b.py::test_crash` | crashed | 0 |" in md and "## Output of the shards that failed" in md
    assert sorted(p.name for p in (tmp_path / "out" / "sum-logs").glob("*.log")) == [
        "shard-0.1.log", "shard-0.2.log", "shard-0.log", "shard-1.log", "shard-2.log"]
    assert any("crashed   [shard 0] tests/test_b.py::test_crash" in line for line in lines)
    # the record gpu-check keeps
    rec = check.tests_record(s)
    assert rec["status"] == "failed" and rec["shards"] == 5 and len(rec["failing"]) == 4
    assert rec["files"][:2] == [str(tmp_path / "out" / "sum.json"), str(tmp_path / "out" / "sum.md")]


def test_deadline_stops_the_run_and_says_what_did_not_run(tmp_path):
    """A test still running at the deadline reads "timed out", the rest of its shard "not run";
    the status is "timed out". The runner's clock jumps past the deadline once the slow test has
    started (so a loaded machine's slow start cannot change the outcome)."""
    files = {"test_slow.py": '''
import time, pytest
pytestmark = pytest.mark.gpu

def test_quick():
    pass

def test_slow():
    time.sleep(120)

def test_later():
    pass
'''}
    root = _fake_tree(tmp_path, files)
    events = tmp_path / "out-logs" / "shard-0.events"

    def clock():
        # its "start" event (the shard's "collected" events name it before it runs)
        slow_started = events.exists() and '"start", "id": "tests/test_slow.py::test_slow"' in events.read_text()
        return time.monotonic() + (10_000.0 if slow_started else 0.0)

    opt = GT.Options(root=root, shards=1, test_timeout_s=100, min_start_s=1, deadline_s=300)
    t0 = time.monotonic()
    s = GT.run(opt, out_prefix=tmp_path / "out", log=lambda line: None, clock=clock)
    assert time.monotonic() - t0 < 60  # test_slow sleeps 120 s: it was killed
    status = {t["id"].split("::")[1]: t["status"] for t in s["tests"]}
    assert status == {"test_quick": "passed", "test_slow": "timed out", "test_later": "not run"}
    assert s["status"] == "timed out" and s["shards"][0]["status"] == "stopped: deadline"
    assert "deadline" in s["failing"][0]["message"]


def test_collection_error_fails_the_run(tmp_path):
    root = _fake_tree(tmp_path, {"test_bad.py": "import pytest\npytestmark = pytest.mark.gpu\ndef test_x(:\n"})
    s = GT.run(GT.Options(root=root, shards=2, deadline_s=60), log=lambda line: None)
    assert s["status"] == "failed" and "collection failed" in s["summary"] and not s["tests"]
    assert "SyntaxError" in s["collection"] or "invalid syntax" in s["collection"]


def test_cli_without_cuda_runs_nothing(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    assert GT.main([]) == 0
    assert "CPU MODE" in capsys.readouterr().out


def test_check_runner_runs_the_shards_within_its_deadline(monkeypatch, tmp_path):
    """gpu-check's Runner.run_tests hands its time limit to the sharded runner as the deadline,
    writes beside the results, balances with an earlier summary's durations, and keeps
    :func:`check.tests_record` of the summary."""
    (tmp_path / "old-gpu-tests.json").write_text(json.dumps(
        {"tests": [{"id": "tests/x.py::test_a", "status": "passed", "duration_s": 3.5}]}))
    seen = {}

    def fake_run(opt, out_prefix=None, log=print, measured=None):
        seen.update(deadline=opt.deadline_s, prefix=out_prefix, measured=measured, marker=opt.marker)
        return dict(status="passed", summary="3 passed in 12 s (2 shards)", wall_s=12.0, counts={"passed": 3},
                    shards=[{}, {}], failing=[], files=[f"{out_prefix}.json", f"{out_prefix}.md"])

    monkeypatch.setattr(GT, "run", fake_run)
    prefix = str(tmp_path / "gpu-2026-01-01-gpu-tests")
    rec = check.Runner(torch_device()).run_tests(123.0, lambda line: None, prefix)
    assert seen == dict(deadline=123.0, prefix=prefix, measured={"tests/x.py::test_a": 3.5}, marker="gpu")
    assert rec == dict(status="passed", summary="3 passed in 12 s (2 shards)", wall_s=12.0, counts={"passed": 3},
                       shards=2, failing=[], files=[f"{prefix}.json", f"{prefix}.md"])


def torch_device():
    import torch

    return torch.device("cpu")


def test_runner_does_not_count_what_did_not_finish(tmp_path, monkeypatch):
    """Ways a summary could lie, each in a shard of its own: a test that ends its process with
    exit status 1 (``os._exit(1)``, as LLVM's fatal errors do) has only its setup report, and
    must read "crashed", not "passed", with the tests after it run again; a file that imports in
    the collection pass but not in its shard reads "error"; a shard stuck at exit (a non-daemon
    thread) is stopped after the idle timeout, its test keeping its result; a shard whose pytest
    exits with a usage error ("not found": an id that differs between the collection pass and
    the shard) reads "error", not "not run" (which would make the run "timed out"). Also: pytest
    arguments that change what ``--collect-only`` prints (``-v``) still find every test, and a
    relative output prefix with ``root`` elsewhere keeps every file under it (the shards run in
    ``root``)."""
    files = {
        "test_c.py": '''
import os, pytest
pytestmark = pytest.mark.gpu

def test_one():
    pass

def test_exit1():
    os._exit(1)

def test_after():
    pass
''',
        "test_d.py": '''
import os, pytest
if not os.environ.get("TRITONMOE_SHARD_EVENTS", "").endswith("collect.events"):
    raise ImportError("only the collection pass imports this")
pytestmark = pytest.mark.gpu

def test_d1():
    pass
''',
        "test_e.py": '''
import threading, time, pytest
pytestmark = pytest.mark.gpu

def test_thread():
    threading.Thread(target=time.sleep, args=(120,)).start()  # not a daemon: the exit waits
''',
        "test_f.py": '''
import os, pytest
pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("v", ["x" if os.environ.get("TRITONMOE_SHARD_EVENTS", "").endswith("collect.events") else "y"])
def test_f(v):
    pass
''',
    }
    root = _fake_tree(tmp_path, files)
    monkeypatch.chdir(tmp_path)
    heavy = frozenset(f"tests/test_c.py::{n}" for n in ("test_one", "test_exit1", "test_after"))
    opt = GT.Options(root=root, shards=4, test_timeout_s=30, idle_timeout_s=8, min_start_s=1, deadline_s=90,
                     heavy=heavy, pytest_args=("-v",))
    s = GT.run(opt, out_prefix="rel/sum", log=lambda line: None)
    by_id = {t["id"]: t for t in s["tests"]}
    assert {k: v["status"] for k, v in by_id.items()} == {
        "tests/test_c.py::test_one": "passed", "tests/test_c.py::test_exit1": "crashed",
        "tests/test_c.py::test_after": "passed", "tests/test_d.py::test_d1": "error",
        "tests/test_e.py::test_thread": "passed", "tests/test_f.py::test_f[x]": "error"}
    assert "exit status 1" in by_id["tests/test_c.py::test_exit1"]["message"]
    assert by_id["tests/test_c.py::test_after"]["shard"] == "0.1"
    assert "only the collection pass" in by_id["tests/test_d.py::test_d1"]["message"]
    shard_e = next(r for r in s["shards"] if r["label"] == by_id["tests/test_e.py::test_thread"]["shard"])
    assert shard_e["status"] == "stopped: no test running for 8 s"
    assert s["status"] == "failed"
    assert (tmp_path / "rel" / "sum.json").exists() and not (root / "rel").exists()
    assert sorted(p.name for p in (tmp_path / "rel" / "sum-logs").iterdir()) == sorted(
        f"shard-{n}.{ext}" for n in ("0", "0.1", "1", "2", "3") for ext in ("log", "events"))


def test_runner_stops_its_shards_when_terminated(tmp_path):
    """The shards run in sessions of their own: SIGTERM to the runner (a device call's time
    limit) must not leave them running."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "shard.pid"
    root = _fake_tree(tmp_path, {"test_s.py": f'''
import os, time, pytest
pytestmark = pytest.mark.gpu

def test_sleep():
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    time.sleep(120)
'''})
    code = ("import sys; from pathlib import Path; from bench import gpu_tests as GT; "
            f"GT.run(GT.Options(root=Path({str(root)!r}), shards=1, deadline_s=120), out_prefix={str(tmp_path / 'o')!r})")
    runner = subprocess.Popen([sys.executable, "-c", code], cwd=GT.REPO_ROOT, stdout=subprocess.DEVNULL)
    shard_pid = None
    try:
        t0 = time.monotonic()
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        shard_pid = int(pid_file.read_text())
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                os.kill(shard_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"shard {shard_pid} outlived its runner")
        shard_pid = None
    finally:
        if runner.poll() is None:
            runner.kill()
        if shard_pid is not None:
            try:
                os.kill(shard_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_free_stem_never_overwrites_an_earlier_run(tmp_path):
    """A second GPU session on the same day overwrote the first one's gpu-check files: the stem
    takes the first free -N suffix instead, one stem per run for the check and its tests."""
    base = tmp_path / "nvidia-h100-2026-11-26"
    both = ("", "-gpu-tests")
    assert GT.free_stem(base) == GT.free_stem(base, both) == str(base)
    # the first run had a check result but no tests file (its tests wrote a .log)
    (tmp_path / "nvidia-h100-2026-11-26.json").write_text("{}")
    assert GT.free_stem(base) == GT.free_stem(base, both) == f"{base}-2"
    # run 2: `make gpu-tests` then `make gpu-check --skip-tests`: the same stem for both
    (tmp_path / "nvidia-h100-2026-11-26-2-gpu-tests.json").write_text("{}")
    assert GT.free_stem(base) == f"{base}-2"  # the check joins its tests
    assert GT.free_stem(base, both) == f"{base}-3"  # new tests never land under run 2's name
    (tmp_path / "nvidia-h100-2026-11-26-2.json").write_text("{}")
    # run 3, tests first: gpu-tests and check agree again
    assert GT.free_stem(base, both) == GT.free_stem(base) == f"{base}-3"
    with_prefix = GT._default_prefix(str(tmp_path))
    assert with_prefix.endswith("-gpu-tests") and not with_prefix.endswith("-2-gpu-tests")


def test_shard_logs_of_a_summary_in_bench_results_go_to_an_ignored_folder(tmp_path):
    """bench/results keeps results and write-ups, not the shards' raw logs (issue 27): a summary
    written there gets its logs under bench/out/gpu-tests-logs/, which git ignores; anywhere else
    they stay beside the summary."""
    import subprocess

    results = GT.REPO_ROOT / "bench" / "results"
    got = GT.shard_logs_dir(results / "nvidia-h100-2026-11-27-gpu-tests")
    assert got == GT.REPO_ROOT / "bench" / "out" / "gpu-tests-logs" / "nvidia-h100-2026-11-27-gpu-tests-logs"
    assert GT.shard_logs_dir(tmp_path / "x" / "sum") == tmp_path / "x" / "sum-logs"
    ignored = subprocess.run(["git", "-C", str(GT.REPO_ROOT), "check-ignore", "-q", str(got / "shard-0.events")])
    assert ignored.returncode == 0
