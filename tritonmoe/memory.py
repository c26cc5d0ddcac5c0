"""Memory strategies of the pipelined expert-parallel layer (MPMoE, paper 004), user-facing.

``MoEConfig(memory_strategy=..., memory_budget_bytes=..., memory_mi_buffers=...)`` with ``ep_group``:

* ``None`` (default): the unmanaged pipeline (its expert FFN keeps whatever its ops save).
* ``"keep"``: every micro-op keeps its own dispatched input (DI) and first-GEMM output (MI):
  nothing reused, nothing restored (the paper's PMoE baseline).
* ``"offload"`` (S1), ``"recomm"`` (S2), ``"recompute"`` (S3), ``"recomm_recompute"`` (S4):
  DI lives in two shared device buffers and MI in one (micro-op i overwrites i-2's / i-1's), or
  in two with ``memory_mi_buffers=2`` (i overwrites i-2's: its host copy runs beside the next
  micro-op's compute); what backward lacks is restored from pinned host copies, by re-running
  the dispatch all-to-all, or by recomputing the first GEMM (:mod:`tritonmoe.comm.programs.memory_reuse`).
* ``"auto"``: the planner's choice of the strategy (and of the degree with
  ``pipeline_degree="auto"``) under ``memory_budget_bytes`` (:mod:`tritonmoe.plan.memory`), for
  the config's ``memory_mi_buffers`` (``choose_memory(..., mi_buffers=(1, 2))`` compares both
  counts offline).

The trade-off: every reuse strategy keeps ``(2*d + n1) * max_i R_i`` elements on the device
(``2*(d + n1) * max_i R_i`` with two MI buffers) instead of ``(d + n1) * sum_i R_i``; offloading
costs host memory and copy bandwidth (hidden behind compute when the copy is shorter),
re-communicating costs one all-to-all per micro-op in backward, recomputing one first GEMM per
micro-op.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tritonmoe.comm.programs.memory_reuse import RESTORE, STRATEGIES

__all__ = ["STRATEGIES", "MEMORY_STRATEGIES", "uses_offload", "pinned_memory_available", "check_memory_strategy",
           "check_offload"]

#: Values of ``MoEConfig.memory_strategy`` besides None.
MEMORY_STRATEGIES = STRATEGIES + ("auto",)


def check_memory_strategy(value: Any) -> Optional[str]:
    """``value`` if it names a strategy (or is None); else a TypeError / ValueError naming it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"memory_strategy must be a str or None, got {type(value).__name__} {value!r}")
    if value not in MEMORY_STRATEGIES:
        raise ValueError(f"memory_strategy={value!r} is not a memory strategy; use one of "
                         f"{', '.join(map(repr, MEMORY_STRATEGIES))} (or None for the unmanaged pipeline)")
    return value


def uses_offload(strategy: Optional[str]) -> bool:
    """Whether ``strategy`` copies activations to host memory."""
    return strategy in RESTORE and "offload" in RESTORE[strategy]


def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated here (needs a CUDA runtime)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def check_offload(strategy: Optional[str], device: torch.device) -> None:
    """A ValueError when ``strategy`` offloads activations of a CUDA layer but pinned host memory
    cannot be allocated (the copies would be synchronous and unsafe to overlap). CPU layers copy
    into ordinary host memory on a worker thread."""
    if uses_offload(strategy) and torch.device(device).type == "cuda" and not pinned_memory_available():
        raise ValueError(
            f"memory_strategy={strategy!r} copies activations to pinned host memory, which is not available here "
            "(no CUDA runtime, or pin_memory failed); use memory_strategy='recomm_recompute' (no host copies) or "
            "'auto' (which then skips the offloading strategies)"
        )
