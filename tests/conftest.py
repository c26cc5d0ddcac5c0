"""Test configuration.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be switched on
before anything imports triton (and so before tritonmoe); with one, kernels run on the GPU and
the ``gpu`` tests run too.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=50)
# `make fuzz` (tests/_fuzz.py): random examples, every property's count scaled by
# TRITONMOE_FUZZ_FACTOR; the default max_examples is the one properties without @settings get in CI.
settings.register_profile(
    "fuzz",
    derandomize=False,
    deadline=None,
    print_blob=True,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_configure(config):
    if HYPOTHESIS_PROFILE == "fuzz":
        from _fuzz import make_plugin

        config.pluginmanager.register(make_plugin(), "tritonmoe-fuzz")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


INTERPRETER_ON = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
_NEEDS_INTERPRETER = "needs Triton's interpreter"  # tritonmoe.backends's error for backend='triton' on CPU tensors


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where Triton's interpreter is off (a CUDA machine, or TRITON_INTERPRET=0 set by hand), a
    test that runs the Triton kernels on CPU tensors (the CPU suite's way of testing them) cannot
    run: it is reported as skipped with the reason, not as a failure. The same kernels run on
    CUDA in the ``gpu`` tests."""
    outcome = yield
    rep = outcome.get_result()
    if INTERPRETER_ON or call.excinfo is None or rep.when != "call":
        return
    if _NEEDS_INTERPRETER in str(call.excinfo.value):
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        "Skipped: runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 "
                        "(set by this conftest only where there is no CUDA device)")


def _limited(phase: str):
    """A hookwrapper running a test's ``phase`` under its time limit (tests/_timeouts.py: the
    ``timeout_s`` marker, and every ``gpu`` test). Left to pytest-timeout where that plugin is
    loaded and the test carries its ``timeout`` marker."""

    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
        from _timeouts import limit_of, time_limit

        seconds = limit_of(item)
        if seconds is not None and item.config.pluginmanager.hasplugin("timeout") \
                and item.get_closest_marker("timeout") is not None:
            seconds = None
        try:
            pytest_faulthandler = float(item.config.getini("faulthandler_timeout") or 0) > 0
        except (ValueError, TypeError):
            pytest_faulthandler = False
        with time_limit(seconds, f"{item.nodeid} ({phase})", hard_grace_s=None if pytest_faulthandler else 30.0):
            yield

    return hook


pytest_runtest_setup = _limited("setup")
pytest_runtest_call = _limited("call")
pytest_runtest_teardown = _limited("teardown")


@pytest.fixture
def devices():
    """Devices to run device-generic tests on: CPU, and CUDA when present."""
    return ["cpu", "cuda"] if HAS_CUDA else ["cpu"]
