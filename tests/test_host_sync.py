"""Host synchronizations, counted by tests/_sync.py (every device->host path: Python-level
scalar reads and copies patched, data-dependent ATen ops seen by a dispatch mode).

* The counter itself: each path is seen once, with the line that made it; plain device work
  is not counted.
* The static expert-parallel mode (``MoEConfig(ep_capacity=C)``): a whole layer step (routing,
  auxiliary losses, expert path, shared expert, load statistics; forward and backward) makes no
  host sync with validation off, on 2 gloo ranks, for two configurations and ragged batches (a
  rank with zero tokens); with validation on exactly one, the commented read of the refused-input
  status words (docs/rank-input.md).
* The dynamic expert-parallel mode: its syncs are exactly the known, commented ones (each line
  carries a "host sync" comment): the counts exchange, and on the reference backend the
  reference's own row slicing and the exact weight-gradient flush; on the Triton kernels
  (pipelined, with capacity drops, a rank with zero tokens; unmanaged and with the memory
  strategies that re-dispatch in backward) the counts exchange alone.
"""

from __future__ import annotations

import pytest
import torch

import _sync_cases
from _dist import run_group, values_or_fail
from _sync import HostSyncs


def test_counter_sees_every_sync_path_once():
    x = torch.randn(5)
    ids = torch.tensor([1, 2])
    with HostSyncs() as s:
        x.sum().item()
        bool(x.sum() > 0)
        if x.sum():  # a tensor in a Python condition
            pass
        int(x[0])
        float(x[1])
        x.tolist()
        x.numpy()
        x.cpu()
        x.to("cpu")
        x[x > 0]  # boolean-mask indexing: the result's size is data-dependent
        torch.nonzero(x)
        x.nonzero()
        torch.equal(x, x)
        torch.repeat_interleave(ids)
        torch.unique(ids)
        torch.masked_select(x, x > 0)
        torch.cuda.synchronize  # noqa: B018 - looked up, not called: not counted
    kinds = [y.kind for y in s.syncs]
    assert kinds == [
        "Tensor.item", "Tensor.__bool__", "Tensor.__bool__", "Tensor.__int__", "Tensor.__float__", "Tensor.tolist",
        "Tensor.numpy", "Tensor.cpu", "Tensor.to", "aten.index", "torch.nonzero", "Tensor.nonzero", "torch.equal",
        "aten.repeat_interleave", "aten._unique2", "aten.masked_select",
    ], kinds
    here = __file__
    assert all(y.file == here for y in s.syncs)
    assert s.syncs[0].source().strip() == "x.sum().item()"
    # device-side work only: nothing counted (sizes from shapes, masks applied with where)
    with HostSyncs() as s:
        y = torch.where(x > 0, x, torch.zeros_like(x)).cumsum(0)
        torch.repeat_interleave(ids, ids, output_size=3)
        x.to(torch.float64)
        y[torch.tensor([0, 2])]
        torch.argsort(x, stable=True)
        x.new_zeros(3).index_add_(0, torch.tensor([0, 0]), torch.ones(2))
    assert s.syncs == [], s.where()
    # the patches are gone after the block
    assert torch.Tensor.item is torch._C.TensorBase.item


#: The dynamic expert-parallel layer's host syncs on the reference backend (CPU): (file,
#: function). The counts exchange is the mode's one essential sync (the receive sizes); the rest
#: are the reference implementations slicing rows on the host and the exact weight-gradient
#: flush (tritonmoe.core.exact); on CUDA the Triton kernels replace the reference's.
DYNAMIC_SYNCS = {
    ("comm/splits.py", "exchange_counts"),
    ("tritonmoe/reference.py", "copy_segments"),
    ("tritonmoe/reference.py", "clamped_offsets"),
    ("tritonmoe/core/exact.py", "flush"),
}


@pytest.mark.dist
def test_static_ep_layer_step_is_sync_free_and_dynamic_syncs_are_the_commented_ones():
    results, _ = run_group(2, _sync_cases.layer_syncs, deadline_s=180, pg_timeout_s=60)
    for rank, cases in enumerate(values_or_fail(results)):
        assert {c for c in cases if c.startswith("dynamic-triton")} == {
            "dynamic-triton None", "dynamic-triton recomm", "dynamic-triton recomm_recompute"}
        for case, syncs in cases.items():
            if case.startswith("dynamic-triton"):
                # the kernels' path, pipelined (3 micro-ops) with capacity drops: the counts
                # exchange only (no per-micro-op permute sizing, no W-step count read)
                assert [w.split("(")[1].rstrip(")") for _, w, _, _ in syncs] == ["exchange_counts"], (rank, syncs)
                continue
            if case.endswith("validation on"):  # static, validation on: the status words' one read
                assert [(w.split(":")[0].rsplit("/", 1)[-1], w.split("(")[1].rstrip(")"), c)
                        for _, w, _, c in syncs] == [("static.py", "_check_words", True)], (rank, case, syncs)
                continue
            if case != "dynamic":
                assert syncs == [], (rank, case, syncs)
                continue
            assert syncs, "the dynamic path must show its counts exchange (the counter's control)"
            uncommented = [s for s in syncs if not s[3]]
            assert not uncommented, (rank, uncommented)
            where = {(w.split(":")[0], w.split("(")[1].rstrip(")")) for _, w, _, _ in syncs}
            assert where == DYNAMIC_SYNCS, (rank, where)
            assert sum(1 for _, w, _, _ in syncs if "exchange_counts" in w) == 1, (rank, syncs)
