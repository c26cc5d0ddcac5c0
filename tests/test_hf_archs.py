"""Every transformers MoE architecture of tritonmoe.hf_archs.ARCHITECTURES (the registry docs/hf.md's
table is generated from), as a tiny random-weight model built from its config class (no downloads):

* "swap": hf.apply converts every MoE block (recognised by structure) and the patched model equals
  the original: fp64 and fp32 logits, a training step (loss, aux loss, router logits, every
  parameter's gradient), 8 greedily generated tokens; hf.restore gives back the original weights
  exactly.
* "refused": hf.apply raises HFConversionError naming what blocks the swap and the registry path
  (or why that does not work either), and leaves the model as it was.
* the experts-registry path (hf.use_experts_implementation) gives the original logits, or raises
  where the model's experts do not go through transformers' registry (Llama 4, DBRX).

Tolerance as tests/test_hf.py: both sides compute routing weights in fp32, so fp64 results agree to
fp32 rounding of the weights, not bitwise."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritonmoe import hf  # noqa: E402
from tritonmoe.hf_archs import ARCHITECTURES, architecture_table, build  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
BY_NAME = {c.name: c for c in ARCHITECTURES}
SWAP = [c.name for c in ARCHITECTURES if c.expect == "swap"]
REFUSED = [c.name for c in ARCHITECTURES if c.expect == "refused"]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers()
                                                        if "correction_bias" in n]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _model(name: str, dtype=torch.float64):
    cfg, model_cls = build(BY_NAME[name])
    torch.manual_seed(0)
    model = model_cls(cfg).to(dtype).eval()
    _randomize(model, 4)
    return cfg, model


def _ids(cfg, n=6):
    return torch.randint(2, cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(5))


def _hf_grads(original: torch.nn.Module, patched: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The patched model's gradients under the original model's parameter names."""
    out = {}
    blocks = {n: m for n, m in patched.named_modules() if isinstance(m, hf.HFMoEBlock)}
    for n, p in patched.named_parameters():
        if not any(n.startswith(f"{b}.") for b in blocks):
            out[n] = p.grad
    for b, m in blocks.items():
        g = {n: p.grad for n, p in m.moe.named_parameters()}
        for n, t in hf.tensors_to_hf(g, original.get_submodule(b)).items():
            out[f"{b}.{n}"] = t
    return out


