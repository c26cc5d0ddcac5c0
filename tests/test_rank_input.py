"""The refusal word of a step's first exchange (comm.errors.RankInputError, docs/rank-input.md)
on a one-rank gloo group in this process: which class every rank raises, what it names, and
that a healthy exchange is unchanged. The 2- and 4-rank behaviour (every rank ends in the same
error, at once) is the fault table's (tests/test_faults.py, bench/faults.py REFUSED_ROWS)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.comm import AllToAllDispatcher, RankIndexError, RankInputError, RankTypeError, RankValueError
from tritonmoe.comm.errors import input_status
from tritonmoe.comm.splits import exchange_counts


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_status_words():
    # any other error is reported as a ValueError
    assert [input_status(e) for e in (None, TypeError(), ValueError(), IndexError(), KeyError())] == [0, 1, 2, 3, 2]
    assert input_status(RankTypeError("x")) == 1  # a subclass maps to its base


@pytest.mark.parametrize("error, cls", [(TypeError("x is torch.float32"), RankTypeError),
                                        (ValueError("x has shape (6, 7)"), RankValueError),
                                        (IndexError("id 9 out of range"), RankIndexError)])
def test_a_refusal_in_the_counts_exchange_raises_its_class_naming_the_rank(one_rank_group, error, cls):
    counts = torch.tensor([[1, 2]])
    with pytest.raises(cls) as e:
        exchange_counts(counts, group=one_rank_group, status=error)
    assert isinstance(e.value, RankInputError) and isinstance(e.value, type(error))
    assert str(e.value).startswith(str(error)) and "rank 0 of the group refused its input" in str(e.value)
    assert e.value.failing_ranks == (0,) and e.value.messages == {0: f"{type(error).__name__}: {error}"}
    assert e.value.__cause__ is error
    plan = exchange_counts(counts, group=one_rank_group)  # the group is still usable, the plan unchanged
    assert plan.send_splits == [[3]] and plan.recv_counts.tolist() == [[[1, 2]]]


def test_refused_counts_and_layer_input(one_rank_group):
    disp = AllToAllDispatcher(2, one_rank_group)
    with pytest.raises(RankValueError, match="counts must be an integer tensor"):
        disp.exchange_counts(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(RankValueError, match="counts have 3 experts, the dispatcher 2"):
        disp.exchange_counts(torch.tensor([1, 2, 3]))
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(8, 12, 2, 1), ep_group=one_rank_group, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    want = layer(x)
    for bad, cls in ((x.float(), RankTypeError), (x[:, :7], RankValueError)):
        with pytest.raises(cls):  # the expert-parallel path reports it through its counts exchange
            layer(bad)
    assert torch.equal(layer(x), want)


def test_static_mode_carries_the_refusal_in_its_dispatch(one_rank_group):
    """The static expert-parallel mode (no counts exchange): a refused input runs the step on an
    empty stand-in batch whose status rows carry the word. With validation on it is read back
    (RankTypeError naming the rank, chained to the layer's own error); with validation off the
    rank raises its own TypeError, no host read. The status rows never touch a healthy result."""
    torch.manual_seed(0)
    cfg = tm.MoEConfig(8, 12, 2, 1, ep_capacity=3)
    layer = tm.MoELayer(cfg, ep_group=one_rank_group, dtype=torch.float64)
    ref = tm.MoELayer(cfg, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    want = layer(x)
    torch.testing.assert_close(want, ref(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(RankTypeError, match="rank 0 of the group refused its input") as e:
        layer(x.float())
    assert isinstance(e.value.__cause__, TypeError) and not isinstance(e.value.__cause__, RankInputError)
    assert e.value.failing_ranks == (0,) and "x is torch.float32" in e.value.messages[0]
    with tm.validation(False), pytest.raises(TypeError, match="x is torch.float32") as e:
        layer(x.float())
    assert not isinstance(e.value, RankInputError)
    assert torch.equal(layer(x), want)
    # what the stand-in rank sends: zero rows, and its word in each block's last row
    path = layer.expert_path
    sent = []
    orig = tm.experts.static.AllToAllFunction.apply

    def spy(t, *a):
        sent.append(t.detach().clone())
        return orig(t, *a)

    tm.experts.static.AllToAllFunction.apply = spy
    try:
        path.input_error = TypeError("refused")
        with tm.validation(False), torch.no_grad():
            empty = torch.zeros(0, 8, dtype=torch.float64)
            path(empty, layer.route(empty)[1], layer.expert_weights())
    finally:
        tm.experts.static.AllToAllFunction.apply = orig
        path.input_error = None
    dispatch = sent[0]  # [E*C + P, d]: expert 0's and 1's 3 rows, then the status row
    assert dispatch.shape == (2 * 3 + 1, 8)
    assert not dispatch[:6].any() and dispatch[6, 0] == input_status(TypeError()) and not dispatch[6, 1:].any()
