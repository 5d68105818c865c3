"""Gemma2 and Gemma3 (text) against transformers, and the attention plumbing they need: a window per
layer (sliding and full-attention layers alternate) and soft-capped attention scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.model.attention import (
    BACKENDS,
    AttentionConfig,
    AttentionMetadata,
    NativeAttentionBackend,
    PrefillSpan,
    TorchAttentionBackend,
    select_attention_backend,
)
from pagellm.model.default_model import build_checkpoint
from pagellm.model.llama import sliding_window_of
from pagellm.worker.cache_engine import kv_shapes
from tests.helpers import hf_prompt_logprobs, random_prompts
from tests.model.family_parity import (
    assert_bfloat16_logprobs_close,
    assert_family_matches_transformers,
    family_prompts,
    transformers_greedy,
)

S, F = "sliding_attention", "full_attention"
# Small windows (8, 16) so that the prompts of 40 and 100 tokens cross them; query_pre_attn_scalar
# other than head_dim in some shapes (the scale is its own); small soft-caps in some shapes so that
# capping changes the scores and logits (the defaults, 50 and 30, barely touch a tiny model's).
SHAPES = {
    "gemma2": {
        "gemma2-gqa-w8": dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=4, sliding_window=8,
                              query_pre_attn_scalar=128, initializer_range=0.2),
        "gemma2-hd64-w16-caps": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=64,
                                     attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                                     tie_word_embeddings=True, initializer_range=0.2),
    },
    "gemma3_text": {
        "gemma3-gqa-w8": dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=4, sliding_window=8,
                              layer_types=[S, F, S, F], query_pre_attn_scalar=32, final_logit_softcapping=8.0,
                              initializer_range=0.2),
        # head_dim 64: with block_size 16, the native prefill kernel's shapes. Full-attention layers
        # with linearly scaled rope, as the larger Gemma3 checkpoints have.
        "gemma3-hd64-w16-rope": dict(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=5,
            sliding_window=16, layer_types=[S, S, F, S, F], query_pre_attn_scalar=64, tie_word_embeddings=True,
            rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                             F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            initializer_range=0.2),
    },
}
CASES = [(arch, name) for arch, shapes in SHAPES.items() for name in sorted(shapes)]


def randomize_norms(path: Path, std: float, seed: int, post_scale: float = 1.0, embed_scale: float = 1.0) -> None:
    """Give the checkpoint's norm weights random values around ``post_scale - 1`` for the norms of the
    layers' outputs and 0 for the others (transformers starts them all at 0, a scale of 1 + 0), so
    that the parity checks see Gemma's (1 + weight) scaling; scale the embeddings by ``embed_scale``."""
    file = path / "model.safetensors"
    weights = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if "norm" in name:
            mean = post_scale - 1 if ".post_" in name else 0.0
            weights[name] = torch.randn(w.shape, generator=gen).mul_(std).add_(mean).to(w.dtype)
        elif "embed_tokens" in name:
            weights[name] = w * embed_scale
    save_file(weights, str(file), metadata={"format": "pt"})


def perturb(path: Path, seed: int) -> None:
    """The checkpoint's norms randomized, its layers' outputs scaled up against its embeddings: random
    tied embeddings otherwise make the model repeat its last token (each token's own embedding then
    dominates its hidden state, and the LM head is that embedding)."""
    randomize_norms(path, std=0.3, seed=seed, post_scale=4.0, embed_scale=0.25)


@pytest.fixture(scope="module", params=CASES, ids=[name for _, name in CASES])
def gemma_path(request, tmp_path_factory):
    arch, name = request.param
    path = build_checkpoint(tmp_path_factory.mktemp(name), arch, seed=5, **SHAPES[arch][name])
    perturb(path, seed=5)
    return path


def test_gemma_greedy_matches_transformers(gemma_path):
    prompts = family_prompts(seed=5)
    expected = transformers_greedy(gemma_path, prompts)
    assert all(len(set(tokens)) > 3 for tokens in expected)  # not a degenerate model
    # 10 blocks of 16 for every layer, the fewest a 160-token sequence needs: with a pool for each kind of
    # layer (the sliding layers holding only their window), the helper's 48 blocks of 4 no longer preempt.
    # (test_gemma_kv_groups.py preempts with blocks of 1, 4 and 16.)
    assert_family_matches_transformers(gemma_path, prompts, expected, num_kv_blocks=10, block_size=16)


