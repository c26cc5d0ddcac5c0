"""Process-wide settings: the default backend and whether value checks run.

Both are read from the environment once at import (``TRITONMOE_BACKEND``, ``TRITONMOE_VALIDATE``)
and can be changed for the whole process with :func:`set_backend` / :func:`set_validation`, or for
a block of code with the :func:`use_backend` / :func:`validation` context managers (which tests
should prefer, so a failing test cannot leak a setting into the next one).

A block's setting has :mod:`contextvars` semantics: it holds for the thread (or asyncio task)
that entered the block, for the block's extent, and is restored on exit however blocks of
different threads overlap; other threads keep the process default. Within one thread, blocks
nest (exit them in the reverse order of entry, as ``with`` does; a generator that holds a block
across ``yield`` lends its setting to its caller while suspended). Under ``torch.compile`` the
process default applies (the value is read at trace time, and dynamo cannot read a context
variable without a graph break): pass ``backend=`` explicitly to a compiled op to choose another
one. tritonmoe's own worker threads (host copies, gradient reductions) read neither setting.

Backends:

* ``"torch"``  - :mod:`tritonmoe.reference`, plain PyTorch on any device.
* ``"triton"`` - the Triton kernels; on CPU tensors they run in Triton's interpreter, which must be
  switched on (``TRITON_INTERPRET=1``) before tritonmoe is imported.
* ``"auto"``   - Triton kernels for CUDA tensors when the op has one, the reference otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch


BACKENDS = ("auto", "triton", "torch")

#: Whether Triton's interpreter was switched on when tritonmoe was imported.  Triton reads the
#: variable when a kernel is first defined, so turning it on later has no effect; we remember it
#: here to give a clear error instead of a confusing one from deep inside Triton.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """Whether Triton's interpreter was switched on (``TRITON_INTERPRET=1``) when tritonmoe was
    imported: backend ``"triton"`` then runs on CPU tensors (slowly, for tests)."""
    return TRITON_INTERPRET


def _parse_backend(value: str, source: str) -> str:
    v = value.strip().lower()
    if v not in BACKENDS:
        raise ValueError(f"{source}={value!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return v


def _parse_bool(value: str, source: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{source}={value!r} is not a boolean; use 1 or 0")


#: The process defaults (every thread sees them; set_backend / set_validation change them).
_state = {
    "backend": _parse_backend(os.environ.get("TRITONMOE_BACKEND", "auto"), "TRITONMOE_BACKEND"),
    "validate": _parse_bool(os.environ.get("TRITONMOE_VALIDATE", "1"), "TRITONMOE_VALIDATE"),
}
#: The block-scoped overrides (None: none): per thread and task, set by use_backend / validation.
_backend_block: contextvars.ContextVar[str | None] = contextvars.ContextVar("tritonmoe_backend", default=None)
_validate_block: contextvars.ContextVar[bool | None] = contextvars.ContextVar("tritonmoe_validate", default=None)


def set_backend(backend: str) -> str:
    """Set the process default backend ("auto", "triton" or "torch"); returns the previous one.
    A :func:`use_backend` block of the calling thread still wins inside it."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    prev = _state["backend"]
    _state["backend"] = _parse_backend(backend, "backend")
    return prev


def get_backend() -> str:
    """The backend in effect: the innermost :func:`use_backend` block of this thread or task,
    else the process default."""
    if not torch.compiler.is_compiling():
        block = _backend_block.get()
        if block is not None:
            return block
    return _state["backend"]


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Run a block with another default backend (this thread or task only)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    token = _backend_block.set(_parse_backend(backend, "backend"))
    try:
        yield
    finally:
        _backend_block.reset(token)


def set_validation(enabled: bool) -> bool:
    """Switch the value checks of the public functional ops on or off for the process; returns
    the previous process default. A :func:`validation` block of the calling thread still wins
    inside it.

    Shape, dtype and device checks always run.  The value checks (id ranges, offsets monotone and
    ending at R, finite logits) read tensor contents and so synchronize with the device; switch
    them off once a pipeline is known to produce valid metadata.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_validation expects a bool, got {type(enabled).__name__}")
    prev = _state["validate"]
    _state["validate"] = enabled
    return prev


def validation_enabled() -> bool:
    """Whether value checks run: the innermost :func:`validation` block of this thread or task,
    else the process default."""
    if not torch.compiler.is_compiling():
        block = _validate_block.get()
        if block is not None:
            return block
    return _state["validate"]


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Run a block with value checks switched on or off (this thread or task only)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"validation expects a bool, got {type(enabled).__name__}")
    token = _validate_block.set(enabled)
    try:
        yield
    finally:
        _validate_block.reset(token)


# ---------------------------------------------------------------------------------------------
# Backend resolution
# ---------------------------------------------------------------------------------------------


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return get_backend()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    return _parse_backend(backend, "backend")
