"""Every script of examples/ runs on CPU as documented (examples/README.md): the single-process
ones with python, the distributed ones under ``torchrun --nproc-per-node 2`` over gloo, each
bounded by a timeout, and what each prints says it did the right thing (equal outputs, the same
checkpoint after resharding, a falling loss)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300
#: A printed number (two ranks' lines may run together: never match past it).
NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]\d+)?)"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""     # the CPU path (gloo), as CI runs it
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TRITON_INTERPRET", None)    # the examples use the reference path on CPU
    return env


def run(script: str, *args: str, nproc: int | None = None, cwd=None) -> str:
    cmd = [sys.executable, str(EXAMPLES / script), *args]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, cwd=cwd or ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _floats(pattern: str, text: str) -> list[float]:
    found = [float(v) for v in re.findall(pattern, text)]
    assert found, f"no match for {pattern!r} in:\n{text}"
    return found


def test_every_example_is_tested_and_listed():
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    this = pathlib.Path(__file__).read_text()
    listed = (EXAMPLES / "README.md").read_text()
    for s in sorted(scripts):
        assert f'"{s}"' in this, f"examples/{s} has no test in tests/test_examples.py"
        assert f"({s})" in listed, f"examples/{s} is not listed in examples/README.md"
    for s in scripts:
        assert 'device="cuda"' not in (EXAMPLES / s).read_text(), f"examples/{s} hard-codes the device"


@pytest.mark.slow
def test_layer_example_trains():
    out = run("layer.py", "--steps", "8")
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out


@pytest.mark.slow
@pytest.mark.dist
def test_expert_parallel_example_equals_single_process():
    out = run("expert_parallel.py", "--steps", "2", nproc=2)
    diffs = _floats(r"single process\| = " + NUM, out)
    assert len(diffs) == 2 and max(diffs) <= 1e-5, out
    assert "experts 4 of 8" in out


@pytest.mark.slow
@pytest.mark.dist
def test_train_dp_ep_example_resumes_on_another_layout_and_world_size(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _floats(r"checksum " + NUM, run("train_dp_ep.py", "--ep", "2", "--steps", "2", "--save", ckpt, nproc=2))
    # Another layout of the same world (2 data-parallel replicas of 1 rank), then one process.
    other = run("train_dp_ep.py", "--ep", "1", "--steps", "1", "--resume", ckpt, "--comm", "lina", nproc=2)
    assert "dp=2 x ep=1" in other
    single = run("train_dp_ep.py", "--steps", "1", "--resume", ckpt)
    resumed = _floats(r"checksum " + NUM, other) + _floats(r"checksum " + NUM, single)
    assert resumed == saved * 2, (saved, resumed)


@pytest.mark.slow
def test_hf_swap_example():
    pytest.importorskip("transformers")
    out = run("hf_swap.py")
    (diff,) = _floats(r"max \|logits difference\| = " + NUM, out)
    assert diff <= 1e-5, out
    assert "swapped 2 blocks" in out and "restored 2 blocks" in out and "generated: [" in out


@pytest.mark.slow
def test_plan_model_example():
    out = run("plan_model.py", "--model", "qwen3-30b-a3b", "--tokens", "2048")
    assert "<- chosen" in out and re.search(r"-> \{'schedule': '[\w-]+', 'pipeline_degree': \d\}", out), out


@pytest.mark.slow
@pytest.mark.dist
def test_inference_example_matches_plain_layers():
    out = run("inference.py", nproc=2)
    rep = _floats(r"max \|replicated - plain\| = " + NUM, out)
    off = _floats(r"max \|offloaded - resident\| = " + NUM, out)
    assert len(rep) == 2 and len(off) == 2 and max(rep + off) <= 1e-5, out


@pytest.mark.slow
@pytest.mark.dist
def test_se_moe_fusion_example():
    out = run("se_moe_fusion.py", nproc=2)
    assert "buckets of 64 bytes:" in out and "reduced[0] = [3.0, 3.0, 3.0]" in out, out  # 1 + 2 over 2 ranks
    assert "trained 3 steps" in out


@pytest.mark.slow
@pytest.mark.dist
def test_se_moe_embedding_example():
    out = run("se_moe_embedding.py", nproc=2)
    rows = re.findall(r"rows \[(\d+), (\d+)\) of 1000", out)
    assert sorted((int(a), int(b)) for a, b in rows) == [(0, 500), (500, 1000)], out
    assert "full table: (1000," in out


@pytest.mark.slow
@pytest.mark.dist
def test_se_moe_elastic_example_regroups_3_1_into_2_2():
    out = run("se_moe_elastic.py", nproc=4)
    tasks = re.findall(r"task (\d) on (\d) ranks", out)
    assert sorted(tasks) == [("0", "2"), ("0", "2"), ("1", "2"), ("1", "2")], out
