"""A Hugging Face model with its MoE blocks swapped for tritonmoe layers: the same logits, a
fine-tuning step with transformers' own loss (router logits and auxiliary loss included), then
generate, and restore the transformers blocks with the trained weights.

    python examples/hf_swap.py                      # a tiny random Mixtral (no download)
    python examples/hf_swap.py --model mistralai/Mixtral-8x7B-v0.1   # a real one (GPU, download)

Needs transformers >= 5 (`pip install 'tritonmoe[hf]'`; `make setup` installs it).
docs/huggingface.md lists the supported architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3, GPT-OSS).
"""

from __future__ import annotations

import argparse

import torch

from tritonmoe import hf
from _common import pick_device


def load(name: str | None, device):
    import transformers

    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).to(device)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).to(device)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model id (default: a tiny random Mixtral)")
    args = p.parse_args(argv)
    device = pick_device()
    model = load(args.model, device)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), device=device)

    with torch.no_grad():
        before = model(ids).logits
    swapped = hf.apply(model)                          # every supported block, in place
    with torch.no_grad():
        after = model(ids).logits
    diff = (after - before).abs().max().item()
    print(f"swapped {len(swapped)} blocks ({', '.join(swapped)}); max |logits difference| = {diff:.2e}")

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(ids, labels=ids, output_router_logits=True)   # transformers' loss, with its aux loss
    out.loss.backward()
    opt.step()
    print(f"fine-tune step: loss {out.loss.item():.4f} (aux {out.aux_loss.item():.4f}), "
          f"{len(out.router_logits)} router logits")

    model.eval()
    gen = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    print(f"generated: {gen[0].tolist()}")
    restored = hf.restore(model)                       # transformers blocks again, trained weights
    print(f"restored {len(restored)} blocks")
    return diff


if __name__ == "__main__":
    main()
