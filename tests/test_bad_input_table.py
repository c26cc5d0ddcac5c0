"""The bad-input table of docs/bad-input.md, generated from the cases below (issue 35).

Each case calls one public entry point with one bad input, asserts the typed error and an
excerpt of its message, and is one row of the page. ``test_docs_page_has_exactly_these_rows``
checks the page against the cases; regenerate it with

    python tests/test_bad_input_table.py --write
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # the regenerator imports nothing heavy before the interpreter switch
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import tritonmoe as tm
from tritonmoe.plan import CostModelError

PAGE = Path(__file__).resolve().parent.parent / "docs" / "bad-input.md"
BEGIN, END = "<!-- BEGIN GENERATED: tests/test_bad_input_table.py -->", "<!-- END GENERATED -->"


@dataclass(frozen=True)
class Case:
    entry: str  # the public entry point
    refuses: str  # what bad input
    call: Callable[[], object]
    error: type  # the exception type raised (exactly this type, or a subclass named here)
    excerpt: str  # a substring of the message


T, K, E, D, F = 4, 2, 4, 8, 6


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _ids():
    return torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32)


def _routing():
    return tm.route(_x(T, E), K, backend="torch")


def _info():
    return tm.permute(_x(T, D), _ids(), E, backend="torch")[1]


def _offsets():
    return torch.tensor([0, 2, 4, 6, 8])


def _layers(n):
    torch.manual_seed(0)
    return [tm.MoELayer(tm.MoEConfig(D, F, E, K)) for _ in range(n)]


def _bad_cost_model(tmp: Path):
    from tritonmoe.plan import CostModel
    p = tmp / "bad-cost-model.json"
    p.write_text("{not json")
    return CostModel.load(p)


def _plan_cli(argv):
    from tritonmoe.plan.__main__ import main
    return main(argv)


def _unknown_hf_model():
    from tritonmoe import hf
    return hf.apply(torch.nn.Linear(2, 2))


def _replicated_bad_layer():
    from tritonmoe.inference import ReplicatedMoELayer
    return ReplicatedMoELayer(torch.nn.Linear(2, 2))


def _ep_bad_mesh_and_group():
    return tm.MoELayer(tm.MoEConfig(D, F, E, K), mesh=object(), ep_group=object())


def _offload(n, k):
    from tritonmoe.inference import OffloadedExperts
    return OffloadedExperts(_layers(n), layer_slots=k)


def _double_backward_triton():
    x = _x(T, D).requires_grad_()
    w = _x(E, D, F).requires_grad_()
    y = tm.grouped_gemm(x, torch.tensor([0, 1, 2, 3, 4]), w, backend="triton")
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return torch.autograd.grad(gx.pow(2).sum(), w)


def cases(tmp: Path) -> list[Case]:
    return [
        Case("tm.route", "top_k above the expert count", lambda: tm.route(_x(T, E), E + 1), ValueError,
             "top_k=5 must be in [1, num_experts=4]"),
        Case("tm.route", "an unknown score_func", lambda: tm.route(_x(T, E), K, score_func="softmin"), ValueError,
             "score_func='softmin' is not supported"),
        Case("tm.route", "integer logits", lambda: tm.route(torch.zeros(T, E, dtype=torch.int64), K), TypeError,
             "logits has dtype torch.int64"),
        Case("tm.route", "a non-finite expert_bias (validation on)",
             lambda: tm.route(_x(T, E), K, expert_bias=torch.full((E,), float("nan"))), ValueError,
             "expert_bias[0]=nan is not finite"),
        Case("tm.permute", "an expert id outside [-1, E)",
             lambda: tm.permute(_x(T, D), _ids() + 1, E), IndexError, "topk_ids contains 4, outside [-1, num_experts=4)"),
        Case("tm.permute", "num_experts = 0", lambda: tm.permute(_x(T, D), _ids(), 0), ValueError, "num_experts=0 must be >= 1"),
        Case("tm.permute", "num_rows below max_permuted_rows",
             lambda: tm.permute(_x(T, D), _ids(), E, num_rows=1), ValueError,
             "num_rows=1 is below max_permuted_rows"),
        Case("tm.unpermute", "weights of another [T, k] shape",
             lambda: tm.unpermute(_x(8, D), _info(), _x(T, 1)), ValueError, "topk_weights has shape"),
        Case("tm.grouped_gemm", "decreasing expert_offsets",
             lambda: tm.grouped_gemm(_x(8, D), torch.tensor([0, 4, 2, 6, 8]), _x(E, D, F)), ValueError,
             "expert_offsets is not monotone"),
        Case("tm.grouped_gemm", "w of another inner size",
             lambda: tm.grouped_gemm(_x(8, D), _offsets(), _x(E, D + 1, F)), ValueError,
             "the inner dimensions must match"),
        Case("tm.grouped_ffn", "an unknown activation",
             lambda: tm.grouped_ffn(_x(8, D), _offsets(), _x(E, D, 2 * F), _x(E, F, D), "tanh"), ValueError,
             "activation='tanh' is not supported"),
        Case("tm.moe_ffn", "a routing that is not a Routing",
             lambda: tm.moe_ffn(_x(T, D), _ids(), _x(E, D, 2 * F), _x(E, F, D)), TypeError,
             "routing must be a tritonmoe.Routing"),
        Case("tm.moe_ffn", "a routing for other tokens",
             lambda: tm.moe_ffn(_x(T + 1, D), _routing(), _x(E, D, 2 * F), _x(E, F, D)), ValueError,
             "routing is for 4 tokens but x has 5"),
        Case("tm.load_balancing_loss", "logits of another shape than the routing",
             lambda: tm.load_balancing_loss(_x(T, E + 1), _routing()), ValueError, "pass the logits the routing"),
        Case("backward twice (grouped_gemm, backend triton)", "a second-order gradient through a kernel",
             _double_backward_triton, tm.NotTwiceDifferentiableError,
             "grouped_gemm (Triton) is not twice differentiable"),
        Case("tm.MoEConfig", "top_k above num_experts", lambda: tm.MoEConfig(D, F, E, E + 1), ValueError,
             "top_k=5 must be in [1, num_experts=4]"),
        Case("tm.MoEConfig", "a negative d_model", lambda: tm.MoEConfig(-1, F, E, K), ValueError,
             "d_model=-1 must be >= 1"),
        Case("tm.MoEConfig", "an unknown activation", lambda: tm.MoEConfig(D, F, E, K, activation="tanh"),
             ValueError, "activation='tanh' is not supported"),
        Case("tm.MoELayer (forward)", "x of another width", lambda: _layers(1)[0](_x(T, D + 1)), ValueError,
             "the last dimension must be d_model=8"),
        Case("tm.MoELayer (forward)", "a torch.vmap over the layer", lambda: torch.vmap(_layers(1)[0])(_x(2, T, D)),
             NotImplementedError, "MoELayer does not support torch.vmap"),
        Case("tm.MoELayer (expert-parallel construction)", "both mesh= and ep_group=", _ep_bad_mesh_and_group,
             ValueError, "pass mesh= or ep_group=, not both"),
        Case("tritonmoe.hf.apply", "a model with no MoE block", _unknown_hf_model, TypeError,
             "has no MoE block tritonmoe.hf reads"),
        Case("inference.OffloadedExperts", "one layer (no valid layer_slots)", lambda: _offload(1, 0), ValueError,
             "at least 2 layers"),
        Case("inference.OffloadedExperts", "layer_slots = N", lambda: _offload(2, 2), ValueError,
             "use 1 <= layer_slots < 2"),
        Case("inference.ReplicatedMoELayer", "a module that is not a MoELayer", _replicated_bad_layer, TypeError,
             "layer must be a tritonmoe.MoELayer"),
        Case("plan.CostModel.load", "a file that is not JSON", lambda: _bad_cost_model(tmp), CostModelError,
             "bad-cost-model.json is not JSON"),
        Case("python -m tritonmoe.plan", "an unknown subcommand", lambda: _plan_cli(["nonsense"]), SystemExit, "2"),
    ]


def _run(case: Case) -> BaseException:
    with pytest.raises(case.error) as ei:
        case.call()
    return ei.value


def _needs_interpreter(case: Case) -> bool:
    return "backend triton" in case.entry


def rows(tmp: Path) -> list[str]:
    out = ["| entry point | refuses | raises | message contains |", "|---|---|---|---|"]
    for c in cases(tmp):
        out.append(f"| `{c.entry}` | {c.refuses} | `{c.error.__name__}` | `{c.excerpt}` |")
    return out


CASE_IDS = [f"{c.entry}: {c.refuses}" for c in cases(Path("."))]


@pytest.mark.parametrize("index", range(len(CASE_IDS)), ids=CASE_IDS)
def test_case_raises_the_typed_error(index, tmp_path):
    from conftest import INTERPRETER_ON
    case = cases(tmp_path)[index]
    if _needs_interpreter(case) and not (INTERPRETER_ON or torch.cuda.is_available()):
        pytest.skip("the Triton backend needs the interpreter or a GPU")
    err = _run(case)
    assert type(err) is case.error or isinstance(err, case.error)
    assert case.excerpt in str(err.code if isinstance(err, SystemExit) else err), str(err)


def test_docs_page_has_exactly_these_rows():
    text = PAGE.read_text()
    assert BEGIN in text and END in text, f"{PAGE} lost its generated block; run python {__file__} --write"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    assert block == rows(Path(".")), f"docs/bad-input.md is stale: run python tests/test_bad_input_table.py --write"


def _write() -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    PAGE.write_text(head + BEGIN + "\n" + "\n".join(rows(Path("."))) + "\n" + END + tail)


if __name__ == "__main__":
    if "--write" in sys.argv:
        _write()
    elif "--show" in sys.argv:  # each case's actual message
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            for c in cases(Path(d)):
                try:
                    c.call()
                    print("NO ERROR", c.entry, c.refuses)
                except BaseException as e:  # noqa: BLE001
                    print(f"{c.entry} | {c.refuses} | {type(e).__name__}: {str(e)[:160]}")
