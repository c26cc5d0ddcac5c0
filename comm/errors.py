"""Typed errors for backend failures, and process groups that keep their parent's timeout.

Two rules every collective of the library follows, so that a fault on one rank (it died, it
raised before a collective, it stays up but never joins) ends on every other rank in a typed
exception within the process-group timeout, never in a bare ``RuntimeError`` or a hang:

* **Every collective runs inside** :func:`backend_errors`: a backend failure (gloo's
  "Connection closed by peer", a timeout, NCCL's ``DistBackendError``) becomes
  :class:`ScheduleError` naming the step and the rank. Asynchronous work is wrapped where it is
  issued and where it is waited for.
* **Every process group the library creates inherits its parent's timeout**
  (:func:`new_group`, :func:`group_timeout`, :func:`mesh_backend_override`). ``torch.distributed.new_group``
  without ``timeout=`` gives a new group the backend's default (30 minutes for gloo, 10 for
  NCCL), whatever the user passed to ``init_process_group``: a dead or absent peer would hang
  the created group's collectives far past the timeout the user chose.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "ScheduleError",
    "LaneStartError",
    "RankInputError",
    "RankTypeError",
    "RankValueError",
    "RankIndexError",
    "input_status",
    "raise_rank_input_error",
    "backend_errors",
    "lane_start",
    "group_timeout",
    "new_group",
    "mesh_backend_override",
]


class ScheduleError(RuntimeError):
    """A step of a schedule or a collective of the library failed in the backend (a peer died or
    raised before it, the process-group timeout expired); the message names the step and rank."""


class LaneStartError(ScheduleError):
    """A lane of a schedule could not be started: a CUDA stream could not be created, or a worker
    thread (the CPU copy lane, the gradient lane of a ``CommScheduler``) could not be started or
    its pool was already shut down (interpreter exit). Raised before the operation is issued."""


class RankInputError(Exception):
    """One or more ranks of a group refused their input (a typed error at the API boundary)
    while the others went on to the step's first collective: raised on every rank of the group,
    with the same type and message, naming each failing rank and its own error.

    The concrete class is :class:`RankTypeError`, :class:`RankValueError` or
    :class:`RankIndexError` (the type of the lowest failing rank's error, so ``except
    TypeError`` still catches an fp64 input). Attributes: ``failing_ranks`` (group ranks, sorted)
    and ``messages`` (group rank -> ``"TypeError: ..."``)."""

    def __init__(self, message: str, failing_ranks: Sequence[int] = (), messages: Optional[dict] = None) -> None:
        super().__init__(message)
        self.failing_ranks = tuple(failing_ranks)
        self.messages = dict(messages or {})


class RankTypeError(RankInputError, TypeError):
    """:class:`RankInputError` whose first failing rank raised a ``TypeError``."""


class RankValueError(RankInputError, ValueError):
    """:class:`RankInputError` whose first failing rank raised a ``ValueError``."""


class RankIndexError(RankInputError, IndexError):
    """:class:`RankInputError` whose first failing rank raised an ``IndexError``."""


#: the status word of a rank in a step's first exchange: 0 = ready, else 1 + the index here
_STATUS_TYPES: tuple[type, ...] = (TypeError, ValueError, IndexError)
_STATUS_ERRORS: tuple[type, ...] = (RankTypeError, RankValueError, RankIndexError)
#: the longest message a failing rank sends (the follow-up gather of the error path)
_MESSAGE_CHARS = 2000


def input_status(error: Optional[BaseException]) -> int:
    """The status word of a rank whose input validation raised ``error`` (None: 0, ready).
    A subclass maps to its base (an ``IndexError`` subclass is 3)."""
    if error is None:
        return 0
    for i, t in enumerate(_STATUS_TYPES):
        if isinstance(error, t):
            return i + 1
    return _STATUS_TYPES.index(ValueError) + 1


def raise_rank_input_error(statuses: Sequence[int], own: Optional[BaseException], group: Any, what: str) -> None:
    """Raise the same :class:`RankInputError` on every rank of ``group`` when any entry of
    ``statuses`` (every rank's status word, from an exchange every rank took) is non-zero;
    return otherwise.

    Collective on the error path only: the ranks then gather the failing ranks' messages (one
    ``all_gather_object``; every rank reaches it, since every rank saw the same statuses).
    ``own``: this rank's validation error (None when its input was fine); the raised error is
    chained to it."""
    failing = [r for r, s in enumerate(statuses) if s]
    if not failing:
        return
    mine = None if own is None else f"{type(own).__name__}: {' '.join(str(own).split())}"[:_MESSAGE_CHARS]
    gathered: list = [None] * len(statuses)
    with backend_errors(f"the exchange of the refused inputs' messages ({what})", group):
        dist.all_gather_object(gathered, mine, group=group)
    messages = {r: gathered[r] or f"status {statuses[r]}" for r in failing}
    first = failing[0]
    cls = _STATUS_ERRORS[min(max(int(statuses[first]), 1), len(_STATUS_ERRORS)) - 1]
    body = messages[first].split(": ", 1)[-1]
    ranks = ", ".join(map(str, failing))
    others = "".join(f"; rank {r}: {messages[r]}" for r in failing[1:])
    err = cls(
        f"{body} [rank {first} of the group refused its input ({messages[first].split(':', 1)[0]}){others}; every "
        f"rank stops at {what} (failing ranks: {ranks}); fix the input of the failing ranks]",
        failing, messages,
    )
    raise err from own


@contextlib.contextmanager
def lane_start(what: str) -> Iterator[None]:
    """Start a lane's stream or thread so that its failure raises :class:`LaneStartError`
    naming ``what`` (torch and ``threading`` raise a bare ``RuntimeError``)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, LaneStartError):
            raise
        raise LaneStartError(
            f"could not start {what}: {type(e).__name__}: {' '.join(str(e).split())[:400]}. The process is out of "
            "threads or device resources, or it is shutting down"
        ) from e


