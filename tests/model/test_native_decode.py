"""Decode-only steps in one native call give the bits the layers' own forward gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.model.default_model import build_checkpoint
from tests.helpers import assert_all_blocks_free, random_prompts

needs_native = pytest.mark.skipif(not native.linear_supported(),
                                  reason="needs the native bfloat16 linear kernel (AVX512-BF16 without AMX)")


def _count_native_steps(monkeypatch) -> list[int]:
    """Patches native.decode_layers to record the rows of every step it runs."""
    calls = []
    real = native.decode_layers

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "decode_layers", counted)
    return calls


def _assert_native_equals_layers(path: Path, lengths: list[int], monkeypatch, block_size: int = 16) -> None:
    """Greedy tokens and logprobs with the native decode steps, then with the layers' forward: the same
    bits (and the native steps ran, with every sequence in one call)."""
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, block_size=block_size,
              num_kv_blocks=2048 // block_size, enable_prefix_caching=False)
    prompts = random_prompts(lengths, vocab=500, seed=len(lengths))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    calls = _count_native_steps(monkeypatch)
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert calls and max(calls) == len(prompts)
    model = llm.llm_engine.model  # now without the driver: the layers one by one
    monkeypatch.setattr(model.attn_backend, "step_driver", lambda model, kv_caches: None)
    model.set_attention_backend(model.attn_backend)  # (forgets the driver it built)
    layered = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, layered):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert_all_blocks_free(llm)


@needs_native
@pytest.mark.parametrize("name,block_size", [("llama", 16), ("llama-gqa-rope", 16), ("qwen2", 1), ("mistral", 16),
                                             ("qwen2-hd64-gqa", 16), ("llama-hd64", 128)])
def test_native_decode_steps_equal_the_layers(checkpoints, name, block_size, monkeypatch):
    """GQA, q/k/v biases (Qwen2), scaled rotary (llama3), any block size."""
    _assert_native_equals_layers(checkpoints[name], [5, 40, 17, 130], monkeypatch, block_size)


@needs_native
def test_every_bias_is_added(tmp_path, monkeypatch):
    """Llama with attention and MLP biases (random, not transformers' zeros): q/k/v, o, gate/up, down."""
    path = build_checkpoint(tmp_path / "llama-bias", "llama", seed=2, attention_bias=True, mlp_bias=True,
                            initializer_range=0.2)
    _assert_native_equals_layers(path, [9, 33], monkeypatch)


@needs_native
def test_sliding_window_is_applied(tmp_path, monkeypatch):
    """A window shorter than the context: only the last `window` tokens are attended."""
    path = build_checkpoint(tmp_path / "mistral-w", "mistral", seed=1, num_key_value_heads=2, sliding_window=24,
                            initializer_range=0.2)
    _assert_native_equals_layers(path, [30, 50], monkeypatch)


def test_float32_models_keep_the_layers(llama_path, monkeypatch):
    calls = _count_native_steps(monkeypatch)
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, num_kv_blocks=64)
    out = llm.generate(random_prompts([7], vocab=500, seed=5), SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert not calls and llm.llm_engine.model._driver is None


@needs_native
def test_moving_the_model_drops_the_decoder(llama_path):
    """The decoder points into the model's tensors: .to() (which may replace them) makes the model build it again."""
    llm = LLM(str(llama_path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = random_prompts([9], vocab=500, seed=7)
    first = llm.generate(prompt, params, use_tqdm=False)
    model = llm.llm_engine.model
    assert model._driver is not None
    model.to("cpu")
    assert model._driver is None
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert model._driver is not None
