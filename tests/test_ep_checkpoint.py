"""Expert parallelism under PyTorch's activation-memory tools (2 gloo ranks, fp64).

`torch.utils.checkpoint(use_reentrant=False)` and `torch.autograd.graph.save_on_cpu()` hand
saved tensors back as other objects (recomputed, or copied and back): the exact weight-gradient
store matched parameters by the saved tensor's identity and raised in backward. Outputs and every
gradient must equal the plain layer's bitwise; a buffer-reusing memory strategy, which restores
its own saved activations, is refused under a non-reentrant checkpoint (the recomputed forward's
buffers would replace the restored ones: silently wrong gradients before) with a ValueError on
every rank, and works under save_on_cpu and a reentrant checkpoint.
"""

from _ckpt_cases import checkpoint_cases
from _dist import run_group, values_or_fail


def test_ep_layer_under_checkpoint_and_save_on_cpu():
    results, _ = run_group(2, checkpoint_cases, deadline_s=240.0)
    for equal, refused in values_or_fail(results):
        assert equal and all(equal.values()), {k: v for k, v in equal.items() if not v}
        assert refused == {"recompute": True, "offload": True, "auto": True}, refused
