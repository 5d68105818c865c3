"""GGUF files: the embedded SmolLM2-135M-Instruct against transformers on the same file, and clear
errors for what pagellm cannot load."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model import gguf_file
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path
from pagellm.model.quant_linear import ACTIVATIONS_ENV
from tests.helpers import assert_all_blocks_free

SMOLLM2 = embedded_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None,
                                   reason=f"the embedded model wheel is missing: {DEFAULT_MODEL_INSTALL}")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a small engine",
]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "She sells sea shells by the sea shore.",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}],
]


@pytest.fixture(scope="module", autouse=True)
def float_inputs():
    """transformers is the oracle here, to the token: the quantized layers multiply float inputs (int8
    inputs, the default, round them as llama.cpp does: tests/model/test_quant_linear.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACTIVATIONS_ENV, "float")
        yield


@lru_cache(maxsize=1)
def hf_gguf(path: Path):
    """transformers' own loading of the file (its GGUF support, float32), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    assert SMOLLM2 is not None
    return LLM(str(SMOLLM2), dtype="float32", kv_cache_memory="1GiB")


@pytest.mark.slow
@needs_smollm2
def test_greedy_continuations_match_transformers_on_the_same_file(smollm2):
    assert SMOLLM2 is not None
    model, tokenizer = hf_gguf(SMOLLM2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = smollm2.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, prompt
    assert_all_blocks_free(smollm2)


@needs_smollm2
@pytest.mark.slow
def test_chat_template_renders_the_same_token_ids(smollm2):
    assert SMOLLM2 is not None
    _, tokenizer = hf_gguf(SMOLLM2)
    for messages in CONVERSATIONS:
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert smollm2.llm_engine.apply_chat_template(messages) == list(want)
        # The model's default system message is there when the conversation has none.
        assert "<|im_start|>system" in tokenizer.decode(want)


@pytest.mark.slow
@needs_smollm2
def test_log_likelihoods_agree_with_transformers(smollm2):
    """lm-eval's loglikelihood: the sum of each sentence token's log-probability."""
    assert SMOLLM2 is not None
    model, tokenizer = hf_gguf(SMOLLM2)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for sentence, out in zip(SENTENCES, smollm2.generate(SENTENCES, params, use_tqdm=False)):
        ids = out.prompt_token_ids
        ours = sum(out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item()
        assert abs(ours - lp) < 1e-3, sentence


@pytest.mark.slow
@needs_smollm2
def test_chat_stops_at_the_end_of_turn_and_skips_special_tokens(smollm2):
    out = smollm2.chat(CONVERSATIONS[0], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    assert smollm2.llm_engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.llm_engine.eos_token_ids


@needs_smollm2
@pytest.mark.slow
def test_the_default_max_model_len_is_the_file_context_length(smollm2):
    assert smollm2.llm_engine.max_model_len == 8192  # llama.context_length


# ------------------------------------------------------------------ errors


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    """A minimal GGUF file: the architecture tag and raw tensors (data, GGML type or None for float32)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for name, (data, raw_type) in tensors.items():
        if raw_type is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "rwkv6", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ValueError, match=r"GGUF architecture 'rwkv6' is not supported.*gemma2.*llama.*qwen3"):
        LLM(str(path))


def test_an_unsupported_tensor_type_is_named_with_the_supported_ones(tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_NL]
    raw = np.zeros((4, 64 // block * size), np.uint8)  # 4 rows of 64 IQ4_NL values
    path = write_gguf(tmp_path / "m.gguf", "llama", {"blk.0.attn_q.weight": (raw, GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight \(IQ4_NL\).*supported: F32, F16, BF16, Q8_0"):
        LLM(str(path))


def test_a_file_that_is_not_gguf_says_what_to_pass(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file: pass a .gguf file or the Hugging Face folder"):
        LLM(str(path))
    assert not gguf_file.is_gguf_file(path)


# ------------------------------------------------------------------ tiny GGUF files of each family

GGUF_FAMILIES = {
    "llama": dict(num_key_value_heads=2, initializer_range=0.2),
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.2),
    # head_dim 128: transformers' GGUF reader leaves Qwen3's head_dim at its default.
    "qwen3": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128, initializer_range=0.2),
    "phi3": dict(num_key_value_heads=2, initializer_range=0.2),
    # The shapes transformers' GGUF reader assumes for Gemma (head_dim 256; its other defaults).
    "gemma2": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=8,
                   initializer_range=0.2),
    "gemma3_text": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=8,
                        initializer_range=0.2),
}


@pytest.mark.parametrize(("family", "qtype"), [("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen2", "Q5_1"),
                                               ("qwen3", "F16"), ("qwen3", "Q4_1"), ("phi3", "Q8_0"),
                                               ("gemma2", "Q8_0"), ("gemma3_text", "Q4_0")])
def test_tiny_gguf_files_match_transformers_on_the_same_file(tmp_path, family, qtype):
    from pagellm.model.default_model import build_checkpoint
    from tests.model.gguf_writer import write_gguf

    folder = build_checkpoint(tmp_path / family, family, seed=5, **GGUF_FAMILIES[family])
    path = write_gguf(folder, tmp_path / f"{family}-{qtype}.gguf", qtype)
    model, _ = hf_gguf(path)
    prompts = [[5, 9, 200, 17], list(range(30, 70))]
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
    assert_all_blocks_free(llm)


def test_a_mixture_of_experts_gguf_file_gives_the_tokens_of_its_checkpoint(tmp_path):
    """Qwen3-MoE experts stacked per layer, as llama.cpp stores them, in float32: pagellm gives
    transformers' tokens on the original checkpoint (transformers' own GGUF reader leaves the expert
    count and sizes at their defaults, so it cannot read this file's small shape)."""
    from pagellm.model.default_model import build_checkpoint
    from tests.helpers import hf_greedy
    from tests.model.gguf_writer import write_gguf

    folder = build_checkpoint(tmp_path / "moe", "qwen3_moe", seed=5, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              norm_topk_prob=True,  # llama.cpp always renormalizes the top-k weights
                              initializer_range=0.2)
    path = write_gguf(folder, tmp_path / "moe.gguf", "F32")
    prompts = [[5, 9, 200, 17], list(range(30, 70))]
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 16) for p in prompts]
    assert_all_blocks_free(llm)


def test_end_of_turn_ids_stop_and_files_beside_the_gguf_take_precedence(tmp_path):
    """Every end-of-generation id of the file ends a sequence (eos and eot, as in Llama 3's files); a
    tokenizer.json and a generation_config.json beside the file are used instead of its metadata."""
    import json
    import shutil

    from pagellm.model.default_model import build_checkpoint
    from tests.model.gguf_writer import write_gguf

    folder = build_checkpoint(tmp_path / "llama", "llama", seed=5, initializer_range=0.2)
    alone = tmp_path / "alone"
    alone.mkdir()
    path = write_gguf(folder, alone / "m.gguf", "Q8_0", eot_token_id=3)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32)
    engine = llm.llm_engine
    assert engine.eos_token_ids == {2, 3}  # </s> and the end-of-turn id
    assert engine.model_files.tokenizer_folder != alone
    first = engine.tokenizer.encode("The capital of France is")
    # A tokenizer and a generation config beside the file: they win.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, alone / name)
    (alone / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.5}))
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32)
    engine = llm.llm_engine
    assert engine.model_files.tokenizer_folder == alone
    assert engine.eos_token_ids == {2, 7}
    assert engine.default_sampling_fields == {"temperature": 0.5}
    assert engine.tokenizer.encode("The capital of France is") == first
