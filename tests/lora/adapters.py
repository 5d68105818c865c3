"""Random PEFT LoRA adapters of the tiny test checkpoints, and transformers' merged model as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, out: Path, targets: list[str], r: int = 8, alpha: int = 16, seed: int = 0,
                  use_rslora: bool = False) -> Path:
    """A PEFT adapter of ``base`` saved in ``out``, lora_B random (PEFT starts it at zero) so that it
    changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=use_rslora, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens of each prompt on ``base`` with PEFT's ``merge_and_unload`` of ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            t = torch.tensor([ids])
            got = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(got[0, len(ids):].tolist())
    return outs
