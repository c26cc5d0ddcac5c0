"""One config mechanism for every kernel: overrides, the tuned table per device, what ran.

Every launch parameter of the kernels is chosen by a *target*, a named choice registered here by
the kernel family that owns it (its config dataclass and its heuristic live beside the kernels):

============================  ==========================================  =====================
target                        value                                       chosen in
============================  ==========================================  =====================
``gemm.<kind>``               :class:`~._gemm_config.TileConfig`          ``_gemm_config.select``
  (mm, mm_act, swiglu, dact, dact_swiglu, wgrad)
``decode.<kind>``             ``TileConfig`` (decode path's GEMMs:        ``_gemm_config.select_decode``
  (swiglu, mm_act, mm)        swiglu / mm_act = GEMM1, mm = GEMM2)
``persistent``                :class:`~._grouped_gemm_persistent.PersistentOptions`
``ffn.decode``                bool: force (True) or avoid (False) the decode path
``ffn.preact``                ``"save"`` / ``"recompute"`` (FFN backward's pre-activation)
``permute.metadata``          :class:`~.permute.MetadataConfig`           ``permute.metadata_config``
``permute.scatter`` / ``permute.gather``  :class:`~.permute.RowsConfig`   ``permute.rows_config``
``route``                     :class:`~.routing.RouteConfig`              ``routing.route``
``partition``                 :class:`~.partition.PartitionConfig`        ``partition.select_config``
``table``                     a :class:`Table` or None (which tuned table applies)
============================  ==========================================  =====================

Order of a choice: the tuned table for the running device (when it has an entry for the
shape's bucket), else the family's heuristic; then an :func:`override`, if one is active,
replaces it (a whole config) or changes fields of it (``**fields``).

:func:`override` is the one way to pin a choice, scoped with ``contextvars`` (nothing global is
flipped; nested overrides restore on exit)::

    with override("gemm.swiglu", TileConfig(BM=64, BN=64, BK=32)):   # a whole config
        ...
    with override("gemm", num_stages=2):          # every gemm.* target: change one field
        ...
    with override("permute.metadata", fused=False, block_s=16), override("ffn.decode", True):
        ...

The tuned tables: ``kernels/configs/<device name>.json``, the device name as
``torch.cuda.get_device_name`` spells it with spaces as underscores (``NVIDIA_H100_80GB_HBM3``),
written by ``python -m bench tune`` (see docs/tuning.md). ``TRITONMOE_CONFIG_TABLE`` names
another file, or ``off`` turns tables off. A table is read once per file; a missing file means
heuristics; a malformed file or entry gives one :class:`TableWarning` and falls back to the
heuristic (it never fails a forward).

Autotuning: ``TRITONMOE_AUTOTUNE=0`` is the one kill switch (:func:`autotune_enabled`); only the
GEMMs autotune (their pipeline depth, on CUDA, for heuristic and overridden configs; a tuned
table's configs were measured and launch as they are).

What ran: inside ``with recording() as ran:`` every choice made appends a :class:`Ran` (target,
shape key, config, source "table" / "heuristic" / "override"); :func:`summary` turns the list
into JSON rows for a benchmark's results.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

__all__ = [
    "FORMAT",
    "SOURCES",
    "Ran",
    "Table",
    "TableWarning",
    "Target",
    "autotune_enabled",
    "bucket_key",
    "deprecated",
    "config_dict",
    "device_name",
    "load_table",
    "note",
    "override",
    "overridden",
    "recording",
    "register",
    "replaced",
    "resolve",
    "summary",
    "table_for",
    "table_path",
    "targets",
    "value",
]

#: Version of the table file format (``"format"`` in the JSON).
FORMAT = 1
#: Where a config came from.
SOURCES = ("table", "heuristic", "override")
#: Where the tables live: ``kernels/configs/`` (package data of tritonmoe.kernels).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class TableWarning(UserWarning):
    """A tuned table (or one of its entries) could not be used; the heuristic runs instead."""


# ---------------------------------------------------------------------------------------------
# Targets and overrides
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """A registered choice: configs of type ``cls`` (a frozen dataclass; field overrides and
    table entries allowed; ``probe``, an instance, lets :func:`override` check field values
    before the block runs), or plain values checked by ``check`` (``cls`` None)."""

    name: str
    cls: Optional[type] = None
    check: Optional[Callable[[Any], None]] = None
    doc: str = ""
    probe: Any = None


_TARGETS: dict[str, Target] = {}


def register(name: str, cls: Optional[type] = None, *, check: Optional[Callable[[Any], None]] = None,
             doc: str = "", probe: Any = None) -> Target:
    """Register a target (idempotent for the same definition; kernel modules call it at import)."""
    t = Target(name, cls, check, doc, probe)
    old = _TARGETS.get(name)
    if old is not None and getattr(old.cls, "__qualname__", None) != getattr(cls, "__qualname__", None):
        raise ValueError(f"config target {name!r} is already registered with {old.cls!r}")  # (a reload re-registers)
    _TARGETS[name] = t
    return t


#: The modules that register targets (each registers its own when imported; they import this
#: module, so it cannot import them at its top).
FAMILIES = (
    "tritonmoe.kernels._gemm_config",
    "tritonmoe.kernels._grouped_gemm_persistent",
    "tritonmoe.kernels.permute",
    "tritonmoe.kernels.routing",
    "tritonmoe.kernels.partition",
    "tritonmoe.kernels._fp8_config",
)


def _load_families() -> None:
    """Import every registering module, so that a target can be named (and overridden) before
    its kernels were first used."""
    for mod in FAMILIES:
        if mod not in sys.modules:
            importlib.import_module(mod)


def targets() -> tuple[str, ...]:
    """The target names, sorted."""
    _load_families()
    return tuple(sorted(_TARGETS))


@dataclasses.dataclass(frozen=True)
class _Entry:
    config: Any = None
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    set_value: bool = False  # a plain value target was given a value (None included)


_OVERRIDES: contextvars.ContextVar[Mapping[str, _Entry]] = contextvars.ContextVar(
    "tritonmoe_kernel_config_overrides", default=MappingProxyType({}))


def _expand(target: str | tuple) -> list[str]:
    if isinstance(target, (tuple, list)):
        return sorted({n for t in target for n in _expand(t)})
    if not isinstance(target, str):
        raise TypeError(f"config target must be a str or a tuple of them, got {type(target).__name__}")
    if target not in _TARGETS and not any(n.startswith(target + ".") for n in _TARGETS):
        _load_families()  # a target of a family not imported yet
    if target in _TARGETS:
        return [target]
    names = [n for n in _TARGETS if n.startswith(target + ".")]
    if not names:
        raise ValueError(f"unknown config target {target!r}; use one of {targets()} (or a family prefix such as 'gemm')")
    return sorted(names)


def deprecated(old: str, new: str) -> None:
    """Warn that the spelling ``old`` is deprecated in favour of ``new`` (called by the old
    context managers' bodies, so the warning points at the caller's ``with``)."""
    warnings.warn(f"{old} is deprecated; use tritonmoe.kernels.config.{new}", DeprecationWarning, stacklevel=4)


_UNSET = object()


def _check(t: Target, config: Any, fields: Mapping[str, Any], given: bool) -> None:
    if t.cls is None:
        if fields:
            raise TypeError(f"config target {t.name!r} takes a value, not fields {sorted(fields)}")
        if t.check is not None:
            t.check(config)
        return
    if given and not isinstance(config, t.cls):
        raise TypeError(f"override({t.name!r}, ...) expects a {t.cls.__name__}, got {type(config).__name__}")
    names = {f.name for f in dataclasses.fields(t.cls) if f.init}
    bad = sorted(set(fields) - names)
    if bad:
        raise ValueError(f"override({t.name!r}) got unknown fields {bad}; {t.cls.__name__} has {sorted(names)}")
    base = config if config is not None else t.probe
    if fields and base is not None:
        dataclasses.replace(base, **fields)  # the class's own checks (typed errors) run now, not at launch


@contextlib.contextmanager
def override(target: str | tuple, config: Any = _UNSET, /, **fields: Any) -> Iterator[None]:
    """Pin the choice of ``target`` inside the block: one target, every target under a family
    prefix (``"gemm"``), or each of a tuple of them (``("gemm", "decode")``). ``config``
    replaces what the table or heuristic would choose; ``fields`` change fields of it (of
    ``config`` when both are given; of an enclosing override's config otherwise, so nested
    overrides compose). Plain-value targets (``ffn.decode``,
    ``ffn.preact``, ``table``) take a value only. Typed errors for unknown targets or fields, and
    for a config of the wrong type, are raised before anything changes."""
    names = _expand(target)
    given = config is not _UNSET
    for n in names:
        t = _TARGETS[n]
        if t.cls is None and not given:
            raise TypeError(f"config target {n!r} needs a value: override({n!r}, value)")
        _check(t, config if given else None, fields, given)
    current = _OVERRIDES.get()
    new = dict(current)
    for n in names:
        prev = current.get(n)
        if given:
            new[n] = _Entry(config, dict(fields), True)
        elif prev is not None:
            new[n] = _Entry(prev.config, {**prev.fields, **fields}, prev.set_value)
        else:
            new[n] = _Entry(None, dict(fields), False)
    token = _OVERRIDES.set(MappingProxyType(new))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def overridden(target: str) -> bool:
    """Whether an override of ``target`` is active."""
    return target in _OVERRIDES.get()


def replaced(target: str) -> bool:
    """Whether an active override of ``target`` gives a whole config (the policy need not
    choose one: :func:`resolve` replaces whatever it is given)."""
    e = _OVERRIDES.get().get(target)
    return e is not None and e.config is not None


def value(target: str, default: Any = None) -> Any:
    """A plain-value target's override, or ``default``."""
    e = _OVERRIDES.get().get(target)
    return e.config if e is not None and e.set_value else default


