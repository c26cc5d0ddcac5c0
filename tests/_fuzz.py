"""``make fuzz``: every hypothesis property of the suite, random examples, FACTOR times its CI count.

Active when ``HYPOTHESIS_PROFILE=fuzz`` (``tests/conftest.py`` registers this plugin then). It

* keeps only the hypothesis tests (``hypothesis.is_hypothesis_test``): every property of every
  test module, including ones added later, with no list to maintain;
* multiplies each property's ``max_examples`` (its ``@settings`` value, or the profile default
  of 100 that the CI profile also uses) by ``TRITONMOE_FUZZ_FACTOR`` (default 10); the fuzz
  profile is not derandomized, so every run draws new examples;
* counts the examples each property runs (calls of the test body, through hypothesis's
  documented ``inner_test`` hook) and prints a table at the end: target, run, rejected (failed
  ``assume`` or an error, shrinking included), seconds;
* stops starting new properties once ``TRITONMOE_FUZZ_BUDGET_S`` seconds (default 1200) have
  passed, so the run stays near the budget; the properties it skips are listed as such. A
  property already running finishes.

A failure prints hypothesis's falsifying example (and ``@reproduce_failure`` blob); turn it into
a named regression case (an ``@example`` on the property, or an explicit test) before fixing it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest
from hypothesis import is_hypothesis_test, settings

DEFAULT_FACTOR = 10
DEFAULT_BUDGET_S = 1200.0


@dataclass
class PropertyRun:
    """What one property (one pytest item) did in this run."""

    target: int
    examples: int = 0
    rejected: int = 0
    seconds: float = 0.0
    outcome: str = "not run"


@dataclass
class FuzzPlugin:
    factor: int
    budget_s: float
    start: float = field(default_factory=time.monotonic)
    runs: dict[str, PropertyRun] = field(default_factory=dict)
    current: Optional[str] = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep = [it for it in items if is_hypothesis_test(getattr(it, "obj", None))]
        drop = [it for it in items if it not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        scaled = set()
        for it in keep:
            fn = it.obj
            if id(fn) not in scaled:  # parametrized items share one function
                scaled.add(id(fn))
                base = fn._hypothesis_internal_use_settings
                fn._hypothesis_internal_use_settings = settings(base, max_examples=base.max_examples * self.factor)
                fn.hypothesis.inner_test = self._counting(fn.hypothesis.inner_test)
            self.runs[it.nodeid] = PropertyRun(target=fn._hypothesis_internal_use_settings.max_examples)

    def _counting(self, inner):
        def counted(*args, **kwargs):
            run = self.runs.get(self.current)
            if run is not None:
                run.examples += 1
            try:
                return inner(*args, **kwargs)
            except BaseException:
                if run is not None:
                    run.rejected += 1
                raise

        counted.__name__ = getattr(inner, "__name__", "counted")
        counted.__wrapped__ = inner
        return counted

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        run = self.runs.get(item.nodeid)
        if run is not None and time.monotonic() - self.start > self.budget_s:
            run.outcome = "skipped (budget)"
            pytest.skip(f"fuzz budget of {self.budget_s:.0f} s spent (TRITONMOE_FUZZ_BUDGET_S)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        run = self.runs.get(item.nodeid)
        self.current = item.nodeid
        t0 = time.monotonic()
        outcome = yield
        self.current = None
        if run is not None:
            run.seconds = time.monotonic() - t0
            run.outcome = "failed" if outcome.excinfo is not None else "passed"

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tr.section(f"fuzz: examples per property (factor {self.factor} x CI, budget {self.budget_s:.0f} s)")
        width = max([len(k) for k in self.runs] + [8])
        tr.write_line(f"{'property':{width}}  {'target':>7}  {'run':>7}  {'rejected':>8}  {'seconds':>8}  outcome")
        for name, r in self.runs.items():
            tr.write_line(f"{name:{width}}  {r.target:7d}  {r.examples:7d}  {r.rejected:8d}  {r.seconds:8.1f}  {r.outcome}")
        total = sum(r.examples for r in self.runs.values())
        short = [n for n, r in self.runs.items() if r.outcome == "passed" and r.examples < r.target]
        tr.write_line(f"{len(self.runs)} properties, {total} examples in {time.monotonic() - self.start:.0f} s")
        if short:
            tr.write_line(
                f"{len(short)} properties ran fewer examples than their target (hypothesis stops early when a "
                "strategy's space is exhausted): " + ", ".join(short)
            )


def make_plugin() -> FuzzPlugin:
    factor = int(os.environ.get("TRITONMOE_FUZZ_FACTOR", DEFAULT_FACTOR))
    budget = float(os.environ.get("TRITONMOE_FUZZ_BUDGET_S", DEFAULT_BUDGET_S))
    if factor < 1:
        raise ValueError(f"TRITONMOE_FUZZ_FACTOR={factor} must be >= 1")
    return FuzzPlugin(factor=factor, budget_s=budget)
