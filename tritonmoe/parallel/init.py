"""Layout-independent initialization of expert weights.

Expert ``e``'s initial weights depend on a base seed and ``e`` alone: each expert draws from its
own generator, seeded with :func:`expert_seed` (base seed, global expert index). So a layer built
on 1, 2 or 4 expert-parallel ranks (or with experts packed several per device, or sharded by
FSDP later) holds the same global experts, and the replicas of an expert on the ranks of an
expert-data-parallel group are identical without a broadcast.

The base seed is drawn from the default CPU generator (:func:`draw_seed`) after the router's
initialization, so seeding every rank identically (``torch.manual_seed(s)`` before building the
model, which the replicated router needs anyway) gives every rank the same router and the same
base seed; the layer checks that the base seed agrees across its group at construction.

Values depend on the device type of the weights (CPU and CUDA generators draw different
streams), not on the device index, the rank or the layout.
"""

from __future__ import annotations

import math

import torch

__all__ = ["draw_seed", "expert_seed", "init_experts_"]

_MASK64 = (1 << 64) - 1


def draw_seed() -> int:
    """A 63-bit seed drawn from the default CPU generator (advances it)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def expert_seed(base_seed: int, expert: int) -> int:
    """The generator seed of global expert ``expert`` (a 63-bit mix of both; distinct experts get
    unrelated streams)."""
    if expert < 0:
        raise ValueError(f"expert={expert} must be >= 0")
    return _splitmix64(_splitmix64(base_seed & _MASK64) ^ expert) >> 1


@torch.no_grad()
def init_experts_(w1: torch.Tensor, w2: torch.Tensor, *, base_seed: int, expert_start: int, d_model: int, d_ffn: int) -> None:
    """Fill local experts ``w1`` [E_local, d_model, n1] and ``w2`` [E_local, d_ffn, d_model]
    in place: local expert i is global expert ``expert_start + i``; its ``w1`` then ``w2`` are
    drawn from its own generator, uniform in +-1/sqrt(fan_in) as nn.Linear's default init
    (fan_in = d_model for w1, d_ffn for w2). Meta tensors are left alone."""
    if w1.is_meta or w2.is_meta:
        return
    b1 = 1.0 / math.sqrt(d_model)
    b2 = 1.0 / math.sqrt(d_ffn)
    for i in range(w1.shape[0]):
        g = torch.Generator(device=w1.device).manual_seed(expert_seed(base_seed, expert_start + i))
        w1[i].uniform_(-b1, b1, generator=g)
        w2[i].uniform_(-b2, b2, generator=g)