#: RuntimeError subclasses that are not backend failures: raised as they are.
_PASS_THROUGH: tuple[type, ...] = (ScheduleError, NotImplementedError, torch.OutOfMemoryError)


def _rank(group) -> int:
    try:
        return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else -1
    except Exception:  # noqa: BLE001 - only for the message
        return -1


@contextlib.contextmanager
def backend_errors(what: str, group: Any = None) -> Iterator[None]:
    """Run collectives (issue or wait) of ``group`` so that a backend failure raises
    :class:`ScheduleError` (chained to the backend's error) naming ``what`` and this rank's
    rank in ``group``. Bad arguments (``ValueError``, ``TypeError``) and errors that are
    already typed pass through unchanged."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, _PASS_THROUGH):
            raise
        raise ScheduleError(
            f"{what} failed on rank {_rank(group)}: {type(e).__name__}: {' '.join(str(e).split())[:600]}. A peer "
            "failed or left before this collective (its own first error says why), or the process-group timeout "
            "expired"
        ) from e


def _backend_of(pg) -> Optional[Any]:
    """The backend object of ``pg`` that its collectives run on (CPU's first, then CUDA's)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    if "nccl" in str(dist.get_backend(pg)).lower():
        devices.reverse()
    for dev in devices:
        try:
            return pg._get_backend(dev)
        except Exception:  # noqa: BLE001 - no backend for this device type
            continue
    return None


def group_timeout(parent: Any = None) -> datetime.timedelta:
    """The collective timeout of ``parent`` (a process group; None = the default group): what
    every group the library creates from it inherits. Read from the group's backend options
    (gloo and NCCL keep it there); torch's default timeout for the backend when the backend
    does not say."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process groups need torch.distributed: call torch.distributed.init_process_group() first")
    pg = parent if parent is not None else dist.distributed_c10d._get_default_group()
    backend = _backend_of(pg)
    options = getattr(backend, "options", None)
    t = getattr(options, "_timeout", None)
    if isinstance(t, datetime.timedelta):
        return t
    return dist.distributed_c10d._get_default_timeout(dist.Backend(dist.get_backend(pg)))


def new_group(ranks: Sequence[int], *, parent: Any = None, **kwargs: Any):
    """``torch.distributed.new_group(ranks, **kwargs)`` with ``timeout`` defaulting to
    :func:`group_timeout` of ``parent`` (the group the new one is carved out of; None = the
    default group) instead of the backend's 30-minute default. Collective as
    ``torch.distributed.new_group`` is (over the default group, or over ``ranks`` with
    ``use_local_synchronization=True``)."""
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = group_timeout(parent)
    return dist.new_group(list(ranks), **kwargs)


def _options(backend: str, timeout: datetime.timedelta):
    """Backend options carrying ``timeout`` (for DeviceMesh's ``backend_override``), or None."""
    name = str(backend).lower()
    if name == "gloo" and hasattr(dist, "ProcessGroupGloo"):
        opts = dist.ProcessGroupGloo._Options()
    elif name == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    opts._timeout = timeout
    return opts


def mesh_backend_override(dims: dict[str, int], *, parent: Any = None) -> Optional[dict[str, tuple[str, Any]]]:
    """``backend_override`` for ``init_device_mesh`` (or ``DeviceMesh._flatten``) that gives the
    groups of the named dimensions (name -> size) the timeout of ``parent`` (None = the default
    group). Dimensions spanning the whole world are left out (DeviceMesh reuses the default group
    for them). None when the backend's options cannot carry a timeout."""
    pg = parent if parent is not None else dist.distributed_c10d._get_default_group()
    backend = str(dist.get_backend(pg)).lower()
    world = dist.get_world_size()
    opts = _options(backend, group_timeout(parent))
    if opts is None:
        return None
    override = {name: (backend, opts) for name, size in dims.items() if size != world}
    return override or None
