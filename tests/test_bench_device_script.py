"""scripts/gpu_device.sh (make gpu-part1 / gpu-part2): the prepared device script's argument check,
its step order (the timing-method figures first) and its budget rule, without a GPU: with no time
left every step is skipped, and says so, in rank order."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_device.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_usage_error_without_a_part_and_an_output_folder():
    for args in ((), ("part1",), ("part3", "/tmp/x")):
        p = _run(*args)
        assert p.returncode == 2 and "usage" in p.stderr


def _steps(out: Path) -> list[list[str]]:
    return [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]


def test_steps_are_ranked_and_skipped_when_the_budget_is_spent(tmp_path):
    p = _run("part1", str(tmp_path / "o1"), env={"BUDGET_S": "20", "RESERVE_S": "10", "PY": "false", "SETUP_CMD": "true"})
    assert p.returncode == 0, p.stderr
    steps = _steps(tmp_path / "o1")
    names = [s[0] for s in steps]
    assert names == ["setup", "warmup", "check", "gemm", "profile", "host", "tune"]
    assert all(s[2] in ("skipped", "absent") for s in steps)
    tune_present = (ROOT / "bench" / "tune.py").exists() or (ROOT / "bench" / "tune").is_dir()
    assert steps[-1][2] == ("skipped" if tune_present else "absent")
    assert (tmp_path / "o1" / "part1.log").exists()
    p = _run("part2", str(tmp_path / "o2"), env={"BUDGET_S": "20", "RESERVE_S": "10", "PY": "false", "SETUP_CMD": "true"})
    assert p.returncode == 0, p.stderr
    assert [s[0] for s in _steps(tmp_path / "o2")] == ["setup", "gpu-tests", "gpu-memory"]


def test_a_step_is_capped_by_what_the_budget_leaves(tmp_path):
    """PY=echo stands in for python: each step 'runs' at once, and its cap is the smaller of its
    own and the budget left less the reserve."""
    p = _run("part2", str(tmp_path / "o"), env={"BUDGET_S": "40", "RESERVE_S": "10", "PY": "echo", "SETUP_CMD": "true"})
    assert p.returncode == 0, p.stderr
    steps = {s[0]: s for s in _steps(tmp_path / "o")}
    assert steps["gpu-tests"][2] == "0" and 15 <= int(steps["gpu-tests"][1]) <= 30
    assert "--test-timeout-s 45" in (tmp_path / "o" / "steps" / "gpu-tests.log").read_text()
