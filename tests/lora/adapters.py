"""Random PEFT LoRA adapters of the tiny test checkpoints, and transformers' merged model as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# The choices of the grammar tests (`merged_choice_greedy`).
COLOURS = ["red", "green", "blue", "black", "white", "brown", "pink", "gray"]


def merged_choice_greedy(base: Path, adapter: Path | None, prompt: list[int], choices: list[str]) -> str:
    """transformers' greedy answer on ``base`` with PEFT's merge of ``adapter`` under a choice grammar: at
    each step the best token that keeps the text a prefix of a choice (the end of text once it is one)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    special = set(tok.all_special_ids)
    pieces = {i: tok.decode([i]) for i in range(len(tok)) if i not in special}
    text, ids = "", list(prompt)
    with torch.no_grad():
        while True:
            logits = model(torch.tensor([ids])).logits[0, -1]
            allowed = [i for i, p in pieces.items() if p and any(c.startswith(text + p) for c in choices)]
            allowed += [tok.eos_token_id] if text in choices else []
            best = max(allowed, key=lambda i: float(logits[i]))
            if best == tok.eos_token_id:
                return text
            text, ids = text + pieces[best], ids + [best]


# PEFT's module names -> llama.cpp's tensor names.
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's permutation of Llama's q/k rows (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def peft_to_gguf(base: Path, adapter: Path, out: Path, arch: str = "llama", general_type: str = "adapter",
                 qtype: str = "F32") -> Path:
    """The PEFT ``adapter`` written as llama.cpp's convert_lora_to_gguf.py writes it: ``blk.{i}.{name}.weight
    .lora_a`` [r, in] / ``.lora_b`` [out, r] in ``qtype`` (its --outtype), q/k lora_b permuted for llama.cpp's
    rotary layout."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter, quantize
    from safetensors.torch import load_file

    config = json.loads((base / "config.json").read_text())
    lparams = json.loads((adapter / "adapter_config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"],
             "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
    writer = GGUFWriter(str(out), arch)
    writer.add_type(general_type)
    if general_type == "adapter":
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(lparams["lora_alpha"]))
    for key, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        parts = key.split(".")
        i = parts.index("layers")
        layer, module, which = int(parts[i + 1]), parts[i + 3], parts[i + 4][-1].lower()
        w = tensor.float()
        if which == "b" and module in heads and arch == "llama":
            w = _rope_permute(w, heads[module])
        kind = GGMLQuantizationType[qtype]
        if kind == GGMLQuantizationType.Q8_0 and w.shape[-1] % 32:
            kind = GGMLQuantizationType.F16  # (rows shorter than a block: the converter's fallback too)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{which}",
                          quantize(w.contiguous().numpy(), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def assert_choice_answers_are_merged_models(llm: Any, base: Path, loras: list[Any], prompts: list[list[int]]) -> None:
    """Each prompt under a choice of ``COLOURS``, once per adapter of ``loras`` (None: the base model),
    all in one batch: ``llm``'s answers are PEFT's merged models' (``merged_choice_greedy``), and the
    adapters change at least one answer."""
    from pagellm import SamplingParams, StructuredOutputsParams

    expected = [merged_choice_greedy(base, None if lora is None else Path(lora.lora_path), p, COLOURS)
                for p in prompts for lora in loras]
    assert len(set(expected)) > 1, expected  # (the adapters change the answer)
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=COLOURS))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in loras], params,
                        lora_request=loras * len(prompts), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == expected
