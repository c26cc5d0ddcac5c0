"""A non-finite selection bias (expert_bias) is refused or made loud, never silently routed.

Before: the public route with validation off, and the layer always, routed with a NaN / inf bias
entry as if nothing happened (the NaN expert silently never chosen, the +inf expert always).
Now: :func:`tritonmoe.check_expert_bias` refuses it on the bias update path (one sync for any
number of biases); the public route raises with validation on and, with validation off, makes
every routing weight NaN on the device (no host sync), on both backends.
"""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm

BACKENDS = ["torch", "triton"]  # triton runs in the interpreter on CPU
BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def _bias(E=6, at=2, value=float("nan")):
    b = torch.linspace(-0.5, 0.5, E)
    if at is not None:
        b[at] = value
    return b


@pytest.mark.parametrize("value", BAD_VALUES)
def test_check_expert_bias_names_expert_and_value(value):
    with pytest.raises(ValueError) as err:
        tm.check_expert_bias(_bias(value=value), 6)
    msg = str(err.value)
    assert f"expert_bias[2]={value}" in msg and "1 of 6 entries" in msg and "restore the bias" in msg, msg


def test_check_expert_bias_many_biases_one_verdict():
    """Every layer's bias in one call: the first bad one is named, the others counted."""
    biases = [_bias(at=None), _bias(at=4, value=float("inf")), _bias(at=0)]
    with pytest.raises(ValueError, match=r"expert_bias\[1\]\[4\]=inf .*\(and 1 more biases\)"):
        tm.check_expert_bias(biases, 6)
    tm.check_expert_bias([_bias(at=None), _bias(at=None).double()], 6)
    tm.check_expert_bias([])
    tm.check_expert_bias(_bias(at=None))


@pytest.mark.parametrize(
    "bias,num_experts,exc,fragment",
    [
        (torch.zeros(6, dtype=torch.int64), 6, TypeError, "expert_bias has dtype torch.int64"),
        (torch.zeros(2, 3), 6, ValueError, "expert_bias must be 1-D"),
        (torch.zeros(5), 6, ValueError, "expected [6]"),
        ([torch.zeros(6), [0.0] * 6], 6, TypeError, "expert_bias[1] must be a torch.Tensor"),
        ("zeros", 6, TypeError, "a tensor or a sequence of tensors"),
        (torch.zeros(6), 0, ValueError, "num_experts=0"),
    ],
)
def test_check_expert_bias_bad_arguments(bias, num_experts, exc, fragment):
    with pytest.raises(exc) as err:
        tm.check_expert_bias(bias, num_experts)
    assert fragment in str(err.value), str(err.value)


