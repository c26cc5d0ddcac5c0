"""SE-MoE's embedding partition in data parallelism (PAPERS.md 2.7) on 2 and 4 gloo ranks:
forward equal to the replicated lookup, shard gradients equal to the all-reduced replicated
gradient's rows (duplicates, padding_idx, empty ranks, one owner, any id shape, with and
without deduplication), counted collectives, measured memory, typed errors on every rank, and
DCP checkpoints across data-parallel sizes. Per-rank bodies in tests/_embedding_cases.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from tritonmoe.parallel import shard_range

from _dist import run_group, values_or_fail
import _embedding_cases as ec


@pytest.fixture(scope="module", params=[2, 4])
def emb(request):
    P = request.param
    results, _ = run_group(P, ec.table, deadline_s=400, pg_timeout_s=30)
    return P, values_or_fail(results)


@pytest.mark.dist
def test_embedding_table_has_no_failures(emb):
    _, vals = emb
    failures = [f"rank {r}: {f}" for r, v in enumerate(vals) for f in v["failures"]]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.dist
def test_collective_counts(emb):
    """Forward: one split-size exchange + 2 data all-to-alls; backward: 1; no all-reduce."""
    _, vals = emb
    for v in vals:
        for label, c in v["info"]["counts"]:
            assert c == {"fwd_a2a": 3, "fwd_a2a_data": 2, "bwd_a2a": 1, "all_reduce": 0, "other": 0}, (label, c)


@pytest.mark.dist
def test_memory_is_one_nth(emb):
    P, vals = emb
    total = sum(v["info"]["bytes_part"] for v in vals)
    for v in vals:
        info = v["info"]
        assert info["bytes_full"] == 1001 * 8 * 8 * 3
        # every shard at most 1/N of the table + 1 row (ceil(V/N) rows); the last, ragged one smaller
        assert info["bytes_part"] <= info["bytes_full"] / P + info["row_bytes"], (info["bytes_part"], info["bytes_full"])
    assert total == vals[0]["info"]["bytes_full"]  # the shards hold the table once, no more
    assert all(v["info"]["bytes_part"] >= vals[0]["info"]["bytes_full"] / P - P * vals[0]["info"]["row_bytes"] for v in vals[:-1])
    rows = [r for v in vals for r in v["info"]["local_rows"]]
    assert rows == list(range(1001))


@pytest.mark.dist
@pytest.mark.parametrize("key,err,word", [
    ("oob", "IndexError", "ranks [1]"), ("negative", "IndexError", "ranks [0]"), ("float_ids", "TypeError", "bad ids"),
    ("table_mismatch", "ValueError", "num_embeddings"), ("dim_mismatch", "ValueError", "embedding_dim"),
])
def test_bad_input_raises_on_every_rank(emb, key, err, word):
    _, vals = emb
    got = [v["info"][key] for v in vals]
    assert all(g[0] == err and word in g[1] for g in got), got
    assert all(g[2] < 10 for g in got), "a rank waited for the timeout"


@pytest.mark.dist
def test_bad_ids_move_no_data(emb):
    _, vals = emb
    assert all(v["info"]["bad_id_data_a2a"] == 0 for v in vals)


@pytest.mark.dist
@pytest.mark.parametrize("key,err", [("bad_padding", "IndexError"), ("bad_size", "ValueError")])
def test_local_bad_arguments(emb, key, err):
    _, vals = emb
    assert all(v["info"][key][0] == err for v in vals)


@pytest.mark.dist
@pytest.mark.parametrize("save_p,load_p", [(4, 2), (2, 4)])
def test_dcp_across_data_parallel_sizes(save_p, load_p):
    ckdir = ec.new_ckdir()
    saved = values_or_fail(run_group(save_p, ec.save_case, ckdir, deadline_s=200, pg_timeout_s=30)[0])
    loaded = values_or_fail(run_group(load_p, ec.load_case, ckdir, deadline_s=200, pg_timeout_s=30)[0])
    want = saved[0]
    for v in loaded:
        assert torch.equal(v["weight"], want["weight"])
        a, b = v["rows"]
        assert torch.equal(v["exp_avg_local"], want["exp_avg"][a:b])
        assert torch.equal(v["exp_avg_sq_local"], want["exp_avg_sq"][a:b])
        assert v["full_load_ok"]


@given(st.integers(1, 500), st.integers(1, 16))
def test_shard_ranges_tile_the_table(V, N):
    spans = [shard_range(V, N, r) for r in range(N)]
    assert spans[0][0] == 0 and spans[-1][1] == V
    assert all(a <= b for a, b in spans) and all(b1 == a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    per = -(-V // N)
    assert all(b - a <= per for a, b in spans)  # at most ceil(V/N): 1/N of the table, +1 row
    assert [len(c) for c in torch.arange(V).chunk(N)] == [b - a for a, b in spans if b > a]  # torch.chunk's layout


@pytest.mark.dist
def test_with_data_parallel_and_moe_layers():
    """An MoE model fed by a partitioned embedding under data_parallel (Lina + fused buckets):
    one SGD step equals the single process on the global batch; no all-reduce touches the table."""
    vals = values_or_fail(run_group(4, ec.dp_case, deadline_s=300, pg_timeout_s=60)[0])
    failures = [f"rank {r}: {f}" for r, v in enumerate(vals) for f in v["failures"]]
    assert not failures, "\n".join(failures)
    assert all(v["touched"] == 0 and v["reduces"] > 0 for v in vals)
    # Lina: no gradient micro-op started while an all-to-all (the layers' or the table's) was in flight
    assert all(v["scheduler_set"] and v["priority"]["a2a"] > 0 for v in vals)