@pytest.mark.parametrize("name", SWAP)
def test_swap_equals_the_original(name):
    cfg, model = _model(name)
    ids = _ids(cfg)
    patched = copy.deepcopy(model)
    names = hf.apply(patched)
    assert names and all(isinstance(patched.get_submodule(n), hf.HFMoEBlock) for n in names)
    assert not hf.moe_blocks(patched)
    with hf.eager_experts(model), torch.no_grad():  # fp64: transformers' grouped_mm does not take it
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, **TOL)
        gen_want = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        gen_got = patched.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(gen_got, gen_want)
    # a training step: loss, aux loss, router logits, every gradient
    outs = []
    with hf.eager_experts(model):
        for m in (model, patched):
            m.train()
            out = m(ids, labels=ids, output_router_logits=True)
            (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
            outs.append(out)
    want, got = outs
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    if want.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss.double(), want.aux_loss.double(), **TOL)
    if getattr(want, "router_logits", None) is not None:
        assert len(got.router_logits) == len(want.router_logits) > 0
        for a, b in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(a.double(), b.double(), **TOL)
    grads = _hf_grads(model, patched)
    want_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(want_grads) <= set(grads), set(want_grads) - set(grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n].to(g.dtype), g, **TOL, msg=lambda m: f"{name} {n}: {m}")
    # restore: the original blocks come back with the original weights, exactly
    restored = hf.restore(patched)
    assert sorted(restored) == sorted(names)
    theirs = patched.state_dict()
    for n, t in model.state_dict().items():
        if n.endswith("e_score_correction_bias"):  # tritonmoe's selection bias is fp32 by contract
            t = t.float().to(t.dtype)
        assert torch.equal(theirs[n], t), n
    # fp32: a second conversion of the cast model
    model32 = copy.deepcopy(model).float().eval()
    patched32 = copy.deepcopy(model32)
    hf.apply(patched32)
    with torch.no_grad():
        torch.testing.assert_close(patched32(ids).logits, model32(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", REFUSED)
def test_refusal_names_the_feature_and_the_alternative(name):
    case = BY_NAME[name]
    cfg, model = _model(name, torch.float32)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(hf.HFConversionError) as info:
        hf.apply(model)
    msg = str(info.value)
    assert "nothing was replaced" in msg
    if case.registry:
        assert "tritonmoe.hf.use_experts_implementation(model)" in msg
    else:
        assert "registry path does not work either" in msg and "use_experts_implementation" in msg
    assert {"phimoe": "SparseMixer", "llama4_text": "does not return top-k"}[name] in msg
    assert not any(isinstance(m, hf.HFMoEBlock) for m in model.modules())
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize("name", [c.name for c in ARCHITECTURES])
def test_experts_registry_path(name):
    """use_experts_implementation: the model keeps its routing and its experts run tritonmoe's
    moe_ffn (same logits), or it raises (nothing changed) where the setting would do nothing."""
    case = BY_NAME[name]
    cfg, model = _model(name)
    ids = _ids(cfg)
    with hf.eager_experts(model), torch.no_grad():
        want = model(ids).logits
    if not case.registry:
        with pytest.raises(hf.HFConversionError, match="does not dispatch through transformers' experts registry"):
            hf.use_experts_implementation(model)
        assert all(getattr(c, "_experts_implementation", None) != "tritonmoe" for c in hf._configs(model))
        return
    calls = []
    orig = hf._experts_forward

    def counting(self, *a):
        calls.append(type(self).__name__)
        return orig(self, *a)

    hf.register_experts_implementation("tritonmoe_counted")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("tritonmoe_counted", counting)
    try:
        names = hf.use_experts_implementation(model, "tritonmoe_counted")
        ALL_EXPERTS_FUNCTIONS.register("tritonmoe_counted", counting)  # use_ registers the plain function again
        with torch.no_grad():
            got = model(ids).logits
    finally:
        for c in hf._configs(model):
            c._experts_implementation = "eager"
    assert names and len(calls) == len(names)  # every experts module ran tritonmoe's function once
    torch.testing.assert_close(got, want, **TOL)


def test_docs_table_is_the_registry():
    page = (Path(__file__).resolve().parents[1] / "docs" / "hf.md").read_text()
    m = re.search(r"<!-- architectures:begin -->\n(.*?)<!-- architectures:end -->", page, re.S)
    assert m, "docs/hf.md lacks the architecture table markers"
    assert m.group(1) == architecture_table(), "regenerate docs/hf.md's table: python -m tritonmoe.hf_archs"


def test_registry_covers_the_named_architectures():
    named = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "deepseek_v2", "granitemoe",
             "granitemoeshared", "phimoe", "llama4_text", "glm4_moe", "qwen3_next", "ernie4_5_moe", "dots1",
             "flex_olmo", "dbrx", "jamba", "minimax", "hunyuan_v1_moe"}
    assert named <= set(BY_NAME)


# ---------------------------------------------------------------------------------------------
# Every other MoE block of the installed transformers, block by block
# ---------------------------------------------------------------------------------------------

_TINY = dict(hidden_size=16, intermediate_size=20, moe_intermediate_size=8, num_experts=8, n_routed_experts=8,
             num_local_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2, moe_k=2,
             shared_expert_intermediate_size=12, n_shared_experts=1, num_shared_experts=1,
             moe_shared_expert_intermediate_size=12, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             vocab_size=64, num_hidden_layers=2, shared_intermediate_size=12, n_group=2, topk_group=1,
             max_position_embeddings=64)


def _installed_blocks():
    """(model type, block class, tiny config) of every module class of transformers whose
    __init__ builds `self.experts`, with a config built from the tiny values its config class
    takes; blocks this generic recipe cannot build are left out (the registry covers the named ones)."""
    import importlib
    import inspect
    import os

    root = os.path.dirname(transformers.__file__)
    found = []
    for d in sorted(os.listdir(f"{root}/models")):
        path = f"{root}/models/{d}/modeling_{d}.py"
        if d in BY_NAME or not os.path.exists(path) or "self.experts = " not in open(path).read():
            continue
        try:
            mod = importlib.import_module(f"transformers.models.{d}.modeling_{d}")
        except Exception:  # noqa: BLE001 - a model needing an optional package
            continue
        configs = [c for n, c in vars(mod).items() if n.endswith("Config") and inspect.isclass(c)]
        for cls in vars(mod).values():
            if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module) and cls.__module__ == mod.__name__
                    and "__init__" in cls.__dict__ and "self.experts = " in inspect.getsource(cls.__init__)):
                continue
            for ccls in configs:
                try:
                    keys = inspect.signature(ccls.__init__).parameters
                    cfg = ccls(**{k: v for k, v in _TINY.items() if k in keys})
                    kw = {"layer_idx": 1} if "layer_idx" in inspect.signature(cls.__init__).parameters else {}
                    block = cls(cfg, **kw).double()
                except Exception:  # noqa: BLE001 - not this config class / not buildable generically
                    continue
                found.append((d, block))
                break
    return found


def test_every_installed_moe_block_swaps_exactly_or_is_refused():
    swapped, refused, failures = [], [], []
    for d, block in _installed_blocks():
        _randomize(block, 1)
        try:
            layer = hf.from_hf(block, ignore_router_jitter=True)
        except hf.HFConversionError as e:
            refused.append(d)
            assert type(block).__name__ in str(e), str(e)  # the refusal names the block
            continue
        except Exception as e:  # noqa: BLE001 - collected: any other exception is a failure
            failures.append(f"{d}.{type(block).__name__}: {type(e).__name__}: {e}")
            continue
        x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with hf.eager_experts(block):
            want = block(xa)
        want = want[0] if isinstance(want, tuple) else want
        want.square().sum().backward()
        got = layer(xb)
        got.square().sum().backward()
        try:
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(xb.grad, xa.grad, **TOL)
        except AssertionError as e:
            failures.append(f"{d}.{type(block).__name__}: {e}")
        swapped.append(d)
    assert not failures, failures
    assert len(swapped) >= 10 and len(refused) >= 3, (swapped, refused)
