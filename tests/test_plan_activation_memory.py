"""The activation rows of tritonmoe.plan.memory_budget against bytes measured on CPU.

Tiny transformers decoders built from the presets' configs (Mixtral: grouped-query attention;
Qwen3-MoE: QK norms; DeepSeek-V3: MLA, a dense first layer and a shared expert; Qwen2-MoE: a
gated shared expert; GPT-OSS: attention sinks, eager attention only), their MoE blocks
swapped for tritonmoe's by ``hf.apply``, one training step on CPU:

* the whole model in fp32, the bytes glibc's allocator holds between forward and backward
  (``mallinfo2``, a warm second pass, the model's output held as a training loop holds it)
  against the three activation rows (attention + dense, MoE, logits + loss) on one rank, within
  10%, with ``sdpa`` (transformers' default) and ``eager`` attention;
* how the bytes change with the sequence length at a fixed token count (eager keeps the
  [heads, s, s] probabilities: the attention row must move as the measurement does);
* in bf16, the part outside the MoE blocks, measured as the storages autograd saves (a
  ``saved_tensors_hooks`` count, not the code under test) plus the logits the output holds,
  against the attention and logits rows: tritonmoe's MoE layer computes its bf16 experts in fp32
  on CPU (the Triton interpreter's bf16 is unusable), which is not what it holds on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from _alloc import allocated_bytes
from tritonmoe.plan.memory_budget import TrainingSetup, memory_per_gpu
from tritonmoe.plan.models import HF_PRESET_CONFIGS, get_model

transformers = pytest.importorskip("transformers")

ARCHS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen2-57b-a14b", "gpt-oss-20b")
ROWS = ("activations: attention + dense MLPs", "activations: MoE layers", "activations: logits + loss")


def _build(name: str):
    """The preset's config at d_model 128 (4 heads of 32, 8 experts of width 128, top-2, a 512
    vocabulary, two layers), MoE blocks swapped to tritonmoe. DeepSeek's MLA keeps its q/k head
    (nope 16 + rope 16) as wide as its v head (32): with unequal widths torch's CPU sdpa falls
    back to the math kernel, which keeps the [s, s] probabilities (a GPU's memory-efficient
    kernel does not)."""
    from test_plan_models import _shrink

    from tritonmoe import hf

    c = _shrink(HF_PRESET_CONFIGS[name][1], experts=8)
    c.update(num_experts_per_tok=2, hidden_size=128, num_attention_heads=4, vocab_size=512,
             max_position_embeddings=1024, use_cache=False)
    if "head_dim" in c:
        c["head_dim"] = 32
    for k, v in (("intermediate_size", 256), ("moe_intermediate_size", 128), ("shared_expert_intermediate_size", 128)):
        if k in c:
            c[k] = v
    if "kv_lora_rank" in c:
        c.update(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, q_lora_rank=64,
                 n_group=1, topk_group=1, first_k_dense_replace=1, num_hidden_layers=2)
    mt = c.pop("model_type")
    hc = transformers.AutoConfig.for_model(mt, **c)
    hc._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hc).float()
    swapped = hf.apply(model)
    assert swapped
    return hc, model, swapped


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: one thread is as fast and does not spin on a shared machine
    built = {name: _build(name) for name in ARCHS}
    # allocated_bytes() collects garbage before it reads the allocator: with the test session's
    # objects frozen out of the collector, a collection scans only what the passes create
    # (0.5 s -> milliseconds with transformers loaded)
    gc.collect()
    gc.freeze()
    try:
        yield built
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def _estimate(hc, B, S, attn, dtype=torch.float32):
    est = memory_per_gpu(get_model(hc), world_size=1, ep_size=1, tokens_per_gpu=B * S, seq_len=S,
                         setup=TrainingSetup(param_dtype=dtype, master_weights=False), memory_strategy=None,
                         attn_implementation=attn)
    return {r: est.row(r).bytes for r in ROWS}


def _held(model, ids):
    """Bytes the allocator holds between forward and backward (the output kept, as a training
    loop keeps it), on a warm second pass."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    del out
    model.zero_grad(set_to_none=False)  # the gradients' storages exist before the measured pass
    before = allocated_bytes()
    out = model(input_ids=ids, labels=ids)
    held = allocated_bytes() - before
    out.loss.backward()
    del out
    return held


#: (architecture, attention, (batch, seq_len) points of the same token count)
CASES = [("mixtral-8x7b", "sdpa", ((1, 256), (4, 64))),
         ("qwen3-30b-a3b", "sdpa", ((1, 256), (4, 64))),
         ("deepseek-v3", "sdpa", ((1, 256), (4, 64))),
         ("qwen3-30b-a3b", "eager", ((1, 256), (4, 64))),
         ("deepseek-v3", "eager", ((1, 256), (4, 64))),
         ("qwen2-57b-a14b", "sdpa", ((1, 256), (4, 64))),  # the shared expert's sigmoid gate
         ("gpt-oss-20b", "eager", ((1, 256), (4, 64)))]  # attention sinks, clamped SwiGLU; no sdpa in transformers


