"""Block-scoped settings (``tm.validation``, ``tm.use_backend``) hold per thread and task and are
restored on exit however blocks of different threads overlap; ``set_*`` change the process
default (issue 35, item 3)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import tritonmoe as tm
from tritonmoe.core import settings


def _barrier_pair():
    return threading.Barrier(2, timeout=30)


def test_overlapping_blocks_in_two_threads_restore_the_default():
    """Thread A enters validation(False), thread B enters validation(False), A exits, B exits
    (interleaved through barriers): afterwards validation is on everywhere; while A's block is
    open, B's own reads are unaffected until B enters its block."""
    assert tm.validation_enabled()
    b1, b2, b3 = _barrier_pair(), _barrier_pair(), _barrier_pair()
    seen: dict = {}

    def a():
        with tm.validation(False):
            seen["a_inside"] = tm.validation_enabled()
            b1.wait()  # B reads while A is inside
            b2.wait()  # B enters its block
        b3.wait()  # A has left; B still inside

    def b():
        b1.wait()
        seen["b_while_a_inside"] = tm.validation_enabled()
        with tm.validation(False):
            b2.wait()
            b3.wait()
            seen["b_inside_after_a_left"] = tm.validation_enabled()
        seen["b_after"] = tm.validation_enabled()

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)
    assert seen == {"a_inside": False, "b_while_a_inside": True, "b_inside_after_a_left": False, "b_after": True}
    assert tm.validation_enabled()


def test_a_block_in_one_thread_does_not_skip_checks_in_another():
    """While one thread is inside validation(False), another thread's permute still refuses an
    out-of-range id (before: the whole process skipped the checks)."""
    inside, done = threading.Event(), threading.Event()

    def holder():
        with tm.validation(False):
            inside.set()
            done.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert inside.wait(30)
        x = torch.randn(3, 4)
        ids = torch.tensor([[0], [7], [1]])  # 7 is out of range for E=4
        with pytest.raises((ValueError, IndexError), match="7|range"):
            tm.permute(x, ids, 4, backend="torch")
    finally:
        done.set()
        t.join(30)


def test_use_backend_is_per_thread_and_nested_blocks_restore():
    default = tm.get_backend()
    with tm.use_backend("torch"):
        assert tm.get_backend() == "torch"
        with tm.use_backend("triton"):
            assert tm.get_backend() == "triton"
        assert tm.get_backend() == "torch"
        other: list = []
        t = threading.Thread(target=lambda: other.append(tm.get_backend()))
        t.start()
        t.join(30)
        assert other == [default]
    assert tm.get_backend() == default


def test_blocks_are_per_asyncio_task():
    async def task(flag: bool, started: asyncio.Event, go: asyncio.Event):
        with tm.validation(flag):
            started.set()
            await go.wait()
            return tm.validation_enabled()

    async def main():
        s1, s2, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(task(False, s1, go))
        t2 = asyncio.create_task(task(True, s2, go))
        await s1.wait()
        await s2.wait()
        go.set()
        return await t1, await t2, tm.validation_enabled()

    assert asyncio.run(main()) == (False, True, True)


def test_set_validation_is_the_process_default_and_a_block_wins_inside():
    prev = tm.set_validation(False)
    try:
        assert not tm.validation_enabled()
        seen: list = []
        t = threading.Thread(target=lambda: seen.append(tm.validation_enabled()))
        t.start()
        t.join(30)
        assert seen == [False]  # the process default reaches every thread
        with tm.validation(True):
            assert tm.validation_enabled()
        assert not tm.validation_enabled()
    finally:
        tm.set_validation(prev)
    assert tm.validation_enabled() == prev


def test_bad_values_are_typed_errors():
    with pytest.raises(TypeError, match="bool"):
        with tm.validation("no"):
            pass
    with pytest.raises(ValueError, match="cuda.*not a backend"):
        with tm.use_backend("cuda"):
            pass
    with pytest.raises(TypeError, match="str"):
        with tm.use_backend(1):
            pass
    assert settings.resolve_backend(None) == tm.get_backend()
