"""Per-rank bodies of the partitioned-embedding tests (tests/test_embedding.py; spawned gloo
groups of tests/_dist.py).

Reference: every rank builds the same full ``nn.Embedding`` from one seed; the partitioned
module keeps its shard (``from_embedding``). Forward must equal the replicated lookup bitwise;
each shard's gradient must equal those rows of the all-reduce-summed replicated gradient
(bitwise with integer-valued upstream gradients, whose sums are exact; to fp64 rounding with
random ones). Collectives are counted by tests/_fused_cases.Counter, memory is measured from
the storages the parameter and the optimizer hold.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe.parallel import PartitionedEmbedding, full_state_dict, load_optimizer_state_dict, optimizer_state_dict

from _fused_cases import Counter

F64 = torch.float64
H = 5


def _ids_cases(rank: int, P: int, V: int) -> list[tuple[str, torch.Tensor, int | None]]:
    g = torch.Generator().manual_seed(40 + rank)
    last = V - 1
    return [
        ("ragged", torch.randint(0, V, (rank + 1, 3), generator=g), None),
        ("duplicates within and across ranks", torch.tensor([1, 1, 1, 2, 1, 0, 0]) % V, None),
        ("padding_idx", torch.tensor([[2, 2, 0], [1, 2, last]]) % V, 2 % V),
        ("rank with no tokens", torch.randint(0, V, (0,) if rank == P - 1 else (4, 2), generator=g), None),
        ("scalar and 3-d ids", torch.tensor(last) if rank == 0 else torch.randint(0, V, (2, 2, 2), generator=g), None),
        ("all ids owned by the last rank with rows", torch.full((3 + rank,), last), 0),
        ("every rank empty", torch.zeros(0, 2, dtype=torch.int64), None),
    ]


def _is_meta(e, P: int) -> bool:
    """A logged all-to-all of the split-size exchange: int64 [P, 2] (data moves are 1-D ids or
    [rows, H] floats)."""
    return e[4] == torch.int64 and e[5] == (P, 2)


def _grads(shape, rank: int, integer: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(90 + rank)
    if integer:
        return torch.randint(-50, 50, shape, generator=g).to(F64)
    return torch.randn(shape, generator=g, dtype=F64)


def exactness(rank: int, P: int, failures: list, info: dict) -> None:
    for V in (7, 3, 16):
        for name, ids, pad in _ids_cases(rank, P, V):
            for dedup in (False, True):
                for integer in (True, False):
                    label = f"V={V} {name} dedup={dedup} {'int' if integer else 'random'} grads"
                    torch.manual_seed(3)
                    full = nn.Embedding(V, H, padding_idx=pad, dtype=F64)
                    with torch.no_grad():
                        full.weight.add_(torch.arange(V, dtype=F64)[:, None])  # rows differ visibly
                    part = PartitionedEmbedding.from_embedding(full, dedup=dedup)
                    want = full(ids)
                    G = _grads(want.shape, rank, integer)
                    (want * G).sum().backward()
                    ref = full.weight.grad.clone()
                    dist.all_reduce(ref)
                    with Counter() as c:
                        out = part(ids)
                        fwd = list(c.log)
                        c.clear()
                        (out * G).sum().backward()
                        bwd = list(c.log)
                    if out.shape != want.shape or not torch.equal(out, want):
                        failures.append(f"{label}: forward differs from the replicated lookup")
                    got = part.weight.grad if part.weight.grad is not None else torch.zeros_like(part.weight)
                    rows = ref[part.row_start : part.row_end]
                    if integer and not torch.equal(got, rows):
                        failures.append(f"{label}: shard gradient not bitwise equal to the all-reduced rows")
                    if not integer and got.numel() and (got - rows).abs().max().item() > 1e-12:
                        failures.append(f"{label}: shard gradient differs from the all-reduced rows")
                    counts = {"fwd_a2a": sum(e[0] == "all_to_all_single" for e in fwd),
                              "fwd_a2a_data": sum(e[0] == "all_to_all_single" and not _is_meta(e, P) for e in fwd),
                              "bwd_a2a": sum(e[0] == "all_to_all_single" for e in bwd),
                              "all_reduce": sum(e[0] == "all_reduce" for e in fwd + bwd),
                              "other": sum(e[0] not in ("all_to_all_single", "all_reduce") for e in fwd + bwd)}
                    info.setdefault("counts", []).append((label, counts))


def _raises(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - inspected by the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "", "", time.monotonic() - t0


def bad_input(rank: int, P: int, failures: list, info: dict) -> None:
    torch.manual_seed(1)
    m = PartitionedEmbedding(10, H, dtype=F64)
    with Counter() as c:
        info["oob"] = _raises(lambda: m(torch.tensor([0, 10 if rank == 1 else 3])))
        info["negative"] = _raises(lambda: m(torch.tensor([-1 if rank == 0 else 3])))
        info["float_ids"] = _raises(lambda: m(torch.tensor([1.0]) if rank == P - 1 else torch.tensor([1])))
    info["bad_id_data_a2a"] = sum(1 for e in c.log if e[0] == "all_to_all_single" and not _is_meta(e, P))
    info["table_mismatch"] = _raises(lambda: PartitionedEmbedding(10 + (rank == 0), H))
    info["dim_mismatch"] = _raises(lambda: PartitionedEmbedding(10, H + (rank == P - 1)))
    info["bad_padding"] = _raises(lambda: PartitionedEmbedding(10, H, padding_idx=10))
    info["bad_size"] = _raises(lambda: PartitionedEmbedding(0, H))
    # the module still works after the errors (no collective was left half-done)
    out = m(torch.tensor([rank]))
    if out.shape != (1, H):
        failures.append("the module is broken after bad input")


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def memory_and_training(rank: int, P: int, failures: list, info: dict) -> None:
    V, Hm = 1001, 8
    torch.manual_seed(5)
    full = nn.Embedding(V, Hm, dtype=F64)
    part = PartitionedEmbedding.from_embedding(full)
    opt_full = torch.optim.Adam(full.parameters(), lr=0.1)
    opt_part = torch.optim.Adam(part.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, V, (13,), generator=g)
    full(ids).pow(2).sum().backward()
    for p in full.parameters():
        dist.all_reduce(p.grad)
    part(ids).pow(2).sum().backward()
    opt_full.step()
    opt_part.step()
    big = lambda opt, p: [p] + [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    info["bytes_part"] = _storage_bytes(big(opt_part, part.weight))
    info["bytes_full"] = _storage_bytes(big(opt_full, full.weight))
    info["row_bytes"] = Hm * 8 * 3  # a row of the parameter and of Adam's two moments
    if (part.weight - full.weight[part.row_start : part.row_end]).abs().max().item() > 1e-12:
        failures.append("Adam step on the shard differs from the replicated table's rows")
    fsd = full_state_dict(nn.ModuleDict({"emb": part}))
    if not torch.equal(fsd["emb.weight"], full.weight.detach()):
        failures.append("full_state_dict does not return the full table")
    if part.local_rows.tolist() != list(range(part.row_start, part.row_end)):
        failures.append("local_rows are not the shard's global row ids")
    info["local_rows"] = part.local_rows.tolist()


def table(rank: int, P: int) -> dict:
    failures: list[str] = []
    info: dict = {}
    exactness(rank, P, failures, info)
    bad_input(rank, P, failures, info)
    memory_and_training(rank, P, failures, info)
    return {"failures": failures, "info": info}


# ---------------------------------------------------------------------------------------------
# Checkpoints across data-parallel sizes (DCP)
# ---------------------------------------------------------------------------------------------

V_CK, H_CK = 23, 4


def _model_and_opt(seed: int = 11):
    torch.manual_seed(seed)
    m = nn.ModuleDict({"emb": PartitionedEmbedding(V_CK, H_CK, dtype=F64)})
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    return m, opt


def save_case(rank: int, P: int, ckdir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    m, opt = _model_and_opt()
    ids = torch.randint(0, V_CK, (9,), generator=torch.Generator().manual_seed(rank))
    m["emb"](ids).pow(2).sum().backward()
    opt.step()
    dcp.save({"model": m.state_dict(), "optim": optimizer_state_dict(m, opt)}, checkpoint_id=ckdir)
    full = full_state_dict(m)["emb.weight"]
    st = optimizer_state_dict(m, opt)["state"]["emb.weight"]
    return {"weight": full, "exp_avg": st["exp_avg"].full_tensor(), "exp_avg_sq": st["exp_avg_sq"].full_tensor()}


def load_case(rank: int, P: int, ckdir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    m, opt = _model_and_opt(seed=99)  # different initial values: everything must come from the checkpoint
    sd = {"model": m.state_dict(), "optim": optimizer_state_dict(m, opt)}
    dcp.load(sd, checkpoint_id=ckdir)
    m.load_state_dict(sd["model"])
    load_optimizer_state_dict(m, opt, sd["optim"])
    st = opt.state[m["emb"].weight]
    out = {"weight": full_state_dict(m)["emb.weight"], "rows": (m["emb"].row_start, m["emb"].row_end),
           "exp_avg_local": st["exp_avg"].clone(), "exp_avg_sq_local": st["exp_avg_sq"].clone()}
    # a full-tensor load into the shard works too
    m2, _ = _model_and_opt(seed=5)
    m2.load_state_dict({"emb.weight": out["weight"]})
    out["full_load_ok"] = torch.equal(m2["emb"].weight.detach(), out["weight"][m2["emb"].row_start : m2["emb"].row_end])
    return out


def new_ckdir() -> str:
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="tm_emb_ck_"), "ck")


# ---------------------------------------------------------------------------------------------
# With data_parallel: an MoE model whose input is a partitioned embedding
# ---------------------------------------------------------------------------------------------

V_DP = 19


class EmbNet(nn.Module):
    def __init__(self, mesh, part: bool) -> None:
        super().__init__()
        import _parallel_cases as pc

        torch.manual_seed(pc.SEED)
        self.net = pc.Net(mesh if part else None)
        torch.manual_seed(77)
        full = nn.Embedding(V_DP, pc.D_MODEL, dtype=F64)
        self.emb = PartitionedEmbedding.from_embedding(full, mesh.dense_group) if part else full

    def forward(self, ids):
        return self.net(self.emb(ids))


def dp_case(rank: int, P: int) -> dict:
    import _parallel_cases as pc
    from tritonmoe.parallel import MoEMesh, data_parallel

    failures: list[str] = []
    g = torch.Generator().manual_seed(8)
    ids = [torch.randint(0, V_DP, (pc.TOKENS,), generator=g) for _ in range(P)]
    ids[-1][:] = ids[0][0]  # duplicates across ranks
    tgt = [torch.randn(pc.TOKENS, pc.OUT, dtype=F64, generator=g) for _ in range(P)]
    mesh = MoEMesh.build(dp=2, ep=P // 2)
    ref = EmbNet(mesh, part=False)
    pc.loss_fn(ref(torch.cat(ids)), torch.cat(tgt)).backward()
    with torch.no_grad():
        want = {n: p - 0.1 * p.grad for n, p in ref.named_parameters()}
    model = EmbNet(mesh, part=True)
    ddp = data_parallel(model, mesh, comm="lina", chunk_bytes=256, fuse_bytes=4096)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Counter() as c, pc.Recorder() as rec:
        pc.loss_fn(ddp(ids[rank]), tgt[rank]).backward()
    opt.step()
    pri = pc.check_priority(failures, "lina with a partitioned embedding", rec.calls)
    ddp._tritonmoe_data_parallel.scheduler.close()
    emb = model.emb
    if (emb.weight - want["emb.weight"][emb.row_start : emb.row_end]).abs().max().item() > 1e-12:
        failures.append("the partitioned embedding's step differs from the single process's rows")
    pc.compare(failures, "net", model.net, {n[4:]: v for n, v in want.items() if n.startswith("net.")})
    # no all-reduce touched the embedding's gradient buffer
    ptr = emb.weight.grad.data_ptr()
    nbytes = emb.weight.grad.numel() * 8
    touched = [e for e in c.log if e[0] == "all_reduce" and ptr <= e[3] < ptr + nbytes]
    return {"failures": failures, "touched": len(touched), "reduces": sum(e[0] == "all_reduce" for e in c.log),
            "priority": pri, "scheduler_set": emb.comm_scheduler is not None}
