"""Bytes held, by the allocator's own count (not by the code under test).

``allocated_bytes(device)``: on CUDA ``torch.cuda.memory_allocated`` (the caching allocator's
bytes in live tensors); on CPU glibc's ``mallinfo2()``: ``uordblks`` (bytes in use in the heap
arenas) + ``hblkhd`` (bytes in chunks glibc mmapped separately: torch's large CPU tensors go
there until glibc's dynamic mmap threshold has risen past them). Freed memory that malloc keeps
cached in its free lists is not counted, so a delta around a forward is what the forward left
allocated. Other allocations of the process land in the same counters: measure deltas after
``gc.collect()`` on a warm second pass (the first pass fills one-time caches: kernel tables,
lazily built dispatch state, malloc's own thresholds), and use shapes whose bytes dwarf them.

``None`` where the allocator cannot be read (not glibc): callers skip their check then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Optional

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes(device: torch.device = torch.device("cpu")) -> Optional[int]:
    """The allocator's bytes in use now (after a ``gc.collect()``), or None where unreadable."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the frees the CPU side has issued are the allocator's now
        return torch.cuda.memory_allocated(device)
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return int(m.uordblks + m.hblkhd)
