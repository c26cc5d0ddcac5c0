"""comm.compat.all_gather_single: the new torch.distributed name where it exists, the old one
otherwise (torch 2.11 lacks all_gather_single; 2.13 deprecates all_gather_into_tensor)."""

from __future__ import annotations

import torch.distributed as dist

from tritonmoe.comm.compat import all_gather_single, reduce_scatter_single


def _recorder(calls, name):
    def fn(out, inp, group=None, async_op=False):
        calls.append((name, out, inp, group, async_op))
        return name

    return fn


def test_uses_the_new_name_when_present(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", _recorder(calls, "new"), raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", _recorder(calls, "old"))
    assert all_gather_single("o", "i", group="g", async_op=True) == "new"
    assert calls == [("new", "o", "i", "g", True)]


def test_falls_back_to_the_old_name(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", _recorder(calls, "old"))
    assert all_gather_single("o", "i") == "old"
    assert calls == [("old", "o", "i", None, False)]


def test_reduce_scatter_uses_the_new_name_when_present_else_the_old(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "reduce_scatter_single", _recorder(calls, "new"), raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", _recorder(calls, "old"))
    assert reduce_scatter_single("o", "i", group="g", async_op=True) == "new"
    monkeypatch.delattr(dist, "reduce_scatter_single")
    assert reduce_scatter_single("o", "i") == "old"
    assert calls == [("new", "o", "i", "g", True), ("old", "o", "i", None, False)]
