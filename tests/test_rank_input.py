"""One rank's bad input ends every rank (issue 35 item 2), and replicated layers that disagree are
refused at construction (item 1): one spawned gloo group of 2 ranks running every scenario of
tests/_rank_input_cases.py under a short process-group timeout. The same faults on 2 AND 4 ranks
are rows of the fault table (bench/faults.py ``REFUSED_ROWS``, checked by tests/test_faults.py
in its shared groups: no spawn of their own).

* expert parallel (pipeline degree 2), Parm (S2 and the baseline, MP = 2) and the replicated
  inference layer: a rank passing an input of the wrong dtype / shape / padding mask (two ranks
  at once with different errors) makes every rank raise the same
  :class:`~tritonmoe.comm.errors.RankInputError` (a ``TypeError`` / ``ValueError``) naming the
  failing ranks and the first one's message, within the timeout + 5 s; the group stays usable
  and the next forward's result is unchanged;
* the status word rides in the counts exchange: a healthy expert-parallel forward makes exactly
  the all-to-alls it made before (1 counts exchange + 2 per micro-op), counted by a wrapper around
  ``torch.distributed``, and no other collective;
* ``ReplicatedMoELayer`` over layers built from different seeds or with different activations
  raises a ``ValueError`` on every rank naming the differing fields and each rank's value.
"""

from __future__ import annotations

import pytest

from _dist import run_group, values_or_fail
import _rank_input_cases

pytestmark = [pytest.mark.dist]

PG_TIMEOUT_S = 5.0


def _same_on_every_rank(outs, key):
    got = [o[key] for o in outs]
    assert all(g["error"] == got[0]["error"] and g.get("message") == got[0].get("message") for g in got), (key, got)
    assert all(g["seconds"] <= PG_TIMEOUT_S + 5 for g in got), (key, got)
    return got[0]


@pytest.mark.parametrize("P", [2])
def test_one_ranks_bad_input_ends_every_rank(P):
    results, wall = run_group(P, _rank_input_cases.run, deadline_s=150, pg_timeout_s=PG_TIMEOUT_S)
    outs = values_or_fail(results)
    last = P - 1
    # the status word adds no collective to the healthy forward (degree 2: counts + 2 x (dispatch, combine))
    assert all(o["healthy_counts"] == {"all_to_all_single": 5} for o in outs), [o["healthy_counts"] for o in outs]
    expected = {
        "ep dtype": ("TypeError", (last,), "x is torch.float32 but the layer's parameters are torch.float64"),
        "ep shape": ("ValueError", (0,), "x has shape (6, 9); the last dimension must be d_model=8"),
        "ep two ranks": ("TypeError", (0, last), "x is torch.float32"),
        "ep padding_mask": ("TypeError", (1,), "padding_mask must be a bool tensor"),
        "parm s2 dtype": ("TypeError", (1,), "x is torch.float32"),
        "parm baseline dtype": ("TypeError", (1,), "x is torch.float32"),
        "replicated dtype": ("TypeError", (last,), "x is torch.float32"),
    }
    for key, (base, failing, text) in expected.items():
        o = _same_on_every_rank(outs, key)
        assert o["rank_input"] and base in o["bases"] and o["failing"] == failing, (key, o)
        assert o["message"].startswith(text) and f"rank {failing[0]} of the group refused its input" in o["message"]
    assert f"rank {last}: ValueError: x has shape (6, 3)" in outs[0]["ep two ranks"]["message"]
    for after in ("ep after", "parm s2 after", "parm baseline after", "replicated after"):
        assert all(o[after] for o in outs), after  # the group is still usable, the result unchanged

    seeds = _same_on_every_rank(outs, "replicated seeds differ")
    assert seeds["error"] == "ValueError" and not seeds["rank_input"]
    for name in ("weights:w1", "weights:w2", "weights:router.weight"):
        assert name in seeds["message"], seeds
    assert "rank 0=float64[" in seeds["message"] and "rank 1=float64[" in seeds["message"]
    act = _same_on_every_rank(outs, "replicated activation differs")
    assert act["error"] == "ValueError" and "activation: rank 0='gelu', rank 1='relu'" in act["message"], act
    assert "weights:" not in act["message"]  # same seed: only the config differs
    assert all(o["replicated same"]["error"] is None for o in outs)
