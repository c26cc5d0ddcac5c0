"""``python -m bench tune`` on the interpreter, on a tiny space: every candidate runs and is
checked against the fp64 reference before anything is recorded (a wrong-answer candidate is never
written, even when it would be the fastest), failures are recorded, the table file is written as
it goes (atomic), and ``--resume`` continues a cut-off run. Times come from a fake timer that
still runs every candidate (interpreter times say nothing about a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tune as T
from bench.tune import problems, runner, space, timer
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import gemm_kinds as GK

CPU = torch.device("cpu")
LAYER = space.Layer("tiny", E=4, D=32, F=32, topk=2)
OPTS = dict(max_candidates=3, rounds=1, final_rounds=2)


def _jobs(*ops, bucket=16):
    return space.jobs_for([LAYER], ops, "fp16", buckets={"gemm": [bucket], "tokens": [bucket], "decode": [4]})


def _active(job) -> object:
    """The config the job's target would launch with now (the tuner's override is active)."""
    n, k = job.gemm_nk()
    return GK.select(job.kind, rows=job.bucket * LAYER.E, n=n, k=k, num_experts=LAYER.E, dtype=torch.float16,
                     tf32=False, device=CPU)


def _launchable_as_is(cands):
    """A non-heuristic candidate the policy's clamping (BM <= 16 rows per expert here) leaves
    unchanged, so that the launch can be recognised by its config."""
    return next(c for c in cands[1:] if c.BM == 16)


class FakeTimer:
    """Runs every candidate once per round (the kernels really run) and returns a time from
    ``speed(config)``; counts the configs it was given."""

    def __init__(self, job, speed):
        self.job, self.speed, self.seen = job, speed, []

    def __call__(self, fns, *, device, rounds):
        out = []
        for fn in fns:
            with CF.recording() as ran:
                fn()
            cfg = next(r.config for r in ran if r.target == self.job.target)
            self.seen.append(CF.config_dict(cfg))
            out.append([self.speed(cfg)] * rounds)
        return out


def test_tiny_space_end_to_end_in_the_interpreter(tmp_path):
    out = tmp_path / "t.json"
    jobs = _jobs("gemm1", "gemm2", "decode2", "unpermute", "route")
    doc = runner.tune(jobs, out, device=CPU, device_name="cpu_test", opts=runner.TuneOptions(**OPTS), log=lambda s: None)
    assert json.loads(out.read_text()) == doc
    got = {j.id for j in jobs if str(j.bucket) in doc["entries"].get(j.target, {}).get(j.group, {})}
    assert got == {j.id for j in jobs}
    gemm1 = next(j for j in jobs if j.op == "gemm1")
    e = doc["entries"]["gemm.swiglu"][gemm1.group]["16"]
    assert e["valid"] >= 1 and e["rounds"] == 2 and e["us"] > 0 and "interpreter" in e["timer"]
    # the table loads and the policy uses it
    tbl = CF.load_table(out)
    with CF.override("table", tbl), CF.recording() as ran:
        cfg = _active(gemm1)
    assert cfg.source == "table" and CF.config_dict(cfg) == e["config"]
    assert ran[0].source == "table"


def test_a_wrong_answer_is_never_written_even_when_fastest(tmp_path, monkeypatch):
    job = _jobs("gemm1")[0]
    with CF.override("table", None):
        heur = _active(job)
    broken = _launchable_as_is(space.candidates(job, heur, interpreter=True, max_candidates=3))
    real_build = problems.build

    def build(j, device, seed=0):
        p = real_build(j, device, seed)
        run = p.run

        def sabotaged():
            out = run()
            if CF.config_dict(_active(j)) == CF.config_dict(broken):
                out = out.flip(0)  # rows in the wrong order: what a wrong tile index does
            return out

        p.run = sabotaged
        return p

    monkeypatch.setattr(problems, "build", build)
    fake = FakeTimer(job, lambda c: 1e-6 if CF.config_dict(c) == CF.config_dict(broken) else 5e-6)
    monkeypatch.setattr(timer, "MEASURE", fake)
    out = tmp_path / "t.json"
    doc = runner.tune([job], out, device=CPU, device_name="cpu_test", opts=runner.TuneOptions(**OPTS),
                      log=lambda s: None)
    entry = doc["entries"]["gemm.swiglu"][job.group]["16"]
    assert entry["config"] != CF.config_dict(broken)
    assert CF.config_dict(broken) not in fake.seen  # never timed either
    bad = doc["invalid"]["gemm.swiglu"][job.group]["16"]
    assert [b["status"] for b in bad] == ["wrong"] and bad[0]["config"] == CF.config_dict(broken)
    assert "rel err" in bad[0]["reason"]


def test_compile_failures_are_recorded_and_skipped(tmp_path, monkeypatch):
    job = _jobs("gemm2")[0]
    with CF.override("table", None):
        heur = _active(job)
    failing = _launchable_as_is(space.candidates(job, heur, interpreter=True, max_candidates=3))
    real_build = problems.build

    def build(j, device, seed=0):
        p = real_build(j, device, seed)
        run = p.run

        def maybe_fail():
            if CF.config_dict(_active(j)) == CF.config_dict(failing):
                raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
            return run()

        p.run = maybe_fail
        return p

    monkeypatch.setattr(problems, "build", build)
    doc = runner.tune([job], tmp_path / "t.json", device=CPU, device_name="cpu_test",
                      opts=runner.TuneOptions(**OPTS), log=lambda s: None)
    bad = doc["invalid"]["gemm.mm"][job.group]["16"]
    assert [b["status"] for b in bad] == ["error"] and "shared memory" in bad[0]["reason"]
    assert doc["entries"]["gemm.mm"][job.group]["16"]["config"] != CF.config_dict(failing)


def _ranked(fns, rounds):
    """Run each candidate once; times in list order."""
    for f in fns:
        f()
    return [[1e-6 * (i + 1)] * rounds for i in range(len(fns))]


def test_a_cut_off_run_keeps_its_entries_and_resume_continues(tmp_path, monkeypatch):
    jobs = _jobs("gemm1", "gemm2")
    out = tmp_path / "t.json"
    calls = []

    class Killed(BaseException):
        pass

    def measure(fns, *, device, rounds):
        calls.append(len(fns))
        if len(calls) > 3:  # the second job's timing: the machine is taken away
            raise Killed
        return _ranked(fns, rounds)

    monkeypatch.setattr(timer, "MEASURE", measure)
    with pytest.raises(Killed):
        runner.tune(jobs, out, device=CPU, device_name="cpu_test", opts=runner.TuneOptions(**OPTS), log=lambda s: None)
    doc = json.loads(out.read_text())  # a valid table with the first job
    assert list(doc["entries"]) == ["gemm.swiglu"]
    assert not list(tmp_path.glob("*.tmp"))  # no temporary left behind by the atomic writes
    first = doc["entries"]["gemm.swiglu"]

    calls.clear()
    monkeypatch.setattr(timer, "MEASURE", lambda fns, *, device, rounds: _ranked(fns, rounds))
    logs = []
    doc2 = runner.tune(jobs, out, device=CPU, device_name="cpu_test", opts=runner.TuneOptions(resume=True, **OPTS),
                       log=logs.append)
    assert "1 of 2 jobs" in logs[0]
    assert doc2["entries"]["gemm.swiglu"] == first  # not measured again
    assert jobs[1].group in doc2["entries"]["gemm.mm"]
    assert json.loads(out.read_text()) == doc2


def test_budget_stops_before_starting_work(tmp_path):
    out = tmp_path / "t.json"
    logs = []
    runner.tune(_jobs("gemm1"), out, device=CPU, device_name="cpu_test",
                opts=runner.TuneOptions(budget_s=0, **OPTS), log=logs.append)
    assert any("budget spent" in line for line in logs)
    assert not out.exists()


def test_a_malformed_table_file_is_set_aside_not_lost(tmp_path):
    out = tmp_path / "t.json"
    out.write_text("{truncated")
    doc = runner.read_doc(out, "cpu_test")
    assert doc["entries"] == {} and (tmp_path / "t.json.bad").read_text() == "{truncated"


def test_candidates_start_with_the_heuristic_and_respect_limits():
    for job in space.jobs_for(["mixtral-8x7b-like", "qwen3-30b-a3b-like"], space.OPS, "bf16",
                              buckets={"gemm": [16, 4096], "tokens": [4096], "decode": [1]}):
        first = space.candidates(job, _gpu_heuristic(job), interpreter=False, max_candidates=12)
        assert 1 <= len(first) <= 12 and len({json.dumps(CF.config_dict(c), sort_keys=True) for c in first}) == len(first)
        if job.target.startswith("gemm."):
            dual = job.kind in ("swiglu", "dact_swiglu")
            for c in first[1:]:
                smem = c.num_stages * (c.BM * c.BK + (2 if dual else 1) * c.BK * c.BN) * 2
                assert smem <= space.SMEM_BUDGET
                assert c.variant == "tile" or job.kind in GK.PERSISTENT_KINDS
                assert c.variant != "wide" or job.kind in GK.WIDE_KINDS
                assert c.EPI_SPLIT == 0 or c.variant in ("persistent", "wide")


def _gpu_heuristic(job):
    """A stand-in heuristic config of the right class (the space does not depend on it beyond
    ordering)."""
    from tritonmoe.kernels.permute import MetadataConfig, RowsConfig
    from tritonmoe.kernels.routing import RouteConfig

    if job.target.startswith(("gemm.", "decode.")):
        return GK.TileConfig(BM=64, BN=64, BK=64)
    if job.target == "permute.metadata":
        return MetadataConfig(True, 128, 32, 16, 4)
    if job.target.startswith("permute."):
        return RowsConfig(1024, 1, 4)
    return RouteConfig(16, 4, 16, 4)


def test_cli_refuses_without_out_in_the_interpreter_and_lists_jobs(capsys):
    assert T.main(["--layer", "E=4,D=32,F=32,k=2", "--ops", "gemm1", "--gemm-buckets", "16"]) == 2
    assert T.main(["--dry-run", "--layer", "E=4,D=32,F=32,k=2", "--ops", "gemm1,route", "--gemm-buckets", "16,64",
                   "--token-buckets", "8"]) == 0
    printed = capsys.readouterr().out
    assert "3 jobs" in printed and "gemm.swiglu|dtype=bf16,E=4,N=32,K=32|64" in printed
    with pytest.raises(SystemExit):
        T.main(["--ops", "gemm9"])


def test_worker_compile_reports_failures_without_raising(monkeypatch):
    job = _jobs("gemm1")[0]
    with CF.override("table", None):
        heur = _active(job)
    assert runner._worker_compile(job, heur, 0, "cpu") == ("ok", "compiled")
    real_build = problems.build

    def build(j, device, seed=0):
        p = real_build(j, device, seed)

        def fail():
            raise RuntimeError("PassManager::run failed\nmore lines")

        p.run = fail
        return p

    monkeypatch.setattr(problems, "build", build)
    assert runner._worker_compile(job, heur, 0, "cpu") == ("error", "RuntimeError: PassManager::run failed")


@pytest.mark.slow
def test_the_worker_pool_compiles_every_candidate_first(tmp_path, monkeypatch):
    """Spawned workers (they import torch and Triton, and run in the interpreter here) launch
    every candidate before the main process checks and times them."""
    job = _jobs("route")[0]
    seen = []
    real = runner._compile_in_pool

    def spy(*a, **kw):
        res = real(*a, **kw)
        seen.append(res)
        return res

    monkeypatch.setattr(runner, "_compile_in_pool", spy)
    doc = runner.tune([job], tmp_path / "t.json", device=CPU, device_name="cpu_test",
                      opts=runner.TuneOptions(workers=1, **OPTS), log=lambda s: None)
    assert len(seen) == 1 and len(seen[0]) == 3 and set(seen[0].values()) == {("ok", "compiled")}
    assert str(job.bucket) in doc["entries"]["route"][job.group]


def test_the_timer_rotates_the_order_every_round():
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = timer.interleaved(fns, device=CPU, rounds=3)
    assert [len(t) for t in times] == [3, 3, 3] and all(x >= 0 for t in times for x in t)
    assert calls[:3] == [0, 1, 2]  # one untimed call each first
    assert calls[3:] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert timer.interleaved([], device=CPU, rounds=3) == []


def test_jobs_run_nearest_the_layers_own_size_first():
    jobs = space.jobs_for(["mixtral-8x7b-like"], ("gemm1", "decode1", "route"), "bf16",
                          buckets={"gemm": [64, 4096, 256], "decode": [16, 1], "tokens": [64, 16384]})
    first = [(j.op, j.bucket) for j in jobs[:3]]
    assert first == [("gemm1", 4096), ("decode1", 1), ("route", 16384)]  # 16384 tokens * 2 / 8 experts
    assert len(jobs) == 7 and len({j.id for j in jobs}) == 7
    with pytest.raises(ValueError, match="unknown tune op"):
        space.jobs_for(["small"], ("gemm3",))
