"""Ring-memory expert offloading (SE-MoE, paper 002 §2.4): a stack of N MoE layers whose expert
weights live in host memory (pinned on CUDA machines), served from K < N device slots.

The K slots form a ring over the layers in execution order: layer i computes from a slot while
the next layers' experts are copied into the slots behind it, on a copy lane (a CUDA stream
ordered by events; on CPU a worker thread). When layer i finishes, its slot is refilled with
layer (i + K) mod N, so K consecutive layers (cyclically: the next forward starts again at
layer 0) are resident or in flight at any time, and a layer waits only if its copy is longer
than the compute of the K - 1 layers before it.

    stack = OffloadedExperts(model_layers, layer_slots=2)   # layers: MoELayers, called by the model as usual
    with torch.no_grad():
        y = model(x)                                   # forward hooks swap the experts in and out
    stack.close()

Inference only: the layers' expert parameters point at a slot during their own forward and at an
empty placeholder otherwise (their gradients would be lost). Layers must run in the order given,
each once per pass (a layer called out of order raises).

Disk tier (SE-MoE's "2D prefetch", 002 §2.2 Algorithm 1; PAPERS.md §2.2): with
``disk_path=``, the experts are written to one file (layer-major, then expert, then tensor) and
host memory holds only a :class:`HostLFUCache` of ``cache_bytes`` in front of it; the copy lane
stages the next layer's experts disk -> cache (reads only the experts the cache misses) and then
copies them cache -> slot. The cache must hold at least one layer (a layer is staged whole
before its copy), else ``ValueError``. Weights are read-only at inference, so nothing is
written back (Algorithm 1's write-back of updated states is a training concern).
"""

from __future__ import annotations

import os
import threading
import zlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Optional, Sequence

import torch

from ._released import _Released, is_released, mark_released
from tritonmoe.layer import MoELayer
from tritonmoe.core.suggest import UNSET, renamed_argument

__all__ = ["OffloadedExperts", "HostLFUCache", "OffloadChecksumError"]