def resolve(target: str, chosen: Any) -> tuple[Any, bool]:
    """``chosen`` (the table's or heuristic's config) with the active override of ``target``
    applied -> (config, whether an override applied)."""
    e = _OVERRIDES.get().get(target)
    if e is None:
        return chosen, False
    cfg = e.config if e.config is not None else chosen
    if e.fields:
        cfg = dataclasses.replace(cfg, **e.fields)
    return cfg, True


# ---------------------------------------------------------------------------------------------
# Autotuning switch
# ---------------------------------------------------------------------------------------------


def autotune_enabled(device: torch.device) -> bool:
    """Autotune on CUDA unless ``TRITONMOE_AUTOTUNE=0`` (never in the interpreter, whose launcher
    cannot benchmark). The one autotuning switch of all kernels."""
    if device.type != "cuda":
        return False
    v = os.environ.get("TRITONMOE_AUTOTUNE", "1").strip().lower()
    if v in ("0", "false", "off", "no"):
        return False
    if v in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"TRITONMOE_AUTOTUNE={v!r} is not a boolean; use 1 or 0")


# ---------------------------------------------------------------------------------------------
# Tuned tables
# ---------------------------------------------------------------------------------------------


def config_dict(cfg: Any) -> dict:
    """A config's fields as a JSON-ready dict (a table entry's ``"config"``): the init fields
    that take part in equality (``TileConfig.source`` is not one)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init and f.compare}


def bucket_key(exact: Mapping[str, Any]) -> str:
    """The JSON key of an entry group: ``exact`` fields as ``name=value`` joined by commas, in
    the order given (the family's key order)."""
    return ",".join(f"{k}={v}" for k, v in exact.items())


class Table:
    """A parsed tuned table: ``entries[target][group key][bucket] -> config``.

    JSON layout (``FORMAT`` 1)::

        {"format": 1, "device": "NVIDIA_H100_80GB_HBM3", "meta": {...},
         "entries": {"gemm.swiglu": {"dtype=bf16,E=8,N=14336,K=4096": {
             "256": {"config": {"BM": 128, ...}, "us": 812.4, ...}, "1024": {...}}}},
         "invalid": {...}}

    Lookup (:meth:`lookup`): the group of the exact fields (dtype, E, N, K... as the family keys
    them), then the bucket nearest to the shape's bucket value (rows per expert, tokens...), as
    vLLM picks the nearest batch key (ties: the smaller bucket). A group is parsed on its first
    lookup; entries that do not parse into the target's config class are dropped with one
    warning each, and the rest of the table stays in use.
    """

    def __init__(self, doc: Mapping[str, Any], source: str = "<memory>") -> None:
        self.source = source
        self.doc = doc
        self.device = doc.get("device")
        self._raw: dict[str, dict] = {}
        self._groups: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self._memo: dict[tuple, Any] = {}
        entries = doc.get("entries", {})
        if not isinstance(entries, dict):
            raise ValueError("'entries' is not an object")
        for target, groups in entries.items():
            if not isinstance(groups, dict) or not all(isinstance(b, dict) for b in groups.values()):
                _warn(f"{source}: entries of {target!r} are not objects of objects; ignored")
                continue
            self._raw[target] = groups

    def _group(self, target: str, gkey: str) -> list[tuple[int, Any]]:
        """The parsed buckets of one group, parsed on first use (the target's module has
        registered its config class by then); a bad entry is dropped with one warning."""
        got = self._groups.get((target, gkey))
        if got is not None:
            return got
        rows = []
        buckets = self._raw.get(target, {}).get(gkey, {})
        t = _TARGETS.get(target)
        for b, ent in buckets.items():
            try:
                if t is None or t.cls is None:
                    raise ValueError(f"{target!r} is not a config target with a table")
                cfg = t.cls(**ent["config"])
                rows.append((int(b), cfg))
            except Exception as e:  # noqa: BLE001 - any malformed entry is skipped, never fatal
                _warn(f"{self.source}: {target} [{gkey}] bucket {b!r}: unusable entry ({type(e).__name__}: {e}); "
                      "the heuristic config runs there")
        rows.sort(key=lambda r: r[0])
        self._groups[(target, gkey)] = rows
        return rows

    def lookup(self, target: str, exact: Mapping[str, Any], bucket: float) -> Any:
        """The config for ``target`` at ``exact`` fields and the bucket nearest ``bucket``, or
        None (no entry for this group)."""
        gkey = bucket_key(exact)
        memo = (target, gkey, bucket)
        if memo in self._memo:
            return self._memo[memo]
        rows = self._group(target, gkey) if target in self._raw else None
        cfg = None
        if rows:
            cfg = min(rows, key=lambda r: (abs(r[0] - bucket), r[0]))[1]
        if len(self._memo) < 4096:
            self._memo[memo] = cfg
        return cfg

    def parse_all(self) -> int:
        """Parse every entry now (warning for each bad one); the number of usable entries."""
        return sum(len(self._group(t, g)) for t, groups in self._raw.items() for g in groups)

    def __len__(self) -> int:
        return sum(len(b) for groups in self._raw.values() for b in groups.values())


def _warn(msg: str) -> None:
    warnings.warn(msg, TableWarning, stacklevel=3)


def load_table(path: os.PathLike | str) -> Optional[Table]:
    """Read a table file; None (with a :class:`TableWarning`) when it cannot be used at all
    (unreadable, not JSON, wrong format)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this tritonmoe reads format {FORMAT}")
        return Table(doc, str(path))
    except (OSError, ValueError, TypeError) as e:
        _warn(f"tuned config table {path} is unusable ({type(e).__name__}: {e}); the heuristic configs run")
        return None


@functools.lru_cache(maxsize=32)
def _cached_str(path: str) -> Optional[Table]:
    if not os.path.exists(path):
        return None  # no file: heuristics
    return load_table(path)


def _cached(path: Path) -> Optional[Table]:
    """The table of ``path``, read once per process (a missing file is None, also cached)."""
    return _cached_str(str(path))


@functools.lru_cache(maxsize=16)
def _device_name_of(index: int) -> Optional[str]:
    try:
        return torch.cuda.get_device_name(index).strip().replace(" ", "_")
    except Exception:  # noqa: BLE001 - no driver (e.g. an offline compile check): no table
        return None


def device_name(device: torch.device) -> Optional[str]:
    """The table name of a CUDA device (``torch.cuda.get_device_name`` with spaces as
    underscores), None elsewhere."""
    if device.type != "cuda":
        return None
    return _device_name_of(device.index if device.index is not None else torch.cuda.current_device())


def table_path(name: str) -> Path:
    """``kernels/configs/<name>.json``."""
    return CONFIG_DIR / f"{name}.json"


_OFF = ("0", "off", "none", "false", "no")


def table_for(device: torch.device) -> Optional[Table]:
    """The tuned table that applies to launches on ``device``: an ``override("table", t)``,
    else ``TRITONMOE_CONFIG_TABLE`` (a path, or ``off``), else the packaged file for a CUDA
    device's name; None where there is none (the interpreter has none unless given one)."""
    e = _OVERRIDES.get().get("table")
    if e is not None:
        return e.config
    env = os.environ.get("TRITONMOE_CONFIG_TABLE", "").strip()
    if env:
        if env.lower() in _OFF:
            return None
        return _cached(Path(env))
    name = device_name(device)
    return _device_table(name) if name else None


@functools.lru_cache(maxsize=16)
def _device_table(name: str) -> Optional[Table]:
    return _cached(table_path(name))


def _check_table(v: Any) -> None:
    if v is not None and not isinstance(v, Table):
        raise TypeError(f"override('table', ...) expects a Table or None, got {type(v).__name__}")


register("table", check=_check_table, doc="the tuned table in use (None: heuristics only)")


# ---------------------------------------------------------------------------------------------
# What ran
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ran:
    """One choice made during a :func:`recording`: ``target``, the shape key (exact fields and
    the bucket value), the config and where it came from (one of :data:`SOURCES`)."""

    target: str
    key: Mapping[str, Any]
    config: Any
    source: str

    def as_dict(self) -> dict:
        cfg = config_dict(self.config) if dataclasses.is_dataclass(self.config) else self.config
        return {"target": self.target, "key": dict(self.key), "config": cfg, "source": self.source}


_RECORD: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("tritonmoe_kernel_config_record",
                                                                         default=None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect a :class:`Ran` for every config choice made inside the block (run the call once
    eagerly inside it: CUDA-graph replays make no choices)."""
    log: list = []
    token = _RECORD.set(log)
    try:
        yield log
    finally:
        _RECORD.reset(token)


def note(target: str, key: Mapping[str, Any], config: Any, source: str, **bucket: Any) -> None:
    """Record a choice: ``key`` (the exact fields) plus ``bucket`` (the policies call this; a
    no-op outside :func:`recording`, where it builds nothing)."""
    log = _RECORD.get()
    if log is not None:
        log.append(Ran(target, {**key, **bucket}, config, source))


def summary(ran: list) -> list[dict]:
    """The distinct choices of a recording, in first-seen order, as JSON-ready dicts."""
    out, seen = [], set()
    for r in ran:
        d = r.as_dict()
        k = json.dumps(d, sort_keys=True, default=str)
        if k not in seen:
            seen.add(k)
            out.append(d)
    return out


def quiet() -> bool:
    """True when no override and no :func:`recording` is active: a launcher may then reuse the
    config it chose before for the same shape and device (tables are read once per process, so
    the choice changes only with ``TRITONMOE_CONFIG_TABLE``, which such a cache keys on)."""
    return not _OVERRIDES.get() and _RECORD.get() is None
