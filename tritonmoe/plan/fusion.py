"""Choosing SE-MoE's gradient bucket size from the fitted alpha-beta model (PAPERS.md 2.3).

Every bucket pays the collective's startup (alpha) once, so fewer, larger buckets move the same
bytes in less network time; but a bucket's reduction starts only when the last gradient in it
is ready, so larger buckets start later and leave more of the reduction exposed after the
backward pass. :func:`choose_bucket_bytes` plays the backward pass on the bucket plan of each
candidate size (:func:`tritonmoe.comm.plan_buckets`, the same greedy rule the runtime uses):

* gradient i becomes ready at ``ready_s[i]`` (default: the backward's ``backward_s`` spread in
  proportion to the gradients' bytes, in the given order);
* bucket b starts at max(the ready time of its last gradient, the end of bucket b - 1) --
  buckets run one at a time, in plan order, as the gradient lane runs them;
* it lasts ``cost_model.predict("all_reduce", bytes_b, group_size, link_class)``.

The candidate whose last reduction ends first wins (ties: the smaller bucket, which holds less
memory). The result says why: the predicted end, the exposed time after the backward, the
bucket count, and the next-best candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from tritonmoe.comm.fused import plan_buckets

__all__ = ["FusionChoice", "choose_bucket_bytes", "bucket_timeline"]


@dataclass
class FusionChoice:
    """The chosen bucket size and why.

    Attributes:
        bucket_bytes: the choice; buckets: its plan (tensor indices per bucket);
        end_s: predicted end of the last reduction (seconds from the backward's start);
        exposed_s: ``end_s`` minus the backward's end (communication not hidden);
        candidates: (bucket_bytes, buckets, end_s) for every candidate, best first;
        reason: one sentence.
    """

    bucket_bytes: int
    buckets: list[list[int]]
    end_s: float
    exposed_s: float
    candidates: list[tuple[int, int, float]] = field(default_factory=list)
    reason: str = ""

    def describe(self) -> str:
        rows = [f"  {b:>12d} B  {n:>4d} buckets  end {e * 1e3:9.3f} ms" for b, n, e in self.candidates[:6]]
        return self.reason + "\n" + "\n".join(rows)


def bucket_timeline(nbytes: Sequence[int], ready_s: Sequence[float], bucket_bytes: int, cost_model, group_size: int,
                    link_class: str = "intra") -> tuple[list[list[int]], list[tuple[float, float]]]:
    """(buckets, (start, end) per bucket) of one backward under the rule of the module docstring."""
    buckets = plan_buckets(nbytes, bucket_bytes)
    spans = []
    t = 0.0
    for b in buckets:
        start = max(t, max(ready_s[i] for i in b))
        t = start + cost_model.predict("all_reduce", float(sum(nbytes[i] for i in b)), group_size, link_class)
        spans.append((start, t))
    return buckets, spans


def choose_bucket_bytes(
    nbytes: Sequence[int],
    cost_model,
    group_size: int,
    *,
    backward_s: float = 0.0,
    ready_s: Optional[Sequence[float]] = None,
    candidates: Optional[Sequence[int]] = None,
    link_class: str = "intra",
) -> FusionChoice:
    """The bucket size for gradients of ``nbytes`` (in ready order) reduced over ``group_size``
    ranks, from ``cost_model``'s all_reduce fit (see the module docstring).

    Args:
        backward_s: the backward pass's duration; gradients become ready in proportion to their
            bytes over it (ignored when ``ready_s`` is given; 0: every gradient ready at once,
            which makes the fewest buckets best).
        candidates: bucket sizes to compare (default: powers of two from the smallest gradient
            to the total, and the total).
    """
    sizes = [int(n) for n in nbytes]
    if not sizes or any(n < 0 for n in sizes) or sum(sizes) == 0:
        raise ValueError(f"nbytes={list(nbytes)[:8]} must be non-negative byte counts with a positive total")
    if not backward_s >= 0:
        raise ValueError(f"backward_s={backward_s} must be >= 0")
    total = sum(sizes)
    if ready_s is None:
        acc, ready = 0, []
        for n in sizes:
            acc += n
            ready.append(backward_s * acc / total)
    else:
        if len(ready_s) != len(sizes):
            raise ValueError(f"ready_s has {len(ready_s)} entries for {len(sizes)} gradients")
        ready = [float(r) for r in ready_s]
    end_bwd = max(ready)
    if candidates is None:
        c = max(1, min(n for n in sizes if n > 0))
        cands = []
        while c < total:
            cands.append(c)
            c *= 2
        cands.append(total)
    else:
        cands = [int(c) for c in candidates]
    rows = []
    for c in sorted(set(cands)):
        buckets, spans = bucket_timeline(sizes, ready, c, cost_model, group_size, link_class)
        rows.append((spans[-1][1], c, buckets))
    rows.sort(key=lambda r: (r[0], r[1]))
    end, best, buckets = rows[0]
    worst_per_tensor = next((r for r in rows if len(r[2]) == sum(1 for n in sizes if n)), None)
    vs = ""
    if worst_per_tensor is not None and worst_per_tensor[1] != best:
        vs = f"; one reduction per tensor ({len(worst_per_tensor[2])}) would end at {worst_per_tensor[0] * 1e3:.3f} ms"
    reason = (
        f"bucket_bytes={best}: {len(buckets)} bucket(s) for {len(sizes)} gradients of {total} bytes over {group_size} "
        f"ranks; the last reduction is predicted to end at {end * 1e3:.3f} ms, {max(0.0, end - end_bwd) * 1e3:.3f} ms after "
        f"the backward (alpha paid {len(buckets)} times; a bucket waits for its last gradient){vs}"
    )
    return FusionChoice(best, buckets, end, max(0.0, end - end_bwd), [(c, len(b), e) for e, c, b in rows], reason)
