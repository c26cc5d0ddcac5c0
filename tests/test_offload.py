"""Ring-memory expert offloading (tritonmoe.inference.OffloadedExperts): a stack served from K
slots equals the all-resident stack, holds K slots of expert memory (measured from the storages),
prefetches on a thread, and refuses bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import tritonmoe as tm
from tritonmoe.inference import OffloadedExperts


def _model(N: int, **cfg):
    torch.manual_seed(0)
    mods = []
    for _ in range(N):
        mods += [torch.nn.Linear(8, 8, dtype=torch.float64), tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, **cfg),
                                                                          dtype=torch.float64)]
    return torch.nn.Sequential(*mods)


@pytest.mark.parametrize("N,K", [(5, 2), (4, 1), (3, 2)])
def test_offloaded_stack_equals_resident(N, K):
    model = _model(N, expert_ffn_bias=True, activation="swiglu_oai")
    with torch.no_grad():
        for m in model:
            if isinstance(m, tm.MoELayer):
                m.b1.normal_()
    resident = copy.deepcopy(model)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    one_layer = sum(getattr(layers[0], n).numel() * 8 for n in ("w1", "w2", "b1", "b2"))
    stack = OffloadedExperts(layers, layer_slots=K)
    try:
        assert stack.slot_bytes == one_layer
        assert stack.resident_bytes() == K * one_layer  # the N layers' own copies are freed
        with torch.no_grad():
            for T in (7, 0, 3):  # several passes: the ring wraps around
                x = torch.randn(T, 8, dtype=torch.float64)
                assert torch.equal(model(x), resident(x))
                assert stack.resident_bytes() == K * one_layer
        assert len(stack.waits) == 3 * N
    finally:
        stack.close()


def test_layers_out_of_order_and_bad_input():
    model = _model(3)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    with pytest.raises(ValueError, match="slots=3 for 3 layers"):
        OffloadedExperts(layers, layer_slots=3)
    with pytest.raises(ValueError, match="slots=0"):
        OffloadedExperts(layers, layer_slots=0)
    with pytest.raises(ValueError, match="layers is empty"):
        OffloadedExperts([], layer_slots=1)
    with pytest.raises(TypeError, match="not a tritonmoe.MoELayer"):
        OffloadedExperts([torch.nn.Linear(2, 2)], layer_slots=1)
    other = tm.MoELayer(tm.MoEConfig(8, 10, 4, 2), dtype=torch.float64)
    with pytest.raises(ValueError, match="the slots hold one shape"):
        OffloadedExperts(layers[:2] + [other], layer_slots=1)
    resident = copy.deepcopy(model)
    stack = OffloadedExperts(layers, layer_slots=2)
    x = torch.randn(5, 8, dtype=torch.float64)
    try:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="layer 1 called but layer 0 is next"):
                layers[1](torch.randn(2, 8, dtype=torch.float64))
            assert torch.equal(model(x), resident(x))  # the ordering error resets the ring
            # a failed forward (the layer's own dtype check, mid-stack) leaves the ring usable: the next
            # valid forward equals the resident stack (it raised KeyError(0) when the ring stalled)
            model[:2](x)
            with pytest.raises(TypeError, match="float32"):
                layers[1](x.float())
            for _ in range(2):
                assert torch.equal(model(x), resident(x))
            with pytest.raises(TypeError, match="float32"):
                layers[0](x.float())
            assert torch.equal(model(x), resident(x))
            model[:2](x)  # a forward aborted between the layers: reset() by hand
            stack.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        stack.close()


# -- the disk tier: experts in a file behind a host LFU cache (SE-MoE's 2D prefetch) -----------


def _counting_reads(monkeypatch):
    import os

    from tritonmoe.inference import offload

    reads = []
    real = os.preadv

    def preadv(fd, bufs, pos):
        n = real(fd, bufs, pos)
        reads.append((pos, n))
        return n

    monkeypatch.setattr(offload.os, "preadv", preadv)
    return reads


@pytest.mark.parametrize("cache_layers", [1, 4])
def test_disk_tier_equals_resident(tmp_path, monkeypatch, cache_layers):
    N, K = 4, 2
    model = _model(N, expert_ffn_bias=True)
    resident = copy.deepcopy(model)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    layer_bytes = sum(getattr(layers[0], n).numel() * 8 for n in ("w1", "w2", "b1", "b2"))
    reads = _counting_reads(monkeypatch)
    stack = OffloadedExperts(layers, layer_slots=K, disk_path=tmp_path / "experts.bin", cache_bytes=cache_layers * layer_bytes)
    try:
        assert stack.host is None and (tmp_path / "experts.bin").stat().st_size == N * layer_bytes
        assert stack.resident_bytes() == K * layer_bytes
        per_pass = []
        with torch.no_grad():
            for T in (6, 0, 3):
                before = len(reads)
                x = torch.randn(T, 8, dtype=torch.float64)
                assert torch.equal(model(x), resident(x))
                per_pass.append(len(reads) - before)
        assert stack.resident_bytes() == K * layer_bytes
        E = 4
        assert all(n == stack.expert_bytes for _, n in reads)  # one expert per read
        if cache_layers == N:  # everything cached after the first loads: no more disk reads
            assert len(reads) == N * E and stack.cache.evictions == 0
        else:  # a one-layer cache re-reads every layer it copies
            assert per_pass[1:] == [N * E, N * E] and stack.cache.evictions == len(reads) - E
        assert stack.cache.fills == len(reads)
        assert stack.overlap_fraction() is not None and len(stack.stall_s) == 3 * N
    finally:
        stack.close()


def test_disk_tier_bad_input(tmp_path):
    layers = [m for m in _model(3) if isinstance(m, tm.MoELayer)]
    layer_bytes = sum(getattr(layers[0], n).numel() * 8 for n in ("w1", "w2"))
    with pytest.raises(ValueError, match=f"smaller than one layer's experts \\({layer_bytes} bytes"):
        OffloadedExperts(layers, layer_slots=1, disk_path=tmp_path / "x.bin", cache_bytes=layer_bytes - 1)
    with pytest.raises(ValueError, match="pass disk_path"):
        OffloadedExperts(layers, layer_slots=1, cache_bytes=10**6)
    with pytest.raises(TypeError, match="cache_bytes must be an int"):
        OffloadedExperts(layers, layer_slots=1, disk_path=tmp_path / "x.bin", cache_bytes=1e9)


def test_host_lfu_cache_algorithm_1():
    from tritonmoe.inference import HostLFUCache

    filled = []
    fill = lambda key: lambda buf: filled.append(key)  # noqa: E731
    c = HostLFUCache(2, 4, period=100)
    c.get("a", fill("a"))
    c.get("a", fill("a"))  # hit
    c.get("b", fill("b"))  # miss with room
    assert filled == ["a", "b"] and c.hits == {"a": 2.0, "b": 1.0}
    c.get("c", fill("c"))  # full: evict argmin hits ("b")
    assert "b" not in c and "a" in c and "c" in c and c.evictions == 1
    c.get("d", fill("d"), protected=("c",))  # "c" is protected: "a" goes although more used
    assert "a" not in c and c.evictions == 2
    c.get("e", fill("e"), protected=("c", "d"))  # nothing may go: bypass, counts unchanged
    assert "e" not in c and c.bypasses == 1 and set(c.hits) == {"c", "d"}
    hi = HostLFUCache(1, 4, threshold=5)
    hi.get("x", fill("x"))
    hi.get("y", fill("y"))  # "x" has 1 < threshold hits: not evictable, so "y" bypasses
    assert "x" in hi and hi.bypasses == 1
    decay = HostLFUCache(2, 4, beta=0.5, period=2)
    decay.get("x", fill("x"))
    decay.get("x", fill("x"))  # the 2nd request: counts halve
    assert decay.hits == {"x": 1.0}
    assert c.fills == 5 and c.requests == 6  # a, b, c, d, e were filled (the bypass too)
    with pytest.raises(ValueError, match="capacity=0"):
        HostLFUCache(0, 4)
    with pytest.raises(ValueError, match="beta=0"):
        HostLFUCache(1, 4, beta=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_ring_equals_resident(tmp_path, tier):
    """On a GPU: the copy lane is a CUDA stream (the disk tier stages on the worker thread, then
    copies on the stream); outputs equal the resident stack and the device holds K slots."""
    N, K = 4, 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[tm.MoELayer(tm.MoEConfig(64, 32, 4, 2), device="cuda", dtype=torch.float32)
                                  for _ in range(N)])
    resident = copy.deepcopy(model)
    kw = {"disk_path": tmp_path / "e.bin"} if tier == "disk" else {}
    stack = OffloadedExperts(list(model), layer_slots=K, **kw)
    try:
        with torch.no_grad():
            for T in (32, 0, 5):
                x = torch.randn(T, 64, device="cuda")
                assert torch.equal(model(x), resident(x))
        torch.cuda.synchronize()
        assert stack.resident_bytes() == K * stack.slot_bytes
    finally:
        stack.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_layers_state_dict_direct_call_and_restore(tmp_path, tier):
    """The released layers report their real weights in state_dict (the host copies, or the disk
    tier read back; it showed empty w1/w2), which load into a fresh resident model; a direct
    call after close() raises ExpertsReleasedError (it failed inside the expert computation
    with "not enough values to unpack"); restore_experts puts the weights back."""
    from tritonmoe.inference import ExpertsReleasedError, is_released, restore_experts

    N, K = 3, 1
    model = _model(N, expert_ffn_bias=True)
    resident = copy.deepcopy(model)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    kw = {"disk_path": tmp_path / "e.bin"} if tier == "disk" else {}
    stack = OffloadedExperts(layers, layer_slots=K, **kw)
    x = torch.randn(6, 8, dtype=torch.float64)
    want = resident(x)
    try:
        sd = model.state_dict()
        assert sd.keys() == resident.state_dict().keys()
        for k, v in resident.state_dict().items():
            assert torch.equal(sd[k], v), k
        assert stack.resident_bytes() == K * stack.slot_bytes  # reading the weights loaded nothing onto the device
        fresh = _model(N, expert_ffn_bias=True)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh.load_state_dict(sd)
        with torch.no_grad():
            assert torch.equal(fresh(x), want) and torch.equal(model(x), want)  # the ring still serves
        with pytest.raises(ExpertsReleasedError, match="close\\(\\) it before restore_experts"):
            restore_experts(layers[0])
    finally:
        stack.close()
    for layer in layers:
        with pytest.raises(ExpertsReleasedError, match=r"OffloadedExperts stack .* was closed.*restore_experts\(layer\)"):
            layer(x)
    with pytest.raises(RuntimeError, match="moved to host memory"):  # a RuntimeError subclass
        model(x)
    assert torch.equal(model.state_dict()[f"{2 * N - 1}.w2"], resident.state_dict()[f"{2 * N - 1}.w2"])
    with pytest.raises(ValueError, match="already moved to host memory"):
        OffloadedExperts(layers, layer_slots=K)
    for layer in layers:
        restore_experts(layer)
        assert not is_released(layer)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    with pytest.raises(ValueError, match="not released"):
        restore_experts(layers[0])


def test_load_state_dict_into_offloaded_layers(tmp_path):
    """load_state_dict of a checkpoint into an open stack (host tier) writes the host copies and
    the ring serves the new weights; the disk tier is read-only: a clear error, nothing written."""
    N, K = 3, 2
    model = _model(N)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    torch.manual_seed(5)
    new = _model(N)
    with torch.no_grad():
        for p in new.parameters():
            p.normal_()
    x = torch.randn(5, 8, dtype=torch.float64)
    stack = OffloadedExperts(layers, layer_slots=K)
    try:
        with torch.no_grad():
            model(x)  # mid-ring: the slots hold layers 0 and 1 again, the next pass starts at 0
            model.load_state_dict(new.state_dict())
            for _ in range(2):
                assert torch.equal(model(x), new(x))
        bad = dict(new.state_dict())
        bad["1.w1"] = bad["1.w1"][:, :-1]
        with pytest.raises(RuntimeError, match=r"size mismatch for 1\.w1: copying \(4, 7, 12\)"):
            model.load_state_dict(bad)
    finally:
        stack.close()
    disk_model = _model(N)
    before = copy.deepcopy(disk_model.state_dict())
    disk = OffloadedExperts([m for m in disk_model if isinstance(m, tm.MoELayer)], layer_slots=K, disk_path=tmp_path / "d.bin")
    try:
        with pytest.raises(RuntimeError, match="held read-only by an OffloadedExperts stack"):
            disk_model.load_state_dict(new.state_dict())
        got = disk_model.state_dict()
        assert all(torch.equal(got[k], before[k]) for k in before if k.endswith(("w1", "w2")))
    finally:
        disk.close()


def test_one_layer_names_why_no_slot_count_is_valid():
    layers = [m for m in _model(1) if isinstance(m, tm.MoELayer)]
    for k in (0, 1):
        with pytest.raises(ValueError, match=r"got 1 layer \(layer_slots=%d\).*at least 2 layers.*is empty" % k):
            OffloadedExperts(layers, layer_slots=k)


def test_disk_tier_detects_bytes_changed_on_disk(tmp_path):
    """A record changed on disk while the stack has the file open is caught by its CRC-32 on
    the read (the worker thread's read, surfacing at the layer's forward; and state_dict's)."""
    from tritonmoe.inference import OffloadChecksumError
    N, E = 3, 4
    model = _model(N)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    path = tmp_path / "e.bin"
    layer_bytes = sum(getattr(layers[0], n).numel() * 8 for n in ("w1", "w2"))
    stack = OffloadedExperts(layers, layer_slots=1, disk_path=path, cache_bytes=layer_bytes)
    try:
        x = torch.randn(5, 8, dtype=torch.float64)
        with torch.no_grad():
            model(x)  # clean file: reads verify
        rec = stack.expert_bytes
        with open(path, "r+b") as f:  # one byte of layer 2, expert 1 (not in the one-layer cache)
            f.seek((2 * E + 1) * rec + 3)
            b = f.read(1)
            f.seek((2 * E + 1) * rec + 3)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(OffloadChecksumError, match=r"e\.bin: layer 2 expert 1 read back with CRC-32.*changed on "
                                                       r"disk.*rebuild the stack"):
            with torch.no_grad():
                for _ in range(2):
                    model(x)
        with pytest.raises(OffloadChecksumError, match="layer 2 expert 1"):
            layers[2].state_dict()
        assert issubclass(OffloadChecksumError, OSError)
    finally:
        try:
            stack.close()
        except OffloadChecksumError:
            pass