@pytest.mark.parametrize("name,attn,points", CASES, ids=[f"{n}-{a}" for n, a, _ in CASES])
def test_activations_within_10_percent_of_the_allocator(models, name, attn, points):
    if allocated_bytes() is None:
        pytest.skip("no glibc mallinfo2 on this platform")
    hc, model, _ = models[name]
    default = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        got = []
        for B, S in points:
            gen = torch.Generator().manual_seed(B * S)
            measured = _held(model, torch.randint(0, hc.vocab_size, (B, S), generator=gen))
            rows = _estimate(hc, B, S, attn)
            total = sum(rows.values())
            assert abs(measured - total) <= 0.10 * measured, (name, attn, B, S, measured, rows)
            got.append((measured, rows))
    finally:
        model.set_attn_implementation(default)
    # the same tokens in longer sequences: the attention row moves as the measured bytes move
    # (eager: by the [heads, s, s] probabilities; sdpa: by cos / sin only)
    (m_long, r_long), (m_short, r_short) = got
    d_measured = m_long - m_short
    d_est = r_long[ROWS[0]] - r_short[ROWS[0]]
    if attn == "eager":
        assert d_measured > 0.10 * m_short and abs(d_est - d_measured) <= 0.10 * d_measured, (d_est, d_measured)
    else:
        assert abs(d_measured) <= 0.02 * m_short and abs(d_est) <= 0.02 * m_short, (d_est, d_measured)


def _saved_outside_moe(model, swapped, ids) -> int:
    """Bytes of the distinct storages autograd saves outside the swapped MoE blocks (their input,
    saved by the router, counts outside: it is the post-attention norm's output), plus the logits
    the output holds; parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moe_inputs, inside, seen = set(), [0], {}
    mods = [model.get_submodule(n) for n in swapped]

    def pre(mod, args):
        moe_inputs.add(args[0].untyped_storage().data_ptr())
        inside[0] += 1

    def post(mod, args, out):
        inside[0] -= 1

    handles = [h for m in mods for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]

    def pack(t):
        s = t.untyped_storage()
        p = s.data_ptr()
        if p not in params and p not in seen:
            seen[p] = (s.nbytes(), bool(inside[0]) and p not in moe_inputs)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits.untyped_storage()
    total = sum(nb for p, (nb, in_moe) in seen.items() if not in_moe and p not in moe_inputs or
                p in moe_inputs)
    if logits.data_ptr() not in seen:
        total += logits.nbytes()
    return total


SAVED_CASES = [(n, dt, "sdpa") for n in ARCHS[:3] for dt in (torch.float32, torch.bfloat16)] + [("gpt-oss-20b", torch.bfloat16, "eager"),
    ("qwen3-30b-a3b", torch.bfloat16, "eager"), ("deepseek-v3", torch.float32, "eager")]


@pytest.mark.parametrize("name,dtype,attn", SAVED_CASES, ids=[f"{n}-{str(d)[6:]}-{a}" for n, d, a in SAVED_CASES])
def test_attention_and_logits_rows_against_the_saved_storages(models, name, dtype, attn):
    """The part outside the MoE blocks alone (so the MoE row cannot hide an error of the
    attention row), fp32 and bf16."""
    hc, model, swapped = models[name]
    default = model.config._attn_implementation
    model.to(dtype)
    model.set_attn_implementation(attn)
    try:
        B, S = 2, 128
        ids = torch.randint(0, hc.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
        measured = _saved_outside_moe(model, swapped, ids)
    finally:
        model.float()
        model.set_attn_implementation(default)
    rows = _estimate(hc, B, S, attn, dtype)
    est = rows[ROWS[0]] + rows[ROWS[2]]
    assert abs(measured - est) <= 0.10 * measured, (name, measured, rows)


def test_attn_implementation_is_checked_and_eager_grows_with_seq_len():
    kw = dict(world_size=16, ep_size=8, tokens_per_gpu=4096)
    with pytest.raises(ValueError, match="attn_implementation='eagr'.*did you mean 'eager'.*use one of sdpa, eager"):
        memory_per_gpu("qwen3-30b-a3b", seq_len=4096, attn_implementation="eagr", **kw)
    row = "activations: attention + dense MLPs"
    sdpa = [memory_per_gpu("qwen3-30b-a3b", seq_len=s, **kw).row(row).bytes for s in (1024, 4096)]
    eager = [memory_per_gpu("qwen3-30b-a3b", seq_len=s, attn_implementation="eager", **kw).row(row).bytes
             for s in (1024, 4096)]
    m = get_model("qwen3-30b-a3b")
    # eager: 48 layers x 4096 tokens x 32 heads x 3072 more keys x (4 B fp32 probabilities + their bf16 copy)
    assert eager[1] - eager[0] == 48 * 4096 * 32 * 3072 * 6 + (sdpa[1] - sdpa[0])
    assert 0 < sdpa[1] - sdpa[0] == 2 * 3072 * m.head_dim * 2  # cos and sin only


if __name__ == "__main__":  # the measured-vs-estimate table: python tests/test_plan_activation_memory.py
    import sys
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    print(f"{'model':<15}{'attn':<7}{'B x S':>10}{'measured':>12}{'estimate':>12}{'error':>8}   attention / MoE / logits rows")
    for name in ARCHS:
        hc, model, swapped = _build(name)
        for attn in ("sdpa", "eager") if name != "gpt-oss-20b" else ("eager",):
            model.set_attn_implementation(attn)
            for B, S in ((1, 256), (4, 64), (1, 1024), (4, 256)):
                held = _held(model, torch.randint(0, hc.vocab_size, (B, S)))
                rows = _estimate(hc, B, S, attn)
                est = sum(rows.values())
                print(f"{name:<15}{attn:<7}{f'{B} x {S}':>10}{held:>12,}{est:>12,}{(est - held) / held:>+8.1%}   "
                      + " / ".join(f"{v:,}" for v in rows.values()))
