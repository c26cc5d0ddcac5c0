"""Per-test time limits without pytest-timeout (tests/_timeouts.py, armed by tests/conftest.py
for ``timeout_s``-marked and ``gpu`` tests), and the CUDA-graph case's bounded teardown."""

from __future__ import annotations

import pathlib
import signal
import time
import types

import pytest

import _timeouts
from _timeouts import TestTimeLimit, limit_of, time_limit


def test_a_phase_past_its_limit_fails_with_the_limit():
    t0 = time.monotonic()
    with pytest.raises(TestTimeLimit, match=r"some test \(call\) ran past its time limit of 0.3 s"):
        with time_limit(0.3, "some test (call)"):
            time.sleep(5)
    assert time.monotonic() - t0 < 2.5


def test_soft_limit_alone_leaves_faulthandler_to_pytest():
    with pytest.raises(TestTimeLimit):
        with time_limit(0.2, "soft only", hard_grace_s=None):
            time.sleep(3)


def test_the_limit_is_disarmed_after_the_phase():
    before = signal.getsignal(signal.SIGALRM)
    with time_limit(0.2, "quick"):
        pass
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    assert signal.getsignal(signal.SIGALRM) == before
    time.sleep(0.3)  # no late alarm


@pytest.mark.timeout_s(30)
def test_conftest_arms_the_marked_tests_limit():
    remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    assert 0 < remaining <= 30


def test_unmarked_cpu_tests_have_no_limit():
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


class _Item:
    nodeid = "t.py::x"

    def __init__(self, **marks):
        self.marks = marks

    def get_closest_marker(self, name):
        if name not in self.marks:
            return None
        return types.SimpleNamespace(name=name, args=self.marks[name], kwargs={})


def test_limit_of_reads_the_marker_and_the_gpu_default():
    assert limit_of(_Item()) is None
    assert limit_of(_Item(gpu=())) == _timeouts.GPU_TEST_TIMEOUT_S
    assert limit_of(_Item(gpu=(), timeout_s=(12,))) == 12.0
    for bad in ((), (0,), (-1,), (True,), ("5",)):
        with pytest.raises(ValueError, match="timeout_s needs a positive number of seconds"):
            limit_of(_Item(timeout_s=bad))


def test_cuda_graph_case_releases_the_graph_before_a_bounded_destroy():
    """The teardown order of tests/_cuda_graph_case.py (its GPU run is the gpu test): the graph is
    reset after its outputs are dropped and before the process group is destroyed, and the
    destroy runs under a deadline that ends the process with its stacks."""
    src = (pathlib.Path(__file__).parent / "_cuda_graph_case.py").read_text()
    fin = src[src.index("    finally:"):]
    order = [fin.index(s) for s in ("out = want = static_x = None", "graph.reset()", "torch.cuda.synchronize()",
                                    "_bounded_destroy(")]
    assert order == sorted(order), order
    assert "os._exit(3)" in src and "dump_traceback(all_threads=True)" in src