class HostLFUCache:
    """SE-MoE's CPU cache of sparse parameters (002 Algorithm 1, with the readings of
    PAPERS.md §2.2): ``capacity`` entries of ``entry_bytes`` bytes each (host buffers, pinned
    when ``pin``).

    :meth:`get` (key, fill): a hit counts ``hits[key] += 1``; a miss with room inserts the key
    with ``hits = 1`` and fills its buffer (``fill(buffer)``, e.g. a disk read); a miss when
    full evicts one entry, the argmin of hits among entries with hits >= ``threshold`` that are
    not ``protected`` (ties: the entry inserted first), and reuses its buffer; when none
    qualifies the request bypasses the cache (a scratch buffer, hits unchanged). Every
    ``period`` requests all counts are multiplied by ``beta`` (the paper's moving average).

    Attributes: ``hits`` (dict key -> count), ``requests``, ``misses``, ``evictions``,
    ``bypasses``, ``fills`` (calls of ``fill``: the disk reads).
    """

    def __init__(self, capacity: int, entry_bytes: int, *, threshold: float = 1.0, beta: float = 0.5,
                 period: int = 1024, pin: bool = False) -> None:
        for name, v in (("capacity", capacity), ("entry_bytes", entry_bytes), ("period", period)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if not (0.0 < beta <= 1.0):
            raise ValueError(f"beta={beta} must be in (0, 1]")
        self.capacity, self.entry_bytes = capacity, entry_bytes
        self.threshold, self.beta, self.period, self.pin = float(threshold), float(beta), period, pin
        self.hits: dict[Hashable, float] = {}
        self._buf: dict[Hashable, torch.Tensor] = {}
        self.requests = self.misses = self.evictions = self.bypasses = self.fills = 0

    def _new_buffer(self) -> torch.Tensor:
        b = torch.empty(self.entry_bytes, dtype=torch.uint8)
        return b.pin_memory() if self.pin else b

    def __contains__(self, key: Hashable) -> bool:
        return key in self._buf

    def __len__(self) -> int:
        return len(self._buf)

    def get(self, key: Hashable, fill: Callable[[torch.Tensor], None], protected=()) -> torch.Tensor:
        """The entry of ``key`` (uint8 [entry_bytes]), filled by ``fill`` on a miss."""
        self.requests += 1
        if key in self._buf:
            self.hits[key] += 1
            out = self._buf[key]
        else:
            self.misses += 1
            if len(self._buf) < self.capacity:
                buf = self._new_buffer()
            else:
                cands = [k for k, h in self.hits.items() if h >= self.threshold and k not in protected]
                if cands:
                    low = min(self.hits[k] for k in cands)
                    victim = next(k for k in cands if self.hits[k] == low)
                    buf = self._buf.pop(victim)
                    del self.hits[victim]
                    self.evictions += 1
                else:
                    buf = None
            if buf is None:  # no entry may go: bypass the cache
                self.bypasses += 1
                out = self._new_buffer()
            else:
                self._buf[key] = out = buf
                self.hits[key] = 1.0
            self.fills += 1
            fill(out)
        if self.requests % self.period == 0:
            for k in self.hits:
                self.hits[k] *= self.beta
        return out


# -- the constructor's parts: the stack's checks, the expert record, the host and disk tiers -----

def _check_stack(layers: Sequence[torch.nn.Module], slots) -> tuple[list, list, dict]:
    """Check the layers of a stack and its number of slots (TypeError / ValueError naming the
    argument). Returns ``(layers, names, shapes)``: the layers as a list, the names of their expert
    tensors (w1, w2 and the biases present) and name -> (shape, dtype), the same in every layer."""
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the MoE layers of the model in execution order")
    for i, layer in enumerate(layers):
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layers[{i}] is a {type(layer).__name__}, not a tritonmoe.MoELayer")
        if layer.expert_parallel:
            raise ValueError(f"layers[{i}] is expert-parallel; offloading serves local layers")
        if is_released(layer):
            raise ValueError(f"layers[{i}]'s experts were already moved to host memory by another wrapper; call "
                             "tritonmoe.inference.restore_experts(layer) (after closing that wrapper) first")
    N = len(layers)
    if not isinstance(slots, int) or isinstance(slots, bool):
        raise TypeError(f"layer_slots must be an int, got {type(slots).__name__}")
    if N < 2:
        raise ValueError(
            f"OffloadedExperts got {N} layer (layer_slots={slots}): a ring of K < N slots needs at least 2 layers, "
            "and with one layer no layer_slots value is valid (the range 1 <= layer_slots < N is empty). Pass all "
            "of the model's MoE layers, or keep a single layer resident (no OffloadedExperts)"
        )
    if slots < 1 or slots >= N:
        raise ValueError(
            f"layer_slots={slots} for {N} layers: use 1 <= layer_slots < {N} (as many slots as layers offloads "
            "nothing: keep the layers resident)"
        )
    names = [n for n in ("w1", "w2", "b1", "b2") if getattr(layers[0], n) is not None]
    shapes = {n: (tuple(getattr(layers[0], n).shape), getattr(layers[0], n).dtype) for n in names}
    for i, layer in enumerate(layers):
        mine = {n: (tuple(getattr(layer, n).shape), getattr(layer, n).dtype)
                for n in names if getattr(layer, n) is not None}
        if mine != shapes:
            raise ValueError(f"layers[{i}] has expert tensors {mine}, layers[0] {shapes}: the slots hold one shape")
    return layers, names, shapes


def _record_layout(shapes: dict) -> tuple[list, int]:
    """The byte layout of one expert's record (the disk tier's unit and a host cache entry): its
    tensors one after the other. Returns ``(parts, record_bytes)``, parts: (name, byte offset in
    the record, bytes, dtype, shape of one expert) per tensor."""
    parts, off = [], 0
    for n, (shape, dt) in shapes.items():
        nb = int(torch.Size(shape[1:]).numel()) * torch.empty((), dtype=dt).element_size()
        parts.append((n, off, nb, dt, shape[1:]))
        off += nb
    return parts, off


def _disk_cache(disk: bool, cache_bytes, cache_options, num_experts: int, record_bytes: int, *,
                pin: bool) -> Optional[HostLFUCache]:
    """The host cache in front of the disk tier (``disk``; default two layers' experts, at least
    one layer's), or None without it (then ``cache_bytes`` / ``cache_options`` are refused)."""
    if not disk:
        if cache_bytes is not None or cache_options is not None:
            raise ValueError("cache_bytes / cache_options size the host cache of the disk tier; pass disk_path= too")
        return None
    layer_bytes = num_experts * record_bytes
    cache_bytes = 2 * layer_bytes if cache_bytes is None else cache_bytes
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int):
        raise TypeError(f"cache_bytes must be an int, got {type(cache_bytes).__name__}")
    if cache_bytes < layer_bytes:
        raise ValueError(
            f"cache_bytes={cache_bytes} is smaller than one layer's experts ({layer_bytes} bytes = {num_experts} experts "
            f"x {record_bytes} bytes); a layer is staged whole in the host cache: use cache_bytes >= {layer_bytes}"
        )
    return HostLFUCache(cache_bytes // record_bytes, record_bytes, pin=pin, **(cache_options or {}))


class OffloadChecksumError(OSError):
    """An expert record read back from the disk tier does not match the checksum computed when it
    was written: the file changed on disk while the stack had it open."""


def _write_disk_tier(path: str, layers: list, parts: list, num_experts: int) -> list[int]:
    """Write the layers' experts to ``path`` (overwritten): layer-major, then expert, then the
    record's tensors (:func:`_record_layout`). Returns the CRC-32 of each record, in file order
    (layer * E + expert), which every read verifies (:func:`_check_record`)."""
    crcs = []
    with open(path, "wb") as f:
        for layer in layers:
            # host copies: writing the disk tier once, at construction (no forward runs here)
            ts = [getattr(layer, n).detach().cpu().contiguous() for n, *_ in parts]
            for e in range(num_experts):
                record = b"".join(t[e].reshape(-1).view(torch.uint8).numpy().tobytes() for t in ts)
                crcs.append(zlib.crc32(record))
                f.write(record)
    return crcs


def _check_record(path: str, buf, crc: int, layer: int, expert: int) -> None:
    """Raise :class:`OffloadChecksumError` when ``buf`` (one expert record read back) does not
    match the CRC-32 written at construction."""
    got = zlib.crc32(memoryview(buf))
    if got != crc:
        raise OffloadChecksumError(
            f"{path}: layer {layer} expert {expert} read back with CRC-32 {got:#010x}, written as {crc:#010x}: the "
            "offload file was changed on disk while the OffloadedExperts stack had it open. Do not write to it; "
            "rebuild the stack from the model's weights (or a checkpoint) to rewrite it"
        )


def _host_copies(layers: list, names: list, *, pin: bool) -> list[dict]:
    """Per layer, a host copy of its expert tensors (pinned when ``pin``)."""
    out = []
    for layer in layers:
        h = {}
        for n in names:
            t = getattr(layer, n).detach().to("cpu", copy=True)
            h[n] = t.pin_memory() if pin else t
        out.append(h)
    return out


def _wait_all(ready, timeout_s: float, *, ignore_errors: bool = False) -> None:
    """Wait for the copies in ``ready`` (futures of the copy thread, or CUDA events); their errors
    are raised unless ``ignore_errors``."""
    for r in list(ready):
        try:
            if isinstance(r, Future):
                r.result(timeout=timeout_s)
            else:
                r.synchronize()
        except Exception:
            if not ignore_errors:
                raise


class OffloadedExperts:
    """Serve ``layers`` (local :class:`~tritonmoe.MoELayer`\\ s of one shape, called in this
    order) from ``layer_slots`` device slots, each holding one layer's experts; see the module docstring.

    Args:
        layers: the MoE layers, in execution order.
        layer_slots: K, device slots of one layer's experts each (1 <= K < N). ``slots=`` is its
            deprecated name (a :class:`DeprecationWarning`; ReplicatedMoELayer's slots hold experts).
            ``self.slots`` is the list of the K slot buffers.
        disk_path: a file to keep the experts in (written here, overwritten if present); then
            host memory holds only the LFU cache (module docstring).
        cache_bytes: the host cache's size with ``disk_path`` (default: two layers); at least
            one layer's expert bytes.
        cache_options: keyword arguments of :class:`HostLFUCache` (threshold, beta, period).

    Attributes:
        host: per layer, its expert tensors in host memory (the copies the slots are filled
            from); None with ``disk_path``.
        cache: the :class:`HostLFUCache` with ``disk_path``, else None.
        slot_bytes: device bytes of one slot (all of a layer's expert tensors).
        expert_bytes: bytes of one expert's tensors (a cache entry).
        waits: per layer call, whether its experts were still in flight when it started (the
            copy was not hidden).
        stall_s: per layer call, seconds its forward waited for its copy (the copy time not
            hidden behind compute).
        copy_s: per copy on the worker thread, its seconds (disk reads, cache and slot copies).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], layer_slots: Optional[int] = None, *,
                 timeout_s: float = 300.0, disk_path: Optional[str | os.PathLike] = None,
                 cache_bytes: Optional[int] = None, cache_options: Optional[dict] = None, slots=UNSET) -> None:

        slots = renamed_argument("OffloadedExperts", "layer_slots", layer_slots, "slots", slots)
        if slots is None:
            raise TypeError("OffloadedExperts() needs layer_slots=K: the device slots, one layer's experts each")

        layers, self.names, shapes = _check_stack(layers, slots)
        self.layers = layers
        self.device = layers[0].w1.device
        self.timeout_s = float(timeout_s)
        cuda = self.device.type == "cuda"
        E = shapes["w1"][0][0]
        self.num_experts = E
        self._parts, self.expert_bytes = _record_layout(shapes)
        self.disk_path = None if disk_path is None else os.fspath(disk_path)
        self.cache = _disk_cache(self.disk_path is not None, cache_bytes, cache_options, E, self.expert_bytes, pin=cuda)
        self._fd = None
        with torch.no_grad():
            if self.disk_path is not None:
                self._crcs = _write_disk_tier(self.disk_path, layers, self._parts, E)
                self._fd = os.open(self.disk_path, os.O_RDONLY)
            self.host = None if self.disk_path is not None else _host_copies(layers, self.names, pin=cuda)
            self.slots = [{n: torch.empty(s, dtype=dt, device=self.device) for n, (s, dt) in shapes.items()}
                          for _ in range(slots)]
            self._placeholder = {n: torch.empty(0, dtype=dt, device=self.device) for n, (_, dt) in shapes.items()}
            for layer in layers:  # free the resident copies: the host holds them now
                for n in self.names:
                    getattr(layer, n).data = self._placeholder[n]
        self.slot_bytes = sum(t.numel() * t.element_size() for t in self.slots[0].values())
        self.waits: list[bool] = []
        self.stall_s: list[float] = []
        self.copy_s: list[float] = []
        self._slot_of: dict[int, int] = {}
        self._ready: dict[int, object] = {}
        self._next = 0
        self._active: Optional[int] = None  # the layer whose pre-hook completed and whose forward runs
        self._lock = threading.Lock()
        threaded = not cuda or self.disk_path is not None  # disk reads never block the compute thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonmoe-offload") if threaded else None
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(i)))
            # always_call: the post-step also runs when the layer's forward raises, so a failed
            # forward resets the ring instead of leaving it waiting for a copy it already consumed
            self._handles.append(layer.register_forward_hook(self._post_hook(i), always_call=True))
        for i, layer in enumerate(layers):
            # after the ring's hooks: its pre-hook swaps the slot in before the refusal looks
            mark_released(layer, _Released(
                owner="an OffloadedExperts stack", names=list(self.names), host=lambda i=i: self._host_weights(i),
                write=None if self.disk_path is not None else (lambda values, i=i: self._write_host(i, values)),
                call_hint="the OffloadedExperts stack that served it in its ring was closed",
                busy=lambda: ("the OffloadedExperts stack still serves this layer: close() it before restore_experts"
                              if self._handles else None)))
        for i in range(slots):
            self._load(i, i)

    # -- the layers' weights, for state_dict / load_state_dict -------------------------------------

    def _host_weights(self, layer: int) -> dict:
        """Layer ``layer``'s full expert tensors in host memory (name -> [E, ...]): the host copy,
        or read back from the disk tier (a fresh tensor per call)."""
        if self.disk_path is None:
            return self.host[layer]
        E, rec = self.num_experts, self.expert_bytes
        raw = torch.empty(E * rec, dtype=torch.uint8)
        with open(self.disk_path, "rb") as f:
            got = os.preadv(f.fileno(), [memoryview(raw.numpy())], layer * E * rec)
        if got != E * rec:
            raise OSError(f"{self.disk_path}: read {got} of {E * rec} bytes of layer {layer}; the file was truncated or "
                          "changed")
        rows = raw.view(E, rec)
        for e in range(E):
            _check_record(self.disk_path, rows[e].numpy(), self._crcs[layer * E + e], layer, e)
        return {n: rows[:, o:o + nb].contiguous().view(dt).view(E, *shape) for n, o, nb, dt, shape in self._parts}

    def _write_host(self, layer: int, values: dict) -> None:
        """``load_state_dict`` into layer ``layer``: the new weights into its host copy; an open
        ring then reloads its slots (the copies in flight finish first)."""
        _wait_all(self._ready.values(), self.timeout_s)  # a copy in flight may read the host copy
        with torch.no_grad():
            for n, v in values.items():
                self.host[layer][n].copy_(v.detach())
        if self._handles:
            self.reset()

    # -- the copy lane --------------------------------------------------------------------------

    def _copy(self, layer: int, slot: int) -> None:
        with torch.no_grad():
            if self.disk_path is None:
                for n in self.names:
                    self.slots[slot][n].copy_(self.host[layer][n], non_blocking=self._stream is not None)
                return
            # 2D prefetch, the vertical part: disk -> host cache (misses only) -> device slot
            E, off = self.num_experts, self.expert_bytes
            keys = [(layer, e) for e in range(E)]
            bufs = [self.cache.get(k, self._reader(*k), protected=keys) for k in keys]
            for e, buf in enumerate(bufs):
                for n, o, nb, dt, shape in self._parts:
                    src = buf[o:o + nb].view(dt).view(shape)
                    self.slots[slot][n][e].copy_(src, non_blocking=self._stream is not None)

    def _reader(self, layer: int, expert: int):
        pos = (layer * self.num_experts + expert) * self.expert_bytes

        def fill(buf: torch.Tensor) -> None:
            got = os.preadv(self._fd, [memoryview(buf.numpy())], pos)
            if got != self.expert_bytes:
                raise OSError(f"{self.disk_path}: read {got} of {self.expert_bytes} bytes of layer {layer} expert "
                              f"{expert}; the file was truncated or changed")
            _check_record(self.disk_path, buf.numpy(), self._crcs[layer * self.num_experts + expert], layer, expert)

        return fill

    def _fill(self, layer: int, slot: int, after) -> None:
        """The worker thread's copy of ``layer`` into ``slot``; on CUDA through the copy stream
        after ``after``, waited for here (the cache buffers are reused by the next copy)."""
        t0 = time.perf_counter()
        if self._stream is None:
            self._copy(layer, slot)
        else:
            with torch.cuda.stream(self._stream):
                if after is not None:
                    self._stream.wait_event(after)
                self._copy(layer, slot)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()  # on the copy thread: the compute thread does not wait here
        self.copy_s.append(time.perf_counter() - t0)

    def _load(self, layer: int, slot: int, after=None) -> None:
        """Start copying ``layer``'s experts into ``slot`` (after ``after``, a CUDA event of the
        compute that last read the slot)."""
        self._slot_of[layer] = slot
        if self._pool is not None:
            self._ready[layer] = self._pool.submit(self._fill, layer, slot, after)
        elif self._stream is not None:
            with torch.cuda.stream(self._stream):
                if after is not None:
                    self._stream.wait_event(after)
                self._copy(layer, slot)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._ready[layer] = done

    def _pre_hook(self, i: int):
        def hook(module, args):
            self._active = None
            if i != self._next:
                raise RuntimeError(
                    f"OffloadedExperts: layer {i} called but layer {self._next} is next; the layers must run in the "
                    "order given, each once per forward (the ring is reset now: the next forward starts at layer 0; "
                    "call reset() after a forward aborted outside the MoE layers)"
                )
            ready = self._ready[i]
            t0 = time.perf_counter()
            if isinstance(ready, Future):
                self.waits.append(not ready.done())
                ready.result(timeout=self.timeout_s)  # the copy thread's error surfaces here
            else:
                self.waits.append(not ready.query())
                torch.cuda.current_stream(self.device).wait_event(ready)
            del self._ready[i]
            self.stall_s.append(time.perf_counter() - t0)
            slot = self.slots[self._slot_of[i]]
            for n in self.names:
                getattr(module, n).data = slot[n]
            self._active = i

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            # output is None only when the pre-hook or the layer's forward raised (always_call):
            # the model forward is aborted, so the next one starts at layer 0
            if output is None or self._active != i:
                self.reset()
                return None
            self._active = None
            for n in self.names:
                getattr(module, n).data = self._placeholder[n]
            slot = self._slot_of.pop(i)
            N = len(self.layers)
            nxt = (i + len(self.slots)) % N
            after = None
            if self._stream is not None:
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device))
            self._load(nxt, slot, after)
            self._next = (i + 1) % N
            return output

        return hook

    def reset(self) -> None:
        """Reset the ring to its start after an aborted forward: wait for the copies in flight,
        then reload the first ``slots`` layers so that the next forward starts at layer 0. Runs by
        itself when a layer's forward raises; call it after an error raised between the layers."""
        self._active = None
        for n in self.names:
            for layer in self.layers:
                getattr(layer, n).data = self._placeholder[n]
        # the failed copy is redone below; its error was (or is) raised elsewhere
        _wait_all(self._ready.values(), self.timeout_s, ignore_errors=True)
        self._ready.clear()
        self._slot_of.clear()
        after = None
        if self._stream is not None:  # the slots' last readers on the compute stream finish first
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        for s in range(len(self.slots)):
            self._load(s, s, after)
        self._next = 0

    def resident_bytes(self) -> int:
        """Device bytes held by expert weights: the distinct storages the slots and the layers'
        expert parameters point at (measured from the tensors, not computed from the shapes)."""
        seen, total = set(), 0
        tensors = [t for s in self.slots for t in s.values()]
        tensors += [getattr(layer, n) for layer in self.layers for n in self.names]
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    def close(self) -> None:
        """Wait for the copies in flight, remove the hooks and stop the copy thread (the layers'
        experts stay offloaded)."""
        _wait_all(self._ready.values(), self.timeout_s)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def overlap_fraction(self) -> Optional[float]:
        """The fraction of the worker thread's copy time hidden behind compute:
        1 - sum(stall_s) / sum(copy_s) (None before a copy was timed; CUDA without the disk
        tier copies on a stream and is timed by the benchmark's events instead)."""
        tot = sum(self.copy_s)
        if tot <= 0:
            return None
        return max(0.0, 1.0 - sum(self.stall_s) / tot)
