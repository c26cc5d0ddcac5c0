"""Inference-time tools: expert-popularity estimation (Lina, paper 001 §5.2), placements with
replicas and packing (Lina; DeepSeek's EPLB as the baseline) served by an expert-parallel layer,
and ring-memory expert offloading with a host LFU cache over a disk tier (SE-MoE, paper 002
§2.2 and §2.4)."""

from ._released import ExpertsReleasedError, is_released, restore_experts
from .offload import HostLFUCache, OffloadChecksumError, OffloadedExperts
from .placement import MAX_PACKED_PER_DEVICE, Placement, eplb_placement, lina_placement
from .popularity import PopularityEstimator, choices_from_layers, l1_error, top_choices, top_k_match
from .replicated import LinaScheduler, ReplicatedMoELayer

__all__ = [
    "OffloadedExperts",
    "HostLFUCache",
    "OffloadChecksumError",
    "PopularityEstimator",
    "choices_from_layers",
    "top_choices",
    "l1_error",
    "top_k_match",
    "Placement",
    "lina_placement",
    "eplb_placement",
    "MAX_PACKED_PER_DEVICE",
    "ReplicatedMoELayer",
    "LinaScheduler",
    "ExpertsReleasedError",
    "restore_experts",
    "is_released",
]
