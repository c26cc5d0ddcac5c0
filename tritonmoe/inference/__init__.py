"""Inference-time tools: ring-memory expert offloading (SE-MoE, paper 002 §2.4)."""

from .offload import OffloadedExperts

__all__ = ["OffloadedExperts"]
