"""Backend failures surface as the library's typed errors, and created process groups keep
their parent's timeout (tritonmoe.comm.errors).

* every collective call in the library runs inside ``backend_errors`` (checked on the source);
  every group is created through ``new_group`` / ``mesh_backend_override`` (ditto);
* every kind of group the library creates has its parent's timeout (spawned 4-rank gloo group,
  timeouts read from the groups' backends), not torch's 30-minute default;
* lanes that cannot start raise ``LaneStartError``; bad executor devices are refused.

The end-to-end consequence (a dead or absent peer on a created group ends in a typed exception
within the parent's timeout + 5 s on every rank) is measured by the fault table's rows
"Parm groups: ...", "hierarchical: ..." and "exit in a hierarchical all-to-all"
(tests/test_faults.py).
"""

from __future__ import annotations

import ast
import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tritonmoe.comm import executor as executor_mod
from tritonmoe.comm.errors import LaneStartError, ScheduleError, backend_errors
from tritonmoe.comm.executor import COPY, RealExecutor

from _dist import run_group, values_or_fail
import _group_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "comm").glob("*.py")) + sorted((ROOT / "tritonmoe").rglob("*.py"))
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "broadcast",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "gather", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}
#: Functions whose collectives are wrapped by their caller: the real executor's backend calls
#: (``_start_*``, called by the ``run`` closures that ``_collective`` issues inside its
#: ``backend_errors``, waited for in ``_host_wait``), the Parm cost model's timed lambdas (timed
#: inside one), and the profiler (a measurement tool of its own).
WRAPPED_BY_CALLER = {
    *(("comm/executor.py", f"_start_{op}") for op in ("all_to_all", "all_gather", "all_reduce", "reduce_scatter",
                                                      "send_recv")),
    ("tritonmoe/policy/parm_schedule.py", "<lambda>"), ("tritonmoe/policy/parm_schedule.py", "fn"),
}
UNCHECKED_FILES = {"tritonmoe/plan/profile.py"}


def _parents(tree):
    parent = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    return parent


def _bare_collectives(path: pathlib.Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    if rel in UNCHECKED_FILES:
        return []
    tree = ast.parse(path.read_text())
    parent = _parents(tree)
    bad = []
    for node in ast.walk(tree):
        direct = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                  and node.func.attr in COLLECTIVES)
        # tritonmoe.comm.compat's collectives, called by their bare names, are collectives too
        compat = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("all_gather_single", "reduce_scatter_single"))
        if not (direct or compat) or rel == "comm/compat.py":
            continue
        p, wrapped, fn = parent.get(node), False, None
        while p is not None:
            if isinstance(p, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", None) == "backend_errors"
                for i in p.items
            ):
                wrapped = True
                break
            if fn is None and isinstance(p, (ast.FunctionDef, ast.Lambda)):
                fn = p.name if isinstance(p, ast.FunctionDef) else "<lambda>"
            p = parent.get(p)
        if not wrapped and (rel, fn) not in WRAPPED_BY_CALLER:
            name = node.func.attr if direct else node.func.id
            bad.append(f"{rel}:{node.lineno} {'dist.' if direct else ''}{name} (in {fn})")
    return bad


def test_no_bare_collectives():
    bad = [b for path in SOURCES for b in _bare_collectives(path)]
    assert not bad, "collectives outside backend_errors (a backend failure would be a bare RuntimeError):\n" + "\n".join(bad)


def test_no_group_without_the_parents_timeout():
    """``dist.new_group`` and DeviceMesh group creation without a timeout give a group the
    30-minute default: only comm/errors.py calls new_group; every mesh the library builds
    (``init_device_mesh``, ``DeviceMesh(...)``, ``_flatten``) passes ``backend_override``."""
    bad = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            owner = getattr(f.value, "id", None) if isinstance(f, ast.Attribute) else None
            if name in ("new_group", "new_subgroups", "new_subgroups_by_enumeration") and owner == "dist" \
                    and rel != "comm/errors.py":
                bad.append(f"{rel}:{node.lineno} dist.{name}")
            if name in ("init_device_mesh", "_flatten", "DeviceMesh") and not any(
                k.arg in ("backend_override", None) for k in node.keywords
            ):
                bad.append(f"{rel}:{node.lineno} {name} without backend_override")
    assert not bad, "\n".join(bad)


def test_backend_errors_types_backend_failures_only():
    with pytest.raises(ScheduleError, match=r"the step failed on rank -1: RuntimeError: Connection closed by peer"):
        with backend_errors("the step"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    try:
        with backend_errors("the step"):
            raise RuntimeError("boom")
    except ScheduleError as e:
        assert isinstance(e.__cause__, RuntimeError) and str(e.__cause__) == "boom"
    for exc in (ValueError("bad splits"), TypeError("bad dtype"), ScheduleError("already typed"),
                NotImplementedError("no")):
        with pytest.raises(type(exc)) as info:
            with backend_errors("the step"):
                raise exc
        assert info.value is exc


def test_copy_lane_that_cannot_start_raises_lane_start_error(monkeypatch):
    dead = ThreadPoolExecutor(max_workers=1)
    dead.shutdown()
    monkeypatch.setattr(executor_mod, "_copy_worker", lambda: dead)
    ex = RealExecutor(torch.device("cpu"))
    with pytest.raises(LaneStartError, match="copy lane's worker thread.*cannot schedule new futures"):
        ex.copy(torch.ones(3), to="host", kind="offload")
    with pytest.raises(LaneStartError):
        ex.compute(lambda t: t + 1, torch.ones(3), work=executor_mod.Work(), kind="offload", lane=COPY)
    assert issubclass(LaneStartError, ScheduleError)


@pytest.mark.parametrize("device, exc, match", [
    ("cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}", ValueError, "cuda"),
    ("meta", ValueError, "runs on 'cpu'"),
    ("not a device", ValueError, "not a device string"),
    (3, TypeError, "torch.device or a device string, got int"),
])
def test_real_executor_refuses_bad_devices(device, exc, match):
    with pytest.raises(exc, match=match):
        RealExecutor(device)


def test_real_executor_accepts_a_device_string():
    assert RealExecutor("cpu").device == torch.device("cpu")


@pytest.mark.dist
@pytest.mark.slow
def test_created_groups_inherit_the_parents_timeout():
    (results, _) = run_group(4, _group_cases.created_group_timeouts, deadline_s=240, pg_timeout_s=7.0)
    values = values_or_fail(results)
    for r, v in enumerate(values):
        lane, queued = v.pop("lane"), v.pop("lane queued")
        assert lane.startswith("LaneStartError") and "can't start new thread" in lane, (r, lane)
        assert queued == 0, (r, queued)
        want = {k: (3.0 if "3 s" in k else 7.0) for k in v}
        assert v == want, f"rank {r}: group timeouts {v} (30 min = 1800 s is torch's default)"


def test_a_collective_that_fails_when_issued_raises_schedule_error(monkeypatch):
    """A backend failure raised when the executor issues a collective (not only when it is
    waited for) is the same typed error, naming the operation."""

    def closed(*args, **kwargs):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

    monkeypatch.setattr(executor_mod.dist, "all_reduce", closed)
    ex = RealExecutor(torch.device("cpu"))
    with pytest.raises(ScheduleError, match=r"all_reduce 'allreduce' of micro-op 3 \(fwd\) failed on rank -1: "
                                            r"RuntimeError: .*Connection closed by peer") as info:
        ex.all_reduce(torch.ones(4), kind="allreduce", micro_op=3)
    assert isinstance(info.value.__cause__, RuntimeError)
