"""llama.cpp's LoRA GGUF files (convert_lora_to_gguf.py's layout, q/k lora_b permuted for llama.cpp's
rotary order) give the same greedy tokens as the PEFT folder they were written from, float32; a GGUF
that is not a LoRA adapter, or an adapter of another base model, is refused saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagellm import LLM, LoRARequest, SamplingParams
from tests.helpers import assert_all_blocks_free, random_prompts
from tests.lora.adapters import ATTN, MLP, build_adapter, peft_to_gguf

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama-gqa-rope"]  # (grouped KV heads: q and k permuted over different head counts)


@pytest.fixture(scope="module")
def peft(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(base, tmp_path_factory.mktemp("peft") / "all", ATTN + MLP, r=8, alpha=16, seed=3)


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_gguf_adapter_matches_its_peft_folder(base, peft, tmp_path):
    gguf_file = peft_to_gguf(base, peft, tmp_path / "adapter.gguf")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([5, 23, 40], vocab, seed=11)
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=8, max_loras=2)
    from_peft, from_gguf = LoRARequest("peft", 1, str(peft)), LoRARequest("gguf", 2, str(gguf_file))
    n = len(prompts)
    got = run(llm, prompts * 3, [from_peft] * n + [from_gguf] * n + [None] * n)
    assert got[n : 2 * n] == got[:n]
    assert got[:n] != got[2 * n :], "the adapter should change the greedy tokens"
    assert_all_blocks_free(llm)


def test_gguf_adapter_on_a_gguf_model_file(base, peft, tmp_path):
    from tests.model.gguf_writer import write_gguf

    model_file = write_gguf(base, tmp_path / "model.gguf", qtype="Q8_0")  # (linear layers kept in blocks)
    gguf_file = peft_to_gguf(base, peft, tmp_path / "adapter.gguf")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([7, 30], vocab, seed=5)
    llm = LLM(str(model_file), enable_lora=True, dtype="float32", max_lora_rank=8, max_loras=2)
    n = len(prompts)
    got = run(llm, prompts * 3, [LoRARequest("peft", 1, str(peft))] * n + [LoRARequest("gguf", 2, str(gguf_file))] * n
              + [None] * n)
    assert got[n : 2 * n] == got[:n]
    assert got[:n] != got[2 * n :]


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_gguf_adapter_tensor_types_read_as_their_floats(base, peft, tmp_path, qtype):
    from safetensors.torch import load_file

    from pagellm.lora.adapter_files import read_adapter
    from pagellm.lora.gguf_adapter import read_gguf_adapter_tensors

    cfg = read_adapter(peft_to_gguf(base, peft, tmp_path / f"{qtype}.gguf", qtype=qtype), max_rank=8)
    assert (cfg.rank, cfg.scaling) == (8, 2.0)
    config = json.loads((base / "config.json").read_text())
    got = read_gguf_adapter_tensors(cfg, config["hidden_size"] // config["num_attention_heads"], "test")
    want = {k[k.index("layers."):]: v for k, v in load_file(str(peft / "adapter_model.safetensors")).items()}
    assert sorted(got) == sorted(want)
    for key, tensor in got.items():
        torch.testing.assert_close(tensor, want[key], atol=0.02, rtol=0.02)


def test_non_adapter_gguf_and_other_base_are_refused(base, peft, checkpoints, tmp_path):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    model_file = peft_to_gguf(base, peft, tmp_path / "model.gguf", general_type="model")
    with pytest.raises(ValueError, match="not a LoRA adapter GGUF file .general.type 'model'"):
        llm.generate("hi", sp, lora_request=LoRARequest("model", 1, str(model_file)))
    other_arch = peft_to_gguf(base, peft, tmp_path / "qwen2.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="an adapter of a 'qwen2' model, but the model is a 'llama'"):
        llm.generate("hi", sp, lora_request=LoRARequest("qwen2", 2, str(other_arch)))
    other = checkpoints["llama-hd64"]  # (another hidden size)
    other_peft = build_adapter(other, tmp_path / "other", MLP, r=4, alpha=8)
    other_shape = peft_to_gguf(other, other_peft, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="an adapter of another base model"):
        llm.generate("hi", sp, lora_request=LoRARequest("other", 3, str(other_shape)))
    assert_all_blocks_free(llm)
