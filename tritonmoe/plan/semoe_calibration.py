"""SE-MoE calibration entries for the elastic allocator (CAL-19, 002 Table 3) and the
partitioned embedding's memory (CAL-20, 002 Table 4); listed in :data:`ENTRIES` for
:data:`tritonmoe.plan.calibrate.CALIBRATIONS` (PAPERS.md section 6).

Nothing here is fitted to the paper's results. CAL-20's model is the partition's own
arithmetic: each rank stops holding ``(N - 1) / N`` of the table's ``V * H`` parameters and
their states, at SE-MoE's own 16 bytes per parameter (002 section 2.1: fp16 weight and gradient,
fp32 master weight and two Adam moments); the denominator is the paper's measured baseline
memory (a stated input of Table 4, not a result). The 1/N shard itself is measured by
tests/test_embedding.py from the storages the parameter and the optimizer hold.
"""

from __future__ import annotations

from tritonmoe.parallel.elastic import allocate_tasks

from .calibration_table import CalEntry

__all__ = ["embedding_memory_drop", "elastic_per_card_gain"]

_V = 50304  # 002 Table 4's vocabulary
_N = 8  # 8 V100 (Reading: the header is misaligned)
_BYTES_PER_PARAM = 16  # 002 section 2.1
_TABLE4 = {2048: (7.46, 5.78), 4096: (12.80, 9.70), 8192: (27.80, 20.49)}  # hidden -> (baseline GB, partitioned GB)


def embedding_memory_drop(hidden: int, baseline_gb: float, ranks: int = _N, vocab: int = _V) -> float:
    """Predicted relative memory drop per rank when the replicated [V, H] table (and its
    gradient and optimizer states) is partitioned over ``ranks``."""
    saved = (ranks - 1) / ranks * vocab * hidden * _BYTES_PER_PARAM
    return saved / (baseline_gb * 1e9)


def _cal20(hidden: int):
    def run() -> dict:
        base, part = _TABLE4[hidden]
        pred = embedding_memory_drop(hidden, base)
        return {"simulated": pred, "detail": f"saves {(_N - 1) / _N * _V * hidden * _BYTES_PER_PARAM / 1e9:.2f} GB of "
                f"{base} GB; the paper measured {base - part:.2f} GB ({(base - part) / base:.3f})"}

    return run


def _cal20_mean() -> dict:
    preds = [embedding_memory_drop(h, b) for h, (b, _) in _TABLE4.items()]
    return {"simulated": sum(preds) / 3, "detail": "predicted " + "/".join(f"{p:.3f}" for p in preds) + " (the order "
            "of the paper's drops is " + ("" if preds == sorted(preds) else "not ") + "reproduced: the paper's grow "
            "with H, the prediction's depend on the measured baselines)"}


def elastic_per_card_gain(batches=(512, 256, 128, 128), gpus_before: int = 4, gpus_after: int = 8,
                          lockstep: bool = True) -> tuple[list[int], float]:
    """(allocation, per-card throughput ratio after / before) of 002 Table 3 with per-GPU time
    proportional to the samples it processes. ``lockstep``: a step ends when the busiest GPU
    ends (the min-max objective); otherwise tasks run independently (each GPU always busy)."""
    alloc = allocate_tasks(list(batches), gpus_after)
    before = allocate_tasks(list(batches), gpus_before)
    if not lockstep:
        return alloc, 1.0
    total = sum(batches)
    per_card = lambda g: total / max(b / n for b, n in zip(batches, g)) / sum(g)  # noqa: E731
    return alloc, per_card(alloc) / per_card(before)


def _cal19() -> dict:
    alloc, lock = elastic_per_card_gain()
    _, free = elastic_per_card_gain(lockstep=False)
    return {"simulated": lock, "detail": f"allocation {alloc} (the paper's 4/2/1/1); per-card ratio {lock:.2f} when the "
            f"busiest GPU sets the step, {free:.2f} when tasks run independently: the paper's 1.182 lies between and "
            "needs a fixed per-step cost it does not state (PAPERS.md CAL-19: a/c = 153.5 samples); not fitted"}


#: CAL-19 and CAL-20, registered by :mod:`tritonmoe.plan.calibrate` over its placeholders.
ENTRIES = (
    CalEntry("CAL-19", "SE-MoE 002 Table 3", "per-card throughput, 4/2/1/1 on 8 GPUs vs 1/1/1/1 on 4", "", 1.182,
             run=_cal19, free="per-GPU time proportional to its samples (no fixed cost: the paper gives none)"),
    CalEntry("CAL-20", "SE-MoE 002 Table 4", "embedding partition memory drop, mean over hidden 2048/4096/8192", "",
             round(sum((b - p) / b for b, p in _TABLE4.values()) / 3, 4), run=_cal20_mean,
             free="16 bytes per parameter (002 §2.1); N = 8; V = 50304; the baseline GB is the paper's"),
    *[CalEntry(f"CAL-20-h{h}", "SE-MoE 002 Table 4", f"embedding partition memory drop, hidden {h}", "", round((b - p) / b, 4),
               run=_cal20(h), free="16 bytes per parameter (002 §2.1); N = 8; V = 50304; the baseline GB is the paper's")
      for h, (b, p) in _TABLE4.items()],
    CalEntry("CAL-20-speed", "SE-MoE 002 Table 4", "embedding partition throughput gain", "", "+4.2/+11.2/+15.6%",
             blocked="needs the GPT step of Table 4 (layers, sequence length and the per-step compute are not stated; "
                     "'params 100/300/700 M' leaves almost nothing beside the table at H = 2048); not simulated"),
)