def test_gemma_float32_logprobs_match_transformers(gemma_path):
    """Greedy tokens cannot see the final soft-capping (tanh keeps the order of the logits): the
    logprobs of every prompt token can."""
    prompts = random_prompts([40, 90], vocab=500, seed=7)
    llm = LLM(str(gemma_path), max_model_len=256, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        torch.testing.assert_close(ours, hf_prompt_logprobs(gemma_path, prompt), atol=1e-4, rtol=0)


def test_gemma_bfloat16_logprobs_close(gemma_path):
    assert_bfloat16_logprobs_close(gemma_path)


def test_gemma_windows_are_per_layer_and_soft_capping_picks_the_pytorch_backend(gemma_path):
    from transformers import AutoConfig

    from pagellm.model.registry import model_class_for

    config = AutoConfig.from_pretrained(str(gemma_path))
    assert sliding_window_of(config) is None  # no window for every layer: each layer has its own
    model = model_class_for(config.architectures)(config, max_position=64)
    windows = [layer.self_attn.window for layer in model.layers]
    assert windows == [config.sliding_window if t == S else None for t in config.layer_types]
    assert not model.native_step_driver
    assert model.attn_logit_softcap == config.attn_logit_softcapping
    softcapped = AttentionConfig(torch.device("cpu"), torch.float32, 4, 2, 64, 16,
                                 logit_softcap=model.attn_logit_softcap)
    if model.attn_logit_softcap is not None:
        assert NativeAttentionBackend.unsupported(softcapped) is not None
        assert type(select_attention_backend(softcapped)) is TorchAttentionBackend


# ---------------------------------------------------------------- the backends, against dense attention
def _meta(slots: list[int], block_size: int, window: int | None = None) -> AttentionMetadata:
    s = torch.tensor(slots, dtype=torch.long)
    return AttentionMetadata(slot_mapping=s, slot_blocks=s // block_size, slot_offsets=s % block_size,
                             sliding_window=window)


def _dense(q, keys, values, q_positions, window, scale, softcap):
    """q: (q_len, heads, d); keys/values: (ctx, kv_heads, d) at positions 0..ctx-1."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (heads, ctx, d)
    values = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # (heads, q_len, ctx)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(keys.shape[1]).unsqueeze(0)
    qp = torch.tensor(q_positions).unsqueeze(1)
    allowed = k_pos <= qp
    if window is not None:
        allowed &= k_pos > qp - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(-1), values).transpose(0, 1)  # (q_len, heads, d)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("model_window,layer_windows", [(None, [None, 6]), (6, [None, 6, 3])])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("backend_class", BACKENDS, ids=lambda b: b.name)
def test_each_layer_attends_within_its_own_window(block_size, model_window, layer_windows, softcap, backend_class):
    """Layers passing their own window (None: full attention) over one step's metadata, whatever the
    model-wide one; soft-capped scores where the backend takes them."""
    torch.manual_seed(0)
    heads, kv_heads, d, num_blocks = 4, 2, 64, 256
    config = AttentionConfig(torch.device("cpu"), torch.float32, heads, kv_heads, d, block_size, model_window,
                             logit_softcap=softcap)
    if backend_class.unsupported(config) is not None:
        pytest.skip(backend_class.unsupported(config))
    backend = backend_class(config)
    k_cache, v_cache = (torch.zeros(s) for s in kv_shapes(num_blocks, block_size, kv_heads, d))
    free = torch.randperm(num_blocks).tolist()
    # (cached, new): two decodes, a prefill chunk after cached context, a fresh prefill.
    shapes = [(20, 1), (9, 1), (11, 7), (0, 12)]
    seqs, q_rows, k_new, v_new, step_slots, prefills = [], [], [], [], [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        k, v = torch.randn(cached + new, kv_heads, d), torch.randn(cached + new, kv_heads, d)
        q = torch.randn(new, heads, d)
        if cached:
            backend.write_kv(k[:cached], v[:cached], k_cache, v_cache, _meta(slots[:cached], block_size))
        if new > 1:
            prefills.append(PrefillSpan(len(step_slots), new, cached + new, torch.tensor(table)))
        seqs.append((cached, new, table, k, v, q))
        q_rows.append(q)
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        step_slots.extend(slots[cached:])
    meta = _meta(step_slots, block_size, model_window)
    meta.prefills = prefills
    meta.decode = backend.prepare_decode([s[2] for s in seqs[:2]], [s[0] + 1 for s in seqs[:2]], [])
    scale = 0.3  # (Gemma's query_pre_attn_scalar ** -0.5 need not be head_dim's)
    backend.write_kv(torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta)
    for window in layer_windows:  # the layers of one step, in turn
        out = backend.forward(torch.cat(q_rows), torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, scale,
                              store=False, window=window)
        want = torch.cat([_dense(q, k, v, list(range(cached, cached + new)), window, scale, softcap)
                          for cached, new, _, k, v, q in seqs])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Without a window of its own, a layer gets the model-wide one.
    out = backend.forward(torch.cat(q_rows), torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, scale,
                          store=False)
    want = torch.cat([_dense(q, k, v, list(range(cached, cached + new)), model_window, scale, softcap)
                      for cached, new, _, k, v, q in seqs])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_soft_capping_is_what_keeps_gemma2_off_the_native_kernels():
    config = AttentionConfig(torch.device("cpu"), torch.float32, 4, 2, 64, 16)
    if native.load() is not None:
        assert type(select_attention_backend(config)) is NativeAttentionBackend
    capped = AttentionConfig(torch.device("cpu"), torch.float32, 4, 2, 64, 16, logit_softcap=50.0)
    assert "soft-capping" in (NativeAttentionBackend.unsupported(capped) or "")
    assert "matmul prefill" in select_attention_backend(capped).describe()
