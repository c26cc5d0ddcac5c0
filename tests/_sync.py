"""Count every device->host synchronization path a block of code takes.

``with HostSyncs() as syncs: ...`` records one :class:`Sync` per call that makes (or, on a CUDA
tensor, would make) the host wait for the device, whatever device the tensors are on, so CPU
tests see the syncs a GPU run would pay. Two nets, so that neither Python-level nor C++-level
paths escape:

* Python entry points, patched for the block: the scalar reads ``Tensor.item``, ``tolist``,
  ``numpy``, ``__array__``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``; the copies
  ``Tensor.cpu`` and ``Tensor.to`` towards the CPU (from another device, or to ``"cpu"``
  spelled as a string); ``Tensor.nonzero`` / ``torch.nonzero``; the comparisons that return a Python bool
  (``torch.equal``, ``torch.allclose``, ``torch.is_nonzero`` and the Tensor methods); and
  ``torch.cuda.synchronize``, ``torch.cuda.Stream.synchronize``, ``torch.cuda.Event.synchronize``
  (patched even without CUDA, so code that calls them is seen).
* A ``TorchDispatchMode`` for the ATen ops whose host-visible result depends on tensor values:
  ``_local_scalar_dense`` (every scalar read, including one made inside C++), ``nonzero``,
  ``masked_select``, ``unique*``, ``repeat_interleave`` of a repeats tensor without
  ``output_size``, ``bincount``, ``equal``, ``is_nonzero``, ``index`` / ``index_put`` with a
  boolean mask. A Python-level call already counted does not count again here.

Each sync records its kind and where it happened: the innermost frame in tritonmoe's own code
(``tritonmoe/``, ``kernels/``, ``comm/``), else the innermost frame outside torch and this file.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tritonmoe

_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
#: tritonmoe's source roots (kernels/ and comm/ are mapped into the package by pyproject).
ROOTS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (tritonmoe, __import__("tritonmoe.kernels").kernels, __import__("tritonmoe.comm").comm)
)


@dataclass(frozen=True)
class Sync:
    kind: str  # e.g. "Tensor.item", "aten._local_scalar_dense", "aten.nonzero"
    file: str  # absolute path of the frame that made it ("" when none qualifies)
    line: int
    function: str

    @property
    def where(self) -> str:
        """``path/relative/to/the/repo.py:line (function)``."""
        root = os.path.dirname(ROOTS[0].rstrip(os.sep))
        rel = os.path.relpath(self.file, root) if self.file else "?"
        return f"{rel}:{self.line} ({self.function})"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).rstrip() if self.file else ""

    def commented(self, marker: str = "host sync", above: int = 3) -> bool:
        """Whether the line, or one of the ``above`` lines before it that are comments, carries
        ``marker`` (case-insensitive): the project's rule that every host sync is commented."""
        if not self.file:
            return False
        lines = [linecache.getline(self.file, self.line)]
        for i in range(1, above + 1):
            prev = linecache.getline(self.file, self.line - i).strip()
            if not prev.startswith("#"):
                break
            lines.append(prev)
        return any(marker in ln.lower() for ln in lines)


def _function(f) -> str:
    """The frame's function, a comprehension's being its enclosing function's (Python < 3.12
    runs comprehensions in frames of their own)."""
    while f is not None and f.f_code.co_name.startswith("<") and f.f_code.co_name != "<module>":
        f = f.f_back
    return f.f_code.co_name if f is not None else ""


def _caller() -> tuple[str, int, str]:
    f = sys._getframe(2)
    fallback = None
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn.startswith(ROOTS):
            return fn, f.f_lineno, _function(f)
        if fallback is None and fn != _HERE and not fn.startswith(_TORCH):
            fallback = (fn, f.f_lineno, _function(f))
        f = f.f_back
    return fallback or ("", 0, "")


_DATA_DEPENDENT_ATEN = {
    "_local_scalar_dense", "nonzero", "nonzero_static_", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "bincount", "equal", "is_nonzero",
}


def _bool_mask_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx
    )


class _AtenNet(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        hit = name in _DATA_DEPENDENT_ATEN
        if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
            hit = len(args) < 2 or isinstance(args[1], torch.Tensor) or func is torch.ops.aten.repeat_interleave.Tensor
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_mask_index(args):
            hit = True
        if hit:
            self.owner._record(f"aten.{name}")
        return func(*args, **kwargs)


def _is_device_to_host(args, kwargs) -> bool:
    """``self.to(...)`` copying to the CPU: from a tensor on another device, or spelled "cpu"
    (a string: on a CPU-only machine a ``torch.device`` taken from another tensor, the usual
    host-to-device idiom ``idx.to(x.device)``, cannot be told from a copy back and is not counted)."""
    self_t, rest = args[0], args[1:]
    dev = kwargs.get("device")
    if dev is None and rest:
        a = rest[0]
        dev = a.device if isinstance(a, torch.Tensor) else a if isinstance(a, (str, torch.device)) else None
    if dev is None:
        return False
    try:
        target = torch.device(dev)
    except (RuntimeError, TypeError):
        return False
    return target.type == "cpu" and (self_t.device.type != "cpu" or isinstance(dev, str))


class HostSyncs:
    """The context manager; ``self.syncs`` lists the :class:`Sync` records in order."""

    _TENSOR_METHODS = ("item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
                       "cpu", "to", "nonzero", "equal", "allclose", "is_nonzero")
    _TORCH_FUNCTIONS = ("nonzero", "equal", "allclose", "is_nonzero")

    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self._tls = threading.local()
        self._saved: list[tuple[object, str, object]] = []
        self._mode: Optional[_AtenNet] = None

    # -- recording ----------------------------------------------------------------------------

    def _inside(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def _record(self, kind: str) -> None:
        if self._inside():
            return
        self.syncs.append(Sync(kind, *_caller()))

    def _wrap(self, kind: str, fn, when=None):
        counter = self

        def wrapper(*args, **kwargs):
            counted = when is None or when(args, kwargs)
            if counted and not counter._inside():
                counter.syncs.append(Sync(kind, *_caller()))
            counter._tls.depth = getattr(counter._tls, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._tls.depth -= 1

        wrapper.__name__ = getattr(fn, "__name__", kind)
        return wrapper

    def _patch(self, owner, name: str, kind: str, when=None) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, self._wrap(kind, fn, when))

    # -- the context ---------------------------------------------------------------------------

    def __enter__(self) -> "HostSyncs":
        for name in self._TENSOR_METHODS:
            when = None
            if name == "to":
                when = _is_device_to_host
            self._patch(torch.Tensor, name, f"Tensor.{name}", when)
        for name in self._TORCH_FUNCTIONS:
            self._patch(torch, name, f"torch.{name}")
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._patch(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
        self._patch(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")
        self._mode = _AtenNet(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._saved.clear()

    def as_device_work(self, fn):
        """``fn`` wrapped so that nothing it does is counted: for code that stands in for
        asynchronous device work on CPU (Triton's interpreter running a kernel launch reads its
        tensors on the host, which a GPU launch does not)."""
        return self._wrap("device work", fn, when=lambda args, kwargs: False)  # never counted, hides its inside

    # -- reading -------------------------------------------------------------------------------

    def where(self) -> list[str]:
        return [f"{s.kind} at {s.where}" for s in self.syncs]


_MISSING = object()
