"""The one config mechanism of the kernels (kernels/config.py): overrides (nesting, typed errors,
the old spellings as aliases), the tuned table per device (loading, bucket lookup, fallback on a
missing file, a missing bucket, malformed JSON or entries), and the record of what ran."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tritonmoe
from tritonmoe import reference as ref
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import _grouped_gemm_persistent as P
from tritonmoe.kernels import config as CF
from tritonmoe.kernels import gemm_kinds as GK
from tritonmoe.kernels import partition as kpart
from tritonmoe.kernels import permute as kp
from tritonmoe.kernels import routing as kr

CPU = torch.device("cpu")
SEL = dict(rows=256, n=64, k=64, num_experts=4, dtype=torch.float16, tf32=False, device=CPU)  # 64 rows per expert


def _sel(kind="swiglu", **kw):
    return GK.select(kind, **{**SEL, **kw})


def _table(entries: dict, **extra) -> CF.Table:
    return CF.Table({"format": CF.FORMAT, "device": "test", "entries": entries, **extra}, "<test>")


def _entry(**cfg) -> dict:
    return {"config": {**CF.config_dict(C.INTERPRETER_CONFIG), **cfg}, "us": 1.0}


GROUP = CF.bucket_key(GK.gemm_key(torch.float16, False, 4, 64, 64))


# ---------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------


def test_every_kernel_family_is_a_target():
    assert set(CF.targets()) >= {
        "gemm.mm", "gemm.mm_act", "gemm.swiglu", "gemm.dact", "gemm.dact_swiglu", "gemm.wgrad",
        "decode.swiglu", "decode.mm_act", "decode.mm", "persistent", "ffn.decode", "ffn.preact",
        "permute.metadata", "permute.scatter", "permute.gather", "route", "partition", "table"}


def test_nested_overrides_compose_and_restore():
    base = _sel()
    assert base.source == "heuristic"
    with CF.override("gemm", num_stages=2):
        a = _sel()
        assert (a.num_stages, a.BM, a.source) == (2, base.BM, "override")
        assert _sel("wgrad").num_stages == 2  # the family prefix covers every gemm.* target
        with CF.override("gemm.swiglu", BN=32, GROUP_M=1):
            b = _sel()
            assert (b.num_stages, b.BN, b.GROUP_M) == (2, 32, 1)  # fields merge with the outer override
            assert _sel("mm").BN == base.BN
            with CF.override("gemm.swiglu", C.TileConfig(BM=32, BN=16, BK=32)):
                c = _sel()
                assert (c.BM, c.BN, c.BK, c.num_stages) == (32, 16, 32, 3)  # a whole config replaces
            assert _sel() == b
        assert _sel() == a
    assert _sel() == base and _sel().source == "heuristic"


@given(st.lists(st.tuples(st.sampled_from(["gemm", "gemm.swiglu", "gemm.mm"]), st.sampled_from([1, 2, 3, 4])),
                min_size=1, max_size=6))
def test_any_nesting_restores_every_level(levels):
    """At each depth the choice is what the innermost override covering it says; leaving a
    level restores exactly the choice before it."""
    def state():
        return _sel("swiglu"), _sel("mm")

    stacks = [contextlib.ExitStack() for _ in levels]
    before = []
    for depth, ((target, stages), stack) in enumerate(zip(levels, stacks)):
        before.append(state())
        stack.enter_context(CF.override(target, num_stages=stages))
        above = levels[: depth + 1]
        for kind in ("swiglu", "mm"):
            covering = [s for t, s in above if t in ("gemm", f"gemm.{kind}")]
            want = covering[-1] if covering else _sel(kind).num_stages
            assert _sel(kind).num_stages == want
    for stack, want in zip(reversed(stacks), reversed(before)):
        stack.close()
        assert state() == want
    assert _sel().source == "heuristic"


def test_override_errors_are_typed_and_raised_before_the_block():
    with pytest.raises(ValueError, match="unknown config target 'gem'"):
        with CF.override("gem", num_stages=2):
            pass
    with pytest.raises(ValueError, match=r"unknown fields \['stages'\]"):
        with CF.override("gemm.mm", stages=2):
            pass
    with pytest.raises(ValueError, match="power of two"):
        with CF.override("gemm", BM=24):  # checked against the class now, not at launch
            pass
    with pytest.raises(TypeError, match="expects a TileConfig"):
        with CF.override("gemm.mm", kr.RouteConfig(1, 1, 1, 1)):
            pass
    with pytest.raises(TypeError, match="expects a TileConfig, got NoneType"):
        with CF.override("gemm.mm", None):
            pass
    with pytest.raises(TypeError, match="needs a value"):
        with CF.override("ffn.decode"):
            pass
    with pytest.raises(TypeError, match="bool"):
        with CF.override("ffn.decode", 1):
            pass
    with pytest.raises(ValueError, match="preact mode"):
        with CF.override("ffn.preact", "keep"):
            pass
    with pytest.raises(TypeError, match="takes a value"):
        with CF.override("ffn.preact", "save", x=1):
            pass
    assert not CF.overridden("gemm.mm")


def test_old_spellings_are_deprecated_aliases_of_the_one_mechanism():
    cfg = C.TileConfig(BM=32, BN=32, BK=32, GROUP_M=1)
    old = pytest.warns(DeprecationWarning, match="deprecated; use tritonmoe.kernels.config.override")
    with old, C.override(cfg):
        assert all(CF.overridden(f"gemm.{k}") for k in C.KINDS)
        assert all(CF.overridden(f"decode.{k}") for k in C.DECODE_KINDS)
        assert _sel("mm").BN == 32 and _sel("mm").source == "override"
    with CF.override(("gemm", "decode"), cfg):  # the new spelling of the same thing
        assert all(CF.overridden(f"decode.{k}") for k in C.DECODE_KINDS) and _sel("mm").BN == 32
    with old, C.override(wgrad=cfg):
        assert CF.overridden("gemm.wgrad") and not CF.overridden("gemm.mm")
    with pytest.raises(ValueError, match="unknown GEMM kind"), old:
        with C.override(bogus=cfg):
            pass
    with old, C.force_decode(True):
        assert C.decode_path(1000, 2) and CF.value("ffn.decode") is True
    assert not C.decode_path(1000, 2)
    with old, C.preact_mode("recompute"):
        assert C.ffn_preact_mode() == "recompute" == CF.value("ffn.preact")
    with old, kp.config_override(metadata={"fused": False, "block_s": 16}, gather={"nsplit": 2}):
        m = kp.metadata_config(100, 8, CPU)
        assert (m.fused, m.block_s) == (False, 16)
        assert kp.rows_config("gather", 4, 2, 64, 2, CPU).nsplit == 2
        assert not CF.overridden("permute.scatter")
    rc = dataclasses.replace(kr.route_config(16, interpret=True), block_t=2)
    with old, kr.config_override(rc):
        assert CF.resolve("route", None) == (rc, True)
    pc = kpart.PartitionConfig(block_r=2, block_d=16)
    with old, kpart.override_config(pc):
        assert kpart.select_config(64, 4) == pc
    assert kpart.select_config(64, 4) != pc
    with old, P.options(epilogue_split=2, flatten=False) as opts:
        assert opts == P.current_options() == P.PersistentOptions(flatten=False, epilogue_split=2)
        with CF.override("persistent", tma_store=False):
            assert P.current_options() == P.PersistentOptions(flatten=False, tma_store=False, epilogue_split=2)
    assert P.current_options() == P.PersistentOptions()


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=8, unique=True), st.floats(0.5, 9000))
def test_lookup_takes_the_nearest_bucket(buckets, m):
    tbl = _table({"gemm.swiglu": {GROUP: {str(b): _entry(GROUP_M=b % 7 + 1) for b in buckets}}})
    got = tbl.lookup("gemm.swiglu", GK.gemm_key(torch.float16, False, 4, 64, 64), m)
    best = min(buckets, key=lambda b: (abs(b - m), b))
    assert got.GROUP_M == best % 7 + 1


def test_the_table_is_used_then_falls_back_per_group_and_bucket():
    tbl = _table({"gemm.swiglu": {GROUP: {"64": _entry(BN=32, GROUP_M=3), "4096": _entry(BN=16, GROUP_M=5)}}})
    with CF.override("table", tbl):
        c = _sel()
        assert (c.BN, c.GROUP_M, c.source) == (32, 3, "table")
        assert _sel(rows=4 * 3000).GROUP_M == 5  # the nearest bucket
        assert _sel(n=128).source == "heuristic"  # another N: no group
        assert _sel(dtype=torch.float32).source == "heuristic"  # another precision
        assert _sel("mm").source == "heuristic"  # another kind
        with CF.override("gemm.swiglu", num_stages=2):  # an override still wins, on top of the table's config
            o = _sel()
            assert (o.GROUP_M, o.num_stages, o.source) == (3, 2, "override")
        with CF.override("table", None):
            assert _sel().source == "heuristic"
    assert _sel().source == "heuristic"  # the interpreter has no table of its own


def test_table_entries_clamp_like_the_heuristic():
    tbl = _table({"gemm.swiglu": {GROUP: {"64": _entry(BM=128, BN=128, BK=128)}}})
    with CF.override("table", tbl):
        c = _sel()
    assert (c.BM, c.BN, c.BK) == (64, 64, 64)  # rows per expert, N and K


def test_malformed_entries_warn_and_the_rest_is_used():
    bad = {"config": {"BM": 24, "BN": 16, "BK": 16}}
    tbl = _table({"gemm.swiglu": {GROUP: {"64": bad, "x": _entry(), "4096": _entry(GROUP_M=5)}},
                  "gemm.mm": {GROUP: {"64": {"nope": 1}}}})
    with CF.override("table", tbl), pytest.warns(CF.TableWarning, match="unusable entry") as rec:
        assert _sel(rows=4 * 64).GROUP_M == 5  # the only usable bucket, whatever the rows
        assert _sel("mm").source == "heuristic"
    assert len(rec) == 3  # BM=24, bucket "x", the entry without a config


@pytest.mark.parametrize("text, match", [
    ("{not json", "JSONDecodeError"),
    ("[1, 2]", "not a JSON object"),
    ('{"format": 99, "entries": {}}', "format 99"),
    ('{"format": 1, "entries": []}', "'entries' is not an object"),
])
def test_a_malformed_table_file_warns_and_the_heuristic_runs(tmp_path, monkeypatch, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.warns(CF.TableWarning, match=match):
        assert CF.load_table(path) is None
    monkeypatch.setenv("TRITONMOE_CONFIG_TABLE", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CF.TableWarning)
        assert _sel().source == "heuristic"
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(32, 16, generator=gen)
        offs = torch.tensor([0, 10, 10, 25, 32])
        w = torch.randn(4, 16, 24, generator=gen)
        torch.testing.assert_close(tritonmoe.grouped_gemm(x, offs, w, backend="triton"), ref.grouped_gemm(x, offs, w))


def test_environment_names_or_disables_the_table(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": 1, "entries": {"gemm.swiglu": {GROUP: {"64": _entry(GROUP_M=6)}}}}))
    monkeypatch.setenv("TRITONMOE_CONFIG_TABLE", str(path))
    assert _sel().GROUP_M == 6 and _sel().source == "table"
    monkeypatch.setenv("TRITONMOE_CONFIG_TABLE", "off")
    assert _sel().source == "heuristic"
    monkeypatch.setenv("TRITONMOE_CONFIG_TABLE", str(tmp_path / "missing.json"))
    assert CF.table_for(CPU) is None and _sel().source == "heuristic"


def test_the_device_table_is_found_by_device_name(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    CF._device_name_of.cache_clear()
    CF._device_table.cache_clear()
    try:
        dev = torch.device("cuda", 0)
        assert CF.device_name(dev) == "NVIDIA_H100_80GB_HBM3"
        monkeypatch.setattr(CF, "CONFIG_DIR", tmp_path)
        assert CF.table_path("NVIDIA_H100_80GB_HBM3") == tmp_path / "NVIDIA_H100_80GB_HBM3.json"
        assert CF.table_for(dev) is None  # no file for this device: heuristics
        (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"format": 1, "device": "x", "entries": {}}))
        CF._cached_str.cache_clear()
        CF._device_table.cache_clear()
        tbl = CF.table_for(dev)
        assert isinstance(tbl, CF.Table) and CF.table_for(dev) is tbl  # read once
    finally:
        CF._device_name_of.cache_clear()
        CF._cached_str.cache_clear()
        CF._device_table.cache_clear()
    assert CF.device_name(CPU) is None


def test_a_table_config_launches_without_the_stage_autotuner(monkeypatch):
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(("direct", kw.get("num_stages")))

    monkeypatch.setattr(C, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(C, "_tuner", lambda *a: _Tuned(calls))
    cfg = C.TileConfig(BM=16, BN=16, BK=16, num_stages=3)
    C.launch(Kernel(), (1,), dataclasses.replace(cfg, source="table"), ("N",), CPU, 2, False)
    C.launch(Kernel(), (1,), cfg, ("N",), CPU, 2, False)
    assert calls == [("direct", 3), ("tuned", None)]


class _Tuned:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append(("tuned", kw.get("num_stages")))


# ---------------------------------------------------------------------------------------------
# What ran
# ---------------------------------------------------------------------------------------------


def test_recording_says_which_config_ran_and_from_where():
    gen = torch.Generator().manual_seed(5)
    counts = [20, 0, 30, 14]
    offs = torch.tensor([0, 20, 20, 50, 64])
    x = torch.randn(64, 64, generator=gen).half()
    w1 = (torch.randn(4, 64, 128, generator=gen) / 8).half()
    w2 = (torch.randn(4, 64, 64, generator=gen) / 8).half()
    want = ref.grouped_ffn(x.double(), offs, w1.double(), w2.double())
    tbl = _table({"gemm.swiglu": {GROUP: {"16": _entry(BM=16, BN=32, BK=32, GROUP_M=1)}}})
    assert sum(counts) == 64
    with CF.override("table", tbl), CF.override("gemm.mm", num_stages=1, GROUP_M=3), CF.recording() as ran:
        y = tritonmoe.grouped_ffn(x, offs, w1, w2, backend="triton")
    torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3)
    rows = CF.summary(ran)
    by = {r["target"]: r for r in rows}
    assert by["gemm.swiglu"]["source"] == "table" and by["gemm.swiglu"]["config"]["BN"] == 32
    assert by["gemm.mm"]["source"] == "override" and by["gemm.mm"]["config"]["GROUP_M"] == 3
    assert by["gemm.swiglu"]["key"] == {"dtype": "fp16", "E": 4, "N": 64, "K": 64, "M": 16.0}
    json.dumps(rows)  # JSON-ready
    with CF.recording() as ran2:
        tritonmoe.route(torch.randn(8, 16, generator=gen), 2, backend="triton")
    assert [(r.target, r.source) for r in ran2] == [("route", "heuristic")]
    assert len(ran2) == 1 and CF.summary(ran2 + ran2) == CF.summary(ran2)  # duplicates collapse


def test_targets_can_be_named_before_their_kernels_are_imported():
    """A fresh interpreter that imports only the config module can override any target."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from tritonmoe.kernels import config\n"
            "assert 'tritonmoe.kernels.permute' not in sys.modules\n"
            "with config.override('ffn.preact', 'recompute'), config.override('permute.metadata', fused=False):\n"
            "    from tritonmoe.kernels import _gemm_config as C, permute as kp\n"
            "    import torch\n"
            "    assert C.ffn_preact_mode() == 'recompute'\n"
            "    assert not kp.metadata_config(8, 4, torch.device('cpu')).fused\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
