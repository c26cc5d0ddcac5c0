"""SE-MoE's fusion communication (PAPERS.md 2.3): fused all-gather, bucketed all-reduce, bucket
plans agreed across ranks, gradient buckets in training and with data_parallel, the scheduler's
fuse rule, and the planner's bucket size. Per-rank bodies in tests/_fused_cases.py; collectives
counted by a wrapper around torch.distributed there."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tritonmoe.comm import fuse_micro_ops, partition, plan_buckets
from tritonmoe.plan import Cluster, PRESETS
from tritonmoe.plan.fusion import bucket_timeline, choose_bucket_bytes

from _dist import run_group, values_or_fail
import _fused_cases as fc


@pytest.fixture(scope="module", params=[2, 4])
def fused(request):
    P = request.param
    results, _ = run_group(P, fc.fused_table, deadline_s=240, pg_timeout_s=30)
    return P, values_or_fail(results)


@pytest.mark.dist
def test_fused_table_has_no_failures(fused):
    P, vals = fused
    failures = [f"rank {r}: {f}" for r, v in enumerate(vals) for f in v["failures"]]
    assert not failures, "\n".join(failures)


@pytest.mark.dist
def test_one_all_gather_per_fused_call(fused):
    _, vals = fused
    for v in vals:
        info = v["info"]
        assert info["gather_calls"] == 1 and info["gather_other"] == 0
        assert info["gather_empty_calls"] == 0


@pytest.mark.dist
def test_one_all_reduce_per_greedy_bucket(fused):
    _, vals = fused
    for v in vals:
        info = v["info"]
        for cap, (calls, want, other) in info["reduce_counts"].items():
            assert calls == want, (cap, calls, want)
            assert other == 0, f"cap={cap}: {other} other collectives"
        assert info["reduce_counts"][1][1] == 8  # every non-empty tensor alone
        assert info["reduce_counts"][10**6][1] == 1  # everything in one bucket
        assert info["mixed"][0] == info["mixed"][1] == 3
        assert info["reduce_empty_calls"] == 0
        calls, plan_len, greedy = info["plan_calls"]
        assert calls == plan_len == greedy


@pytest.mark.dist
@pytest.mark.parametrize("key,err", [
    ("gather_mismatch", "BucketPlanMismatchError"), ("gather_junk", "BucketPlanMismatchError"),
    ("reduce_mismatch", "BucketPlanMismatchError"), ("plan_extra", "BucketPlanMismatchError"),
    ("plan_cap", "BucketPlanMismatchError"), ("gb_mismatch", "BucketPlanMismatchError"),
    ("gb_frozen", "BucketPlanMismatchError"), ("gb_divisor", "BucketPlanMismatchError"),
])
def test_mismatch_raises_same_error_on_every_rank(fused, key, err):
    _, vals = fused
    got = [v["info"][key] for v in vals]
    assert all(g[0] == err for g in got), got
    assert all(g[2] < 10 for g in got), "a rank waited for the timeout"
    # the verdict (everything before the per-rank detail in parentheses) is the same everywhere
    assert len({g[1].split(" (this rank")[0] for g in got}) == 1, got


@pytest.mark.dist
@pytest.mark.parametrize("key,err,word", [
    ("gather_dtypes", "TypeError", "dtypes"), ("reduce_bad_cap", "ValueError", "bucket_bytes=0"),
    ("reduce_bad_cap_type", "TypeError", "bucket_bytes"), ("reduce_not_list", "TypeError", "list or tuple"),
    ("plan_wrong_local", "ValueError", "do not match"),
])
def test_bad_input_typed_errors(fused, key, err, word):
    _, vals = fused
    for v in vals:
        name, msg, _ = v["info"][key]
        assert name == err and word in msg, (name, msg)


@pytest.mark.dist
def test_gradient_buckets_one_reduction_per_bucket(fused):
    _, vals = fused
    for v in vals:
        for label in ("ragged", "empty last rank"):
            calls, greedy, planned = v["info"][f"gb {label}"]
            assert calls == greedy == planned and greedy > 1


@pytest.mark.dist
def test_data_parallel_fuse_bytes():
    results, _ = run_group(4, fc.dp_fusion_table, deadline_s=300, pg_timeout_s=60)
    vals = values_or_fail(results)
    failures = [f"rank {r}: {f}" for r, v in enumerate(vals) for f in v["failures"]]
    assert not failures, "\n".join(failures)
    for v in vals:
        info = v["info"]
        fused = info["fifo chunk=None fuse=1000000"]
        plain = info["fifo chunk=None fuse=None"]
        assert fused["expert_reduces"] == fused["buckets"] == fused["greedy"] == 1
        assert plain["expert_reduces"] == plain["expert_params"] == 4
        lina_f, lina = info["lina chunk=1024 fuse=1000000"], info["lina chunk=1024 fuse=None"]
        assert lina_f["max_dense_bytes"] <= 1024 and lina["max_dense_bytes"] <= 1024
        assert lina_f["dense_reduces"] < lina["dense_reduces"]
        pri = info["lina chunk=1024 fuse=1000000 priority"]
        assert pri["a2a"] > 0 and pri["allreduce"] > 0


# ---------------------------------------------------------------------------------------------
# Packing invariants (no process group)
# ---------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 400), st.lists(st.integers(0, 1), min_size=30, max_size=30))
def test_plan_buckets_properties(nbytes, cap, key_bits):
    keys = key_bits[: len(nbytes)]
    buckets = plan_buckets(nbytes, cap, keys)
    flat = [i for b in buckets for i in b]
    assert flat == [i for i, n in enumerate(nbytes) if n > 0]  # order kept, every non-empty once
    assert buckets == fc.greedy(nbytes, cap, keys)
    for k, b in enumerate(buckets):
        size = sum(nbytes[i] for i in b)
        assert size <= cap or len(b) == 1  # only a tensor larger than a bucket overflows, alone
        assert len({keys[i] for i in b}) == 1
        if k + 1 < len(buckets):  # greedy: the next tensor did not fit (or changed key)
            nxt = buckets[k + 1][0]
            assert size + nbytes[nxt] > cap or keys[nxt] != keys[b[-1]]


@given(st.lists(st.integers(0, 60), max_size=20), st.sampled_from([1, 2, 4, 8]), st.integers(1, 200), st.integers(0, 3))
def test_fuse_micro_ops_properties(sizes, itemsize, chunk_elems, gap):
    chunk = chunk_elems * itemsize
    ranges, off = [], 0
    for n in sizes:
        ranges.append((off, n))
        off += n + gap
    spans = fuse_micro_ops(ranges, itemsize, chunk)
    assert all(b - a <= chunk_elems and a < b for a, b in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    covered = [0] * (off + 1)
    for a, b in spans:
        for e in range(a, b):
            covered[e] += 1
    for a, n in ranges:
        assert all(covered[e] == 1 for e in range(a, a + n))
    # never more micro-ops than Lina's partition, which cuts each gradient alone
    assert len(spans) <= len(partition(ranges, itemsize, chunk))
    # greedy: two consecutive spans could not have been one
    for (a1, _), (_, b2) in zip(spans, spans[1:]):
        assert b2 - a1 > chunk_elems


def test_fuse_micro_ops_fuses_small_and_partitions_large():
    # three 2-element gradients, then one of 25 elements; 8-byte items, 10-element chunks
    ranges = [(0, 2), (2, 2), (4, 2), (6, 25)]
    spans = fuse_micro_ops(ranges, 8, 80)
    assert spans == [(0, 6), (6, 15), (15, 24), (24, 31)]  # small ones fused; the large one cut in 3
    assert len(spans) == 4 and len(partition(ranges, 8, 80)) == 6


# ---------------------------------------------------------------------------------------------
# The planner's bucket size
# ---------------------------------------------------------------------------------------------


def test_choose_bucket_bytes_follows_the_fit():
    cm = PRESETS["se-moe"]().cost_model("float16")
    sizes = [4096] * 200 + [2**24] * 4  # many small gradients, a few large ones
    at_once = choose_bucket_bytes(sizes, cm, 8, backward_s=0.0)
    assert at_once.bucket_bytes == sum(sizes) and len(at_once.buckets) == 1  # all ready at once: alpha once
    assert "bucket_bytes=" in at_once.reason and "alpha" in at_once.reason
    spread = choose_bucket_bytes(sizes, cm, 8, backward_s=0.002)
    # every candidate's end is what the timeline gives; the choice is the earliest
    ready, acc = [], 0
    for n in sizes:
        acc += n
        ready.append(0.002 * acc / sum(sizes))
    for c, nb, end in spread.candidates:
        buckets, spans = bucket_timeline(sizes, ready, c, cm, 8)
        assert len(buckets) == nb and spans[-1][1] == pytest.approx(end)
    assert spread.end_s == min(e for _, _, e in spread.candidates)
    # fusing beats one reduction per tensor when alpha dominates the small ones
    per_tensor = next(e for c, nb, e in spread.candidates if nb == len(sizes))
    assert spread.end_s < per_tensor


def test_choose_bucket_bytes_rejects_bad_input():
    cm = PRESETS["se-moe"]().cost_model("float16")
    with pytest.raises(ValueError, match="nbytes"):
        choose_bucket_bytes([], cm, 8)
    with pytest.raises(ValueError, match="backward_s"):
        choose_bucket_bytes([10], cm, 8, backward_s=-1)
    with pytest.raises(ValueError, match="ready_s"):
        choose_bucket_bytes([10, 20], cm, 8, ready_s=[0.0])


def test_plan_buckets_rejects_bad_capacity():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets([1], 0)
    with pytest.raises(TypeError, match="bucket_bytes"):
        plan_buckets([1], 2.0)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([-1], 4)


def test_scheduler_fuse_flag():
    from tritonmoe.comm import CommScheduler

    with pytest.raises(TypeError, match="fuse must be a bool"):
        CommScheduler.lina(64, fuse="yes")
    s = CommScheduler.lina(64, fuse=True)
    assert s.fuse and "fuse=True" in repr(s)
    s.close()


def test_gradient_sync_ops_fuse_like_the_scheduler():
    """The simulator's view of the gradient lane (issue_gradient_sync) issues the scheduler's
    fused micro-ops: the same sizes as fuse_micro_ops over the gradients laid end to end."""
    from tritonmoe.comm import VirtualTensor
    from tritonmoe.comm.priority import issue_gradient_sync

    class Ex:
        def __init__(self):
            self.sizes = []

        def all_reduce(self, x, **kw):
            self.sizes.append(x.shape[0])
            return len(self.sizes)

    import torch

    grads = [VirtualTensor((n,), torch.float32) for n in (3, 2, 40, 1, 1)]
    ex = Ex()
    issue_gradient_sync(ex, grads, chunk_bytes=64, fuse=True)
    ranges, off = [], 0
    for g in grads:
        ranges.append((off, g.shape[0]))
        off += g.shape[0]
    assert ex.sizes == [b - a for a, b in fuse_micro_ops(ranges, 4, 64)]
    ex2 = Ex()
    issue_gradient_sync(ex2, grads, chunk_bytes=64)
    assert len(ex.sizes) < len(ex2.sizes) and sum(ex.sizes) == sum(ex2.sizes)


@pytest.mark.dist
def test_a_peer_that_leaves_raises_schedule_error():
    results, _ = run_group(3, fc.peer_dies_case, deadline_s=120, pg_timeout_s=8)
    for r in results[:2]:
        assert r.status == "ok", r.value
        for name, (kind, elapsed) in r.value.items():
            assert kind == "ScheduleError", (r.rank, name, kind)
            assert elapsed < 30, (name, elapsed)


def test_cli_buckets(capsys):
    from tritonmoe.plan.__main__ import main

    assert main(["buckets", "--cluster", "se-moe", "--group", "8", "--sizes", "4096,4096,4096,1048576",
                 "--backward-ms", "0.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bucket_bytes=") and "one reduction per tensor (4)" in out
    assert main(["buckets", "--cluster", "se-moe", "--group", "8", "--sizes", "0"]) == 2
    assert "nbytes" in capsys.readouterr().err
