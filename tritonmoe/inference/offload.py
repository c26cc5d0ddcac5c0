"""Ring-memory expert offloading (SE-MoE, paper 002 §2.4): a stack of N MoE layers whose expert
weights live in host memory (pinned on CUDA machines), served from K < N device slots.

The K slots form a ring over the layers in execution order: layer i computes from a slot while
the next layers' experts are copied into the slots behind it, on a copy lane (a CUDA stream
ordered by events; on CPU a worker thread). When layer i finishes, its slot is refilled with
layer (i + K) mod N, so K consecutive layers (cyclically: the next forward starts again at
layer 0) are resident or in flight at any time, and a layer waits only if its copy is longer
than the compute of the K - 1 layers before it.

    stack = OffloadedExperts(model_layers, slots=2)   # layers: MoELayers, called by the model as usual
    with torch.no_grad():
        y = model(x)                                   # forward hooks swap the experts in and out
    stack.close()

Inference only: the layers' expert parameters point at a slot during their own forward and at an
empty placeholder otherwise (their gradients would be lost). Layers must run in the order given,
each once per pass (a layer called out of order raises). Not done here: SE-MoE's disk tier
(a host LFU cache in front of files, "2D prefetch").
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

__all__ = ["OffloadedExperts"]


class OffloadedExperts:
    """Serve ``layers`` (local :class:`~tritonmoe.MoELayer`\\ s of one shape, called in this
    order) from ``slots`` device slots; see the module docstring.

    Attributes:
        host: per layer, its expert tensors in host memory (the copies the slots are filled from).
        slot_bytes: device bytes of one slot (all of a layer's expert tensors).
        waits: per layer call, whether its experts were still in flight when it started (the
            copy was not hidden).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], slots: int, *, timeout_s: float = 300.0) -> None:
        from ..layer import MoELayer

        layers = list(layers)
        if not layers:
            raise ValueError("layers is empty; pass the MoE layers of the model in execution order")
        for i, layer in enumerate(layers):
            if not isinstance(layer, MoELayer):
                raise TypeError(f"layers[{i}] is a {type(layer).__name__}, not a tritonmoe.MoELayer")
            if layer.expert_parallel:
                raise ValueError(f"layers[{i}] is expert-parallel; offloading serves local layers")
        N = len(layers)
        if not isinstance(slots, int) or isinstance(slots, bool):
            raise TypeError(f"slots must be an int, got {type(slots).__name__}")
        if slots < 1 or slots >= N:
            raise ValueError(
                f"slots={slots} for {N} layers: use 1 <= slots < {N} (slots >= the number of layers offloads "
                "nothing: keep the layers resident)"
            )
        self.names = [n for n in ("w1", "w2", "b1", "b2") if getattr(layers[0], n) is not None]
        shapes = {n: (tuple(getattr(layers[0], n).shape), getattr(layers[0], n).dtype) for n in self.names}
        for i, layer in enumerate(layers):
            mine = {n: (tuple(getattr(layer, n).shape), getattr(layer, n).dtype)
                    for n in self.names if getattr(layer, n) is not None}
            if mine != shapes:
                raise ValueError(f"layers[{i}] has expert tensors {mine}, layers[0] {shapes}: the slots hold one shape")
        self.layers = layers
        self.device = layers[0].w1.device
        self.timeout_s = float(timeout_s)
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            self.host = []
            for layer in layers:
                h = {}
                for n in self.names:
                    t = getattr(layer, n).detach().to("cpu", copy=True)
                    h[n] = t.pin_memory() if cuda else t
                self.host.append(h)
            self.slots = [{n: torch.empty(s, dtype=dt, device=self.device) for n, (s, dt) in shapes.items()}
                          for _ in range(slots)]
            self._placeholder = {n: torch.empty(0, dtype=dt, device=self.device) for n, (_, dt) in shapes.items()}
            for layer in layers:  # free the resident copies: the host holds them now
                for n in self.names:
                    getattr(layer, n).data = self._placeholder[n]
        self.slot_bytes = sum(t.numel() * t.element_size() for t in self.slots[0].values())
        self.waits: list[bool] = []
        self._slot_of: dict[int, int] = {}
        self._ready: dict[int, object] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._pool = None if cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonmoe-offload")
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._post_hook(i)))
        for i in range(slots):
            self._load(i, i)

    # -- the copy lane --------------------------------------------------------------------------

    def _copy(self, layer: int, slot: int) -> None:
        with torch.no_grad():
            for n in self.names:
                self.slots[slot][n].copy_(self.host[layer][n], non_blocking=self._stream is not None)

    def _load(self, layer: int, slot: int, after=None) -> None:
        """Start copying ``layer``'s experts into ``slot`` (after ``after``, a CUDA event of the
        compute that last read the slot)."""
        self._slot_of[layer] = slot
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                if after is not None:
                    self._stream.wait_event(after)
                self._copy(layer, slot)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._ready[layer] = done
        else:
            self._ready[layer] = self._pool.submit(self._copy, layer, slot)

    def _pre_hook(self, i: int):
        def hook(module, args):
            if i != self._next:
                raise RuntimeError(
                    f"OffloadedExperts: layer {i} called but layer {self._next} is next; the layers must run in the "
                    "order given, each once per forward"
                )
            ready = self._ready.pop(i)
            if isinstance(ready, Future):
                self.waits.append(not ready.done())
                ready.result(timeout=self.timeout_s)  # the copy thread's error surfaces here
            else:
                self.waits.append(not ready.query())
                torch.cuda.current_stream(self.device).wait_event(ready)
            slot = self.slots[self._slot_of[i]]
            for n in self.names:
                getattr(module, n).data = slot[n]

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
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
        for r in list(self._ready.values()):
            if isinstance(r, Future):
                r.result(timeout=self.timeout_s)
            else:
                r.synchronize()
        for h in self._handles:
            h.remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