def test_expert_bias_finite_is_a_device_flag():
    flag = tm.expert_bias_finite(_bias())
    assert flag.dtype == torch.bool and flag.dim() == 0 and not bool(flag)
    assert bool(tm.expert_bias_finite(_bias(at=None)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", BAD_VALUES)
def test_route_refuses_nonfinite_bias_with_validation_on(value, backend):
    logits = torch.randn(5, 6)
    with pytest.raises(ValueError, match=rf"expert_bias\[2\]={value}"):
        tm.route(logits, 2, expert_bias=_bias(value=value), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", BAD_VALUES)
def test_route_nan_weights_with_validation_off(value, backend):
    """Validation off: every weight NaN (so the loss is), still differentiable; a finite bias
    leaves the weights exactly as the implementation computed them."""
    logits = torch.randn(5, 6, requires_grad=True)
    with tm.validation(False):
        r = tm.route(logits, 2, expert_bias=_bias(value=value), backend=backend)
        ok = tm.route(logits, 2, expert_bias=_bias(at=None), backend=backend)
    assert r.topk_weights.isnan().all()
    # the weights stay in the graph: what they multiply (the expert outputs) gets NaN gradients
    y = torch.randn(5, 2, requires_grad=True)
    (r.topk_weights * y).sum().backward()
    assert y.grad.isnan().all() and logits.grad is not None
    impl = tm.backends.implementation("route", backend, logits.device, logits.dtype)
    assert torch.equal(ok.topk_weights, impl(logits, 2, expert_bias=_bias(at=None)).topk_weights)


def test_layer_output_is_nan_with_nonfinite_bias():
    layer = tm.MoELayer(tm.MoEConfig(8, 12, 6, 2, expert_bias=True))
    with torch.no_grad():
        layer.expert_bias.copy_(_bias())
    assert layer(torch.randn(3, 8)).isnan().all()


def test_nonfinite_bias_guard_adds_no_host_sync_to_the_forward():
    """The forward's guard stays on the device: a layer's forward dispatches the same
    host-synchronizing ops (counted by a dispatch mode) with a NaN bias as with a finite one, and
    the guard itself dispatches none."""
    from _ep_cases import SyncCounter

    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(8, 12, 6, 2, expert_bias=True))
    x = torch.randn(5, 8)
    counts = []
    for value in (0.25, float("nan")):
        with torch.no_grad():
            layer.expert_bias.copy_(_bias(value=value))
        with SyncCounter() as c:
            layer(x).sum().backward()
        counts.append(c.syncs)
    assert counts[0] == counts[1], counts
    with SyncCounter() as c:
        w = tm.bias.nan_weights_if_nonfinite(torch.rand(5, 2), _bias())
    assert c.syncs == [] and w.isnan().all()


def test_update_expert_bias_refusal_is_typed_and_keeps_loads():
    """Without a group: ExpertBiasError (a ValueError) naming the layer and expert, nothing
    written, the loads kept for the next try; a rate that would overflow the bias's dtype too."""
    torch.manual_seed(0)
    layers = [tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, expert_bias=True)) for _ in range(2)]
    for layer in layers:
        layer(torch.randn(7, 8))
    loads = [layer.expert_load().clone() for layer in layers]
    with torch.no_grad():
        layers[1].expert_bias[3] = float("-inf")
    with pytest.raises(tm.ExpertBiasError, match=r"expert_bias\[1\]\[3\]=-inf"):
        tm.update_expert_bias(layers, rate=0.01)
    assert all(torch.equal(layer.expert_load(), load) for layer, load in zip(layers, loads))
    assert torch.equal(layers[0].expert_bias, torch.zeros(4))
    with torch.no_grad():
        layers[1].expert_bias[3] = 3e38
    with pytest.raises(tm.ExpertBiasError, match="overflows its dtype"):
        tm.update_expert_bias(layers, rate=1e38)
    tm.update_expert_bias(layers, rate=0.01)
    assert not any(layer.expert_load().any() for layer in layers)


def test_update_expert_bias_refuses_a_layer_listed_twice():
    """The same layer twice would get two sign steps (its load read twice): ValueError naming both
    positions, before anything is read or written; a model's layers are collected once each."""
    torch.manual_seed(0)
    a, b = (tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, expert_bias=True)) for _ in range(2))
    for layer in (a, b):
        layer(torch.randn(7, 8))
    loads = [layer.expert_load().clone() for layer in (a, b)]
    with pytest.raises(ValueError, match=r"layers\[2\] is the same layer as layers\[0\]"):
        tm.update_expert_bias([a, b, a], rate=0.01)
    with pytest.raises(ValueError, match=r"layers\[1\] is the same layer as layers\[0\]"):
        tm.update_expert_bias([a, a], rate=0.01)
    assert torch.equal(a.expert_bias, torch.zeros(4)) and torch.equal(b.expert_bias, torch.zeros(4))
    assert all(torch.equal(layer.expert_load(), load) for layer, load in zip((a, b), loads))
    # one step each, the size the sign rule gives: |step| == rate where the load is off the mean
    tm.update_expert_bias([a, b], rate=0.01)
    for layer, load in zip((a, b), loads):
        f = load.double()
        assert torch.equal(layer.expert_bias, (0.01 * torch.sign(f.mean() - f)).float())
