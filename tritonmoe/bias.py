"""Checks of the selection bias ``expert_bias`` (auxiliary-loss-free load balancing).

The bias is training state that a loop updates every step (DeepSeek-V3's sign rule:
``bias += rate * sign(mean_load - load_e)``). A bad update (a NaN rate, a corrupt checkpoint, an
overflow) leaves non-finite entries, and a non-finite entry silently reroutes every token: a NaN
entry is ranked as -inf (its expert is never chosen), ``+inf`` forces its expert into every
token's top-k, ``-inf`` bans it. Nothing in the output would show it. Three tools, by cost:

* :func:`check_expert_bias` - for the bias update path (once per optimizer step, not per
  forward): types and shapes, then one host sync for any number of biases, raising a
  ``ValueError`` that names the bias, the expert and the value. The aux-loss-free update helper
  calls it after each update; call it after loading a checkpoint.
* :func:`expert_bias_finite` - a 0-d bool tensor on the bias's device, no host sync: log it from
  a hook whenever the loop already synchronizes (e.g. with the loss).
* :func:`nan_weights_if_nonfinite` - the forward's guard, no host sync: the routing weights of
  every token become NaN when any bias entry is non-finite, so the loss is NaN on the very step
  the bias broke (which every training loop already watches for: NaN-loss checks, AMP's grad
  scaler skipping the step) instead of training on silently wrong routing. All tokens, because
  one bad entry changes every token's candidate set. Costs a reduction over E and an
  elementwise op on the [T, k] weights. The public :func:`tritonmoe.route` applies it (and, with
  validation on, raises instead, before any launch).
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from tritonmoe.core import validation as V
from tritonmoe.comm.compat import all_gather_single
from tritonmoe.reference import expert_bias_finite, nan_weights_if_nonfinite
from tritonmoe.comm.errors import backend_errors
from tritonmoe.comm.splits import comm_device

__all__ = [
    "ExpertBiasError", "check_expert_bias", "expert_bias_finite", "nan_weights_if_nonfinite", "update_expert_bias",
]


def _as_list(bias) -> list[torch.Tensor]:
    if isinstance(bias, torch.Tensor):
        return [bias]
    if isinstance(bias, (str, bytes)) or not isinstance(bias, Iterable):
        raise TypeError(f"expert_bias must be a tensor or a sequence of tensors, got {type(bias).__name__}")
    return list(bias)


def _check_args(biases: list[torch.Tensor], num_experts: Optional[int], names: list[str]) -> None:
    if num_experts is not None:
        V.positive_int("num_experts", num_experts)
    for name, b in zip(names, biases):
        V.float_tensor(name, b, 1)
        if num_experts is not None and b.shape[0] != num_experts:
            raise ValueError(f"{name} has shape {tuple(b.shape)}; expected [{num_experts}] (one entry per expert)")


def check_expert_bias(
    bias: Union[torch.Tensor, Iterable[torch.Tensor]],
    num_experts: Optional[int] = None,
    *,
    name: str = "expert_bias",
) -> None:
    """Raise unless every selection bias is a finite 1-D float tensor (of ``num_experts`` entries).

    Args:
        bias: one bias ``[E]`` or a sequence of them (e.g. every MoE layer's ``expert_bias``
            buffer): all are checked with a single host sync.
        num_experts: E, when the caller knows it (a layer's ``config.num_experts``).
        name: how the bias is called in messages; with a sequence, entry i is ``name[i]``.

    Raises:
        TypeError: not a tensor, or not a floating dtype.
        ValueError: not 1-D or not E entries; or a non-finite entry (the message names the bias,
            the expert and the value, and says how to recover).

    Cost: always the shape and dtype checks; then one reduction per bias and one host sync in
    all (one per device), so call it on the bias update path (once per step), not inside a forward.
    """
    single = isinstance(bias, torch.Tensor)
    biases = _as_list(bias)
    names = [name] if single else [f"{name}[{i}]" for i in range(len(biases))]
    _check_args(biases, num_experts, names)
    if not biases:
        return
    # One flag per bias, stacked per device and read back at once.
    by_device: dict[torch.device, list[int]] = {}
    for i, b in enumerate(biases):
        by_device.setdefault(b.device, []).append(i)
    bad: list[int] = []
    for idx in by_device.values():
        finite = torch.stack([torch.isfinite(biases[i].detach()).all() for i in idx])
        bad += [idx[j] for j in (~finite).nonzero().flatten().tolist()]  # host sync: the verdict (one per device)
    if not bad:
        return
    bad.sort()
    raise V.nonfinite_bias_error(names[bad[0]], biases[bad[0]], others=len(bad) - 1)


class ExpertBiasError(ValueError):
    """The aux-loss-free bias update refused to run (a non-finite bias or load, or ranks that
    disagree); with a ``group``, raised on every rank of it with the same verdict, nothing
    written and the loads kept for the next try."""


def _collect_layers(layers) -> list:
    if isinstance(layers, torch.nn.Module) and not hasattr(layers, "expert_load"):
        layers = [m for m in layers.modules() if hasattr(m, "expert_load") and getattr(m, "expert_bias", None) is not None]
    elif isinstance(layers, torch.nn.Module):
        layers = [layers]
    elif isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be a MoELayer, a sequence of them or a model, got {type(layers).__name__}")
    layers = list(layers)
    first: dict[int, int] = {}
    for i, layer in enumerate(layers):
        if not hasattr(layer, "expert_load"):
            raise TypeError(f"layers[{i}] is a {type(layer).__name__}, not a tritonmoe.MoELayer")
        if getattr(layer, "expert_bias", None) is None:
            raise ValueError(f"layers[{i}] has no selection bias: build it with MoEConfig(..., expert_bias=True)")
        # one layer listed twice would get two steps (and its load would be read, then zeroed)
        j = first.setdefault(id(layer), i)
        if j != i:
            raise ValueError(f"layers[{i}] is the same layer as layers[{j}]; pass each MoE layer once (a layer listed "
                             "twice would have its bias moved twice)")
    return layers


def _bad_entries(layer, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Entries of the layer's update that are or could become non-finite: a non-finite bias
    entry, a non-finite load, or ``bias +- rate`` overflowing the bias's dtype (so the verdict
    holds whatever the reduced loads turn out to be). A device scalar (no sync)."""
    b = layer.expert_bias.detach()
    r = torch.tensor(rate, dtype=torch.float64, device=b.device).to(b.dtype)
    bad = ~(torch.isfinite(b) & torch.isfinite(b + r) & torch.isfinite(b - r))
    n = bad.sum()
    if load.is_floating_point():
        n = n + (~torch.isfinite(load)).sum().to(n.device)
    return n


@torch.no_grad()
def update_expert_bias(layers, *, rate: float = 1e-3, group=None) -> list[torch.Tensor]:
    """The auxiliary-loss-free balancing step (DeepSeek-V3; Megatron's rule): for each MoE layer,
    ``expert_bias += rate * sign(mean_load - load)``, where ``load`` [E] is the tokens routed to
    each expert since the last update (:meth:`tritonmoe.MoELayer.expert_load`, consumed here),
    summed over ``group``.

    Args:
        layers: a :class:`~tritonmoe.MoELayer` built with ``expert_bias=True``, a sequence of
            distinct ones (a layer listed twice raises ``ValueError``), or a model (every MoE
            layer with a bias in it).
        rate: the update rate (DeepSeek-V3: 1e-3); finite, > 0.
        group: the process group over which every replica of the bias sees different tokens (the
            data-parallel x expert-parallel ranks; usually the world), or None for this process's
            loads alone.

    Returns: the loads used (int64 [E] per layer, summed over ``group``), for logging.

    Call it once per optimizer step, outside the forward. Before anything is written, every
    bias is checked: a non-finite entry (or one that ``+- rate`` would overflow) raises
    :class:`ExpertBiasError` (a ``ValueError``) naming the layer, the expert and the value, leaves
    every bias and every load as it was. With ``group`` the verdict is collective: one small
    all-gather (each rank's argument check, layer count, expert count and bad-entry count; one
    host sync) comes before the loads' all-reduce, so when any rank has a bad bias, bad
    arguments or another set of layers, every rank raises (a rank whose own arguments were bad
    raises its ``TypeError`` / ``ValueError``, the others :class:`ExpertBiasError` naming it)
    and none goes on alone into a collective the others never join. The forward needs no sync
    for any of this (a non-finite bias makes its routing weights NaN on the device,
    :func:`nan_weights_if_nonfinite`).
    """
    import math

    import torch.distributed as dist


    err: Optional[BaseException] = None
    found: list = []
    try:
        if not V.is_real(rate) or not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate={rate!r} must be a finite number > 0 (DeepSeek-V3 uses 1e-3)")
        found = _collect_layers(layers)
    except (TypeError, ValueError) as e:
        if group is None:
            raise
        err, found = e, []
    layers = found
    loads = [layer.expert_load() for layer in layers]  # read, consumed only once the update is written
    bad = [_bad_entries(layer, load, float(rate)) for layer, load in zip(layers, loads)] if err is None else []
    total_E = sum(load.numel() for load in loads)
    if group is not None:

        dev = comm_device(group)
        nbad = torch.stack(bad).sum().to(dev) if bad else torch.zeros((), dtype=torch.int64, device=dev)
        head = torch.stack([
            torch.tensor(int(err is not None), dtype=torch.int64, device=dev),
            torch.tensor(len(layers), dtype=torch.int64, device=dev),
            torch.tensor(total_E, dtype=torch.int64, device=dev),
            nbad.to(torch.int64),
        ])
        W = dist.get_world_size(group)
        table_t = torch.empty(W * 4, dtype=torch.int64, device=dev)
        with backend_errors("update_expert_bias's argument check (all-gather)", group):
            all_gather_single(table_t, head, group=group)
        table = table_t.view(W, 4).tolist()  # host sync: the verdict (the update path, once per step)
        failed = [r for r in range(W) if table[r][0]]
        if err is not None:
            raise err
        if failed:
            raise ExpertBiasError(
                f"update_expert_bias: rank(s) {failed} of the group passed bad arguments (they raised them); no rank "
                "updated its biases. Call it with the same layers and rate on every rank"
            )
        shapes = {(row[1], row[2]) for row in table}
        if len(shapes) > 1:
            per = ", ".join(f"rank {r}: {table[r][1]} layers / {table[r][2]} experts" for r in range(W))
            raise ExpertBiasError(
                f"update_expert_bias: the ranks of the group passed different layers ({per}); every rank must pass "
                "its replicas of the same MoE layers, in the same order. Nothing was written"
            )
        bad_ranks = [r for r in range(W) if table[r][3]]
        if bad_ranks:
            me = dist.get_rank(group)
            where = ", ".join(f"rank {r}: {table[r][3]} entries" for r in bad_ranks)
            local = f" On this rank: {_describe_bad(layers, loads, float(rate))}." if me in bad_ranks else ""
            raise ExpertBiasError(
                f"update_expert_bias: a non-finite (or overflowing) expert_bias or load on rank(s) {bad_ranks} "
                f"({where}); no rank updated its biases and the loads are kept.{local} Restore the biases from the "
                "last good step (or reset them to zeros) on every rank and check the update rate"
            )
    elif bad and bool(torch.stack([b.to(bad[0].device) for b in bad]).any()):  # host sync: the verdict
        raise ExpertBiasError(f"update_expert_bias: {_describe_bad(layers, loads, float(rate))}; nothing was written")
    if not layers:
        return []
    if group is not None:
        flat = torch.cat(loads)
        with backend_errors("the expert-load allreduce of update_expert_bias", group):
            dist.all_reduce(flat, group=group)
        summed = list(flat.split([load.numel() for load in loads]))
    else:
        summed = [load.clone() for load in loads]
    for layer, load in zip(layers, summed):
        f = load.to(torch.float64)
        step = torch.sign(f.mean() - f) * rate
        layer.expert_bias.copy_(layer.expert_bias + step.to(layer.expert_bias.dtype))
        layer.expert_load(reset=True)
    return summed


def _describe_bad(layers, loads, rate: float) -> str:
    """The first bad layer's message (reads the values: error path only)."""
    for i, (layer, load) in enumerate(zip(layers, loads)):
        b = layer.expert_bias.detach()
        if not bool(torch.isfinite(b).all()):
            return str(V.nonfinite_bias_error(f"expert_bias[{i}]", b))
        if load.is_floating_point() and not bool(torch.isfinite(load).all()):
            e = int((~torch.isfinite(load)).nonzero()[0, 0])
            return f"layers[{i}]'s load[{e}]={float(load[e])} is not finite"
        if int(_bad_entries(layer, load, rate)):
            return (f"expert_bias[{i}] +- rate={rate} overflows its dtype {b.dtype} (max |bias| "
                    f"{float(b.abs().max()):.3g}); use a smaller rate")
    return "no bad entry here"
