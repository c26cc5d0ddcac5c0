"""Analytic work of each benchmark: useful FLOPs, minimum bytes moved, minimum memory held.

These numbers depend only on the problem, never on the implementation, so every
implementation of a benchmark is divided by the same work and throughputs compare directly.
Bytes count what an ideal implementation must read plus what it must write, once each; FLOPs
count the multiply-adds of the GEMMs (2 per MAC), not elementwise work. ``s`` is the element
size of the benchmark dtype; ids are int32 (4 B), routing weights fp32 (4 B), slot rows int64
(8 B). R is the number of routed rows (T * k when nothing is dropped), ``n1`` is w1's output
width (2f for swiglu), ``Ea`` the number of experts that receive at least one row.
"""

from __future__ import annotations

from .harness import Work

IDS, WEIGHTS, ROWS = 4, 4, 8


def route(T: int, E: int, k: int, s: int, *, backward: bool) -> Work:
    """Forward reads the logits [T, E] and writes ids, weights [T, k] and counts [E]. Backward
    reads d(weights) and ids, re-reads the logits and writes d(logits)."""
    fwd = T * E * s + T * k * (IDS + WEIGHTS) + E * 4
    bwd = T * k * (WEIGHTS + IDS) + 2 * T * E * s
    return Work(bytes=fwd + (bwd if backward else 0))


def permute(T: int, k: int, d: int, R: int, E: int, s: int, *, backward: bool) -> Work:
    """Forward reads x [T, d] and ids, writes x_perm [R, d], slot_rows and offsets. Backward
    reads d(x_perm) and slot_rows and writes d(x) [T, d] (summing each token's k rows)."""
    fwd = T * d * s + T * k * IDS + R * d * s + T * k * ROWS + (E + 1) * 8
    bwd = R * d * s + T * k * ROWS + T * d * s
    return Work(bytes=fwd + (bwd if backward else 0))


def permute_rows(T: int, k: int, d: int, R: int, s: int) -> Work:
    """The row movement alone (metadata given): reads x [T, d] and slot_rows, writes x_perm
    [R, d]."""
    return Work(bytes=T * d * s + T * k * ROWS + R * d * s)


def permute_metadata(T: int, k: int, E: int) -> Work:
    """The routing metadata alone: reads the ids [T, k], writes slot_rows [T, k], offsets [E+1]
    and counts [E] (int32)."""
    return Work(bytes=T * k * (IDS + ROWS) + (E + 1) * 8 + E * 4)


def unpermute(T: int, k: int, d: int, R: int, s: int, *, backward: bool) -> Work:
    """Forward reads y_perm [R, d], slot_rows and weights and writes out [T, d]. Backward reads
    d(out), y_perm (for d(weights)), slot_rows and weights and writes d(y_perm) and d(weights)."""
    fwd = R * d * s + T * k * (ROWS + WEIGHTS) + T * d * s
    bwd = T * d * s + R * d * s + T * k * (ROWS + WEIGHTS) + R * d * s + T * k * WEIGHTS
    return Work(bytes=fwd + (bwd if backward else 0))


def ffn_flops(R: int, d: int, f: int, n1: int, *, backward: bool) -> float:
    """Two GEMMs per row: [d] x [d, n1] and [f] x [f, d]; backward does twice the forward's
    (d(input) and d(weight) of each GEMM)."""
    fwd = 2.0 * R * d * n1 + 2.0 * R * f * d
    return fwd * (3 if backward else 1)


def grouped_ffn(R: int, d: int, f: int, n1: int, Ea: int, s: int, *, backward: bool) -> Work:
    """Forward reads x_perm [R, d] and the active experts' weights, writes y [R, d] (the
    activation fused, the pre-activation not written). Backward reads d(y), the weights again,
    x_perm and the pre-activation [R, n1] saved by the forward (written there), and writes d(x)
    and d(w1), d(w2)."""
    wbytes = Ea * (d * n1 + f * d) * s
    fwd = R * d * s + wbytes + R * d * s
    bwd = R * d * s + wbytes + R * d * s + 2 * R * n1 * s + R * d * s + wbytes
    return Work(flops=ffn_flops(R, d, f, n1, backward=backward), bytes=fwd + (bwd if backward else 0))


def moe_ffn(T: int, k: int, R: int, d: int, f: int, n1: int, Ea: int, s: int, *, backward: bool) -> Work:
    """The routed FFN x [T, d] -> out [T, d] with gather and weighted scatter fused: like
    :func:`grouped_ffn` but reading x and writing out once per token instead of once per row,
    plus the routing (ids, weights, slot rows)."""
    wbytes = Ea * (d * n1 + f * d) * s
    meta = T * k * (IDS + WEIGHTS + ROWS)
    fwd = T * d * s + wbytes + T * d * s + meta
    bwd = T * d * s + wbytes + T * d * s + 2 * R * n1 * s + T * d * s + wbytes + meta + T * k * WEIGHTS
    return Work(flops=ffn_flops(R, d, f, n1, backward=backward), bytes=fwd + (bwd if backward else 0))


def layer(T: int, E: int, k: int, R: int, d: int, f: int, n1: int, Ea: int, s: int, *, backward: bool) -> Work:
    """MoELayer: router GEMM [T, d] x [d, E], routing, routed FFN.

    Minimum memory (``min_memory_bytes``), the denominator of the memory ratio:

    * forward (inference, no autograd): weights W = (d*E + E*d*n1 + E*f*d) * s, input x and
      output [T, d], logits [T, E] and the routing (ids + weights [T, k]);
    * forward+backward: W and its gradient, x, d(x), out, d(out) [T, d], logits [T, E], the
      routing, and the one activation backward cannot do without: the pre-activation
      h [R, n1] (the activation output, x_perm and the expert outputs can be recomputed or
      gathered again, and d(gate weights) comes from h and d(out) without the expert output).
    """
    router_w = d * E * s
    wbytes_all = E * (d * n1 + f * d) * s
    wbytes = Ea * (d * n1 + f * d) * s
    flops = 2.0 * T * d * E * (3 if backward else 1) + ffn_flops(R, d, f, n1, backward=backward)
    meta = T * k * (IDS + WEIGHTS)
    fwd_bytes = T * d * s + router_w + 2 * T * E * s + meta + wbytes + T * d * s
    bwd_bytes = (
        T * d * s  # d(out)
        + router_w + wbytes  # weights again
        + T * d * s + 2 * R * n1 * s  # x, pre-activation saved and read
        + T * d * s  # d(x)
        + router_w + wbytes  # weight gradients
        + 2 * T * E * s  # logits re-read, d(logits)
    )
    W = router_w + wbytes_all
    if backward:
        min_mem = 2 * W + 4 * T * d * s + T * E * s + meta + R * n1 * s
    else:
        min_mem = W + 2 * T * d * s + T * E * s + meta
    return Work(flops=flops, bytes=fwd_bytes + (bwd_bytes if backward else 0), min_memory_bytes=min_mem)
