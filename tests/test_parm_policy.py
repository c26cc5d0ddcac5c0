"""Parm's run-time schedule policy without processes (tritonmoe.policy.parm_schedule.ParmSchedulePolicy):
a fixed schedule is returned as is, ``auto`` fits once (through the callable the expert path hands
it) and decides with the fitted model, the probe timing drops its warm-up round and takes the
median of the rounds, and the startup it adds is the probe's time minus the model's prediction.

Times are a fake clock the probe advances (no timing is asserted); the layout is one rank, so no
collective runs. The multi-rank policy (agreement over ragged batches, the probe on the layer) is
covered by tests/test_parm.py's ``auto`` rows."""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm
from tritonmoe.parm_layout import ParmGroups, ParmLayout
from tritonmoe.policy import parm_schedule as ps
from tritonmoe.policy.parm_schedule import (
    COLLECTIVES,
    AlphaBeta,
    ParmCostModel,
    ParmSchedulePolicy,
    choose_schedule,
    step_times,
)

SCHEDS = ("baseline", "s1", "s2")


def _policy(schedule: str = "auto") -> ParmSchedulePolicy:
    config = tm.MoEConfig(16, 32, 4, 2, parm_schedule=schedule)
    return ParmSchedulePolicy(config, ParmGroups(layout=ParmLayout.make(1, 1, 1), rank=0))


def _model(**startup: float) -> ParmCostModel:
    ab = AlphaBeta(1e-5, 1e-9)
    return ParmCostModel(ag_mp=ab, a2a=ab, overlap=ab, collectives={k: ab for k in COLLECTIVES}, flops_per_s=1e12,
                         copy_bytes_per_s=1e10, startup=dict(startup))


class FakeClock:
    """``time.perf_counter`` for the policy module; ``run`` advances it by the next duration of
    the schedule it runs, and records each call."""

    def __init__(self, durations: dict[str, list[float]]) -> None:
        self.now = 0.0
        self.durations = {s: list(v) for s, v in durations.items()}
        self.calls: list[tuple[str, tuple, bool, bool]] = []
        self.inputs: list[torch.Tensor] = []

    def perf_counter(self) -> float:
        return self.now

    def run(self, x: torch.Tensor, sched: str) -> None:
        self.calls.append((sched, tuple(x.shape), x.requires_grad, x.is_leaf))
        self.inputs.append(x)
        self.now += self.durations[sched].pop(0)


@pytest.fixture
def clock(monkeypatch):
    def make(durations):
        c = FakeClock(durations)
        monkeypatch.setattr(ps.time, "perf_counter", c.perf_counter)
        return c

    return make


@pytest.mark.parametrize("schedule", SCHEDS)
def test_a_fixed_schedule_is_returned_without_a_fit(schedule):
    pol = _policy(schedule)

    def fit(x, T):
        raise AssertionError("a fixed schedule must not fit a model")

    assert pol.choose(torch.zeros(8, 16), fit=fit) == schedule
    assert pol.cost_model is None


@pytest.mark.parametrize("startup,want", [({"s1": 1.0, "s2": 1.0}, "baseline"), ({"baseline": 1.0, "s2": 1.0}, "s1"),
                                          ({"baseline": 1.0, "s1": 1.0}, "s2")])
def test_auto_fits_once_and_decides_with_the_fitted_model(startup, want):
    pol = _policy()
    model = _model(**startup)
    fits = []

    def fit(x, T):
        fits.append((tuple(x.shape), T))
        return model

    x = torch.zeros(24, 16)
    assert pol.choose(x, fit=fit) == want
    assert pol.choose(torch.zeros(8, 16), fit=fit) == want  # the model is kept
    assert fits == [((24, 16), 24)]
    assert pol.cost_model is model
    assert want == choose_schedule(model, pol.config, pol.layout, 24, dtype=x.dtype)


def test_probe_rounds_rotate_and_the_median_after_the_warm_up_is_taken(clock):
    # per schedule, in the order it runs: the warm-up (fast here, so counting it would lower
    # every median), then three rounds
    c = clock({"baseline": [0.0, 1.0, 5.0, 3.0], "s1": [0.0, 6.0, 2.0, 7.0], "s2": [0.0, 4.0, 1.0, 1.5]})
    x = torch.randn(5, 16)
    got = _policy().time_schedules(c.run, x, reps=3)
    assert got == {"baseline": 3.0, "s1": 6.0, "s2": 1.5}
    # each round runs every schedule once, the order rotating by round
    assert [s for s, *_ in c.calls] == ["baseline", "s1", "s2", "s1", "s2", "baseline", "s2", "baseline", "s1",
                                       "baseline", "s1", "s2"]
    # on a fresh leaf copy of the batch that requires grad
    assert all(shape == (5, 16) and rg and leaf for _, shape, rg, leaf in c.calls)
    assert all(torch.equal(i, x) and i is not x for i in c.inputs)
    assert len({id(i) for i in c.inputs}) == len(c.inputs)


def test_fit_adds_each_schedules_startup_measured_on_a_small_batch(clock, monkeypatch):
    model = _model()
    monkeypatch.setattr(ps, "measure_cost_model", lambda groups, **kw: model)
    reps = 2
    # dyadic durations: the fake clock's differences are exact
    c = clock({s: [0.5] + [(i + 1) / 64] * reps for i, s in enumerate(SCHEDS)})
    pol = _policy()
    x = torch.randn(3 * ps.PROBE_TOKENS, 16)
    fitted = pol.fit(x, 1000, c.run, reps=reps)
    # the probe runs on the first PROBE_TOKENS rows; the startup is its time minus the prediction
    assert {shape for _, shape, *_ in c.calls} == {(ps.PROBE_TOKENS, 16)}
    pred = step_times(model, pol.config, pol.layout, ps.PROBE_TOKENS, itemsize=x.element_size())
    assert fitted.startup == {s: (i + 1) / 64 - pred[s] for i, s in enumerate(SCHEDS)}
    assert (fitted.collectives, fitted.flops_per_s) == (model.collectives, model.flops_per_s)
    assert fitted.source.startswith(model.source) and f"at {ps.PROBE_TOKENS} tokens" in fitted.source


def test_fit_without_a_probe_or_without_autograd_is_the_measured_model(clock, monkeypatch):
    model = _model()
    seen = []
    monkeypatch.setattr(ps, "measure_cost_model", lambda groups, **kw: seen.append(kw["tokens"]) or model)
    c = clock({s: [] for s in SCHEDS})  # any probe call would fail: nothing to pop
    pol = _policy()
    x = torch.randn(8, 16)
    assert pol.fit(x, 8) is model
    with torch.no_grad():
        assert pol.fit(x, 8, c.run) is model
    assert c.calls == [] and seen == [8, 8]
