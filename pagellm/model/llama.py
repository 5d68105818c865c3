"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Differences between them are config switches: Qwen2 has biases on q/k/v, Qwen3 normalizes each
query and key head (q_norm, k_norm) before the rotation, Mistral may use a sliding window, any of
them may tie the LM head to the embedding. The other families (gemma.py, phi3.py, moe.py) reuse
these pieces and change what differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.attention import (
    META_WINDOW,
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    OutputRows,
    StepDriver,
    Window,
)
from pagellm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagellm.model.packed_linear import PackedLinear
from pagellm.model.quant_linear import QuantizedWeight, QuantLinear, step_prompt_rows


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# Families whose layers each pass their own window (sliding and full-attention layers alternate, as
# config.layer_types says): no window applies to every layer.
PER_LAYER_WINDOW_TYPES = ("gemma2", "gemma3_text")


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window in tokens that applies to every layer, or None (full attention, or
    windows set per layer)."""
    model_type = getattr(config, "model_type", "")
    if model_type in PER_LAYER_WINDOW_TYPES:
        return None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) or None


class Attention(nn.Module):
    # A tensor-parallel rank's share, where sharded (distributed/sharding.py): PEFT module -> (start, end, whole).
    tp_spans: dict[str, tuple[int, int, int]] | None = None

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.rotary = rotary
        # Qwen3: an RMSNorm over each query and key head, before the rotation.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.backend: AttentionBackend | None = None  # LlamaForCausalLM.set_attention_backend
        # This layer's window (Gemma: each layer its own); by default the model-wide one.
        self.window: Window = META_WINDOW
        # An fp8 KV cache (set_fp8_kv_cache): the largest value its format holds, and the scales K and V
        # are divided by before they are stored.
        self.fp8_max: float | None = None
        self.k_scale = self.v_scale = 1.0
        self.calculate_kv_scales = False

    def set_fp8_kv_cache(self, fp8_max: float, calculate_scales: bool) -> None:
        """Store K/V in an fp8 pool: scaled by ``k_scale``/``v_scale`` (1.0, or with ``calculate_scales``
        from the first forward's largest values, as vLLM's --calculate-kv-scales)."""
        self.fp8_max, self.calculate_kv_scales = fp8_max, calculate_scales

    def scale_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """K and V as the fp8 pool stores them, and the score scale that undoes the K scale (the V scale
        is undone on the attention output: both are linear)."""
        if self.calculate_kv_scales:
            assert self.fp8_max is not None
            self.calculate_kv_scales = False  # once: later blocks must share the earlier ones' scales
            self.k_scale = max(float(k.abs().max()) / self.fp8_max, 1e-12) if k.numel() else 1.0
            self.v_scale = max(float(v.abs().max()) / self.fp8_max, 1e-12) if v.numel() else 1.0
        if self.k_scale != 1.0:
            k = k / self.k_scale
        if self.v_scale != 1.0:
            v = v / self.v_scale
        return k, v, self.scale * self.k_scale

    def project_qkv(self, positions: torch.Tensor, x: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (num_tokens, hidden) -> rotated q (num_tokens, num_heads, head_dim), rotated k and v
        (num_tokens, num_kv_heads, head_dim)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = self.q_norm is None and self.rotary.rotate_qk_(positions, qkv, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        if not rotated:
            q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        keep: OutputRows | None = None,
    ) -> torch.Tensor:
        """Every row's K/V is stored; with ``keep``, only its rows are attended and returned."""
        backend = self.backend
        assert backend is not None, "the model runner sets the attention backend (set_attention_backend)"
        q, k, v = self.project_qkv(positions, x)
        scale = self.scale
        if self.fp8_max is not None:
            k, v, scale = self.scale_kv(k, v)
        if keep is None:
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, scale, window=self.window)
        else:
            backend.write_kv(k, v, kv_cache[0], kv_cache[1], meta)
            q, k, v = q[keep.index], k[keep.index], v[keep.index]
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], keep.meta, scale, store=False,
                                window=self.window)
        if self.v_scale != 1.0:
            o = o * self.v_scale
        return self.o_proj(o.reshape(o.shape[0], self.q_size))


# Model types whose attention normalizes each query and key head (q_norm, k_norm) before the rotation.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


def dense_mlp(config: PretrainedConfig) -> GatedMLP:
    """The gated MLP of ``config.intermediate_size`` every Llama-family layer has."""
    return GatedMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, mlp: nn.Module | None = None) -> None:
        """``mlp``: the feed-forward block (a family's own, e.g. a mixture of experts); default the dense one."""
        super().__init__()
        # Qwen2 always has q/k/v biases and none on o_proj; Llama/Mistral follow attention_bias.
        is_qwen2 = getattr(config, "model_type", "") == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, qkv_bias=is_qwen2 or attention_bias,
                                   o_bias=attention_bias and not is_qwen2,
                                   qk_norm=getattr(config, "model_type", "") in QK_NORM_MODEL_TYPES)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = mlp if mlp is not None else dense_mlp(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
        meta: AttentionMetadata, keep: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for the first layer, residual None);
        residual: the running sum of the outputs before it. Each residual addition is fused into the
        norm after it. Returns (this layer's MLP output, the running sum before it), for the rows of
        ``keep`` only where given (every row's K/V is still stored)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta, keep)
        if keep is not None:
            residual = residual[keep.index]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` takes one flat batch of tokens."""

    # Whether the native step driver (native_decode.py: the layers of this class, as they are here) may
    # run this model's decode steps; families that change a layer turn it off.
    native_step_driver = True
    # Attention logit soft-capping (Gemma2), for the model runner's choice of attention backend.
    attn_logit_softcap: float | None = None
    # Set by the model runner for a step with LoRA adapter rows: the hooks on the projections must run.
    lora_active = False

    # HF checkpoint name -> (our fused parameter, shard index) for fused projections.
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, max_position: int) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layers(config, max_position))
        self.norm = self.make_norm(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if getattr(config, "model_type", "") == "qwen3":
            self.native_step_driver = False  # (the driver has no per-head q/k norms)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Chosen once by the model runner (set_attention_backend).
        self.attn_backend: AttentionBackend | None = None
        # Decode-only steps run every layer in one call where the backend has a driver for these
        # layers (the native one: model/attention/native_decode.py; the same bits as the layers' forward).
        self._driver: StepDriver | None = None
        self._driver_pools: list[KVCache] | None = None

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError where ``config`` asks for what this class does not implement."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")

    def make_layers(self, config: PretrainedConfig, max_position: int) -> list[nn.Module]:
        """The decoder layers, in order; families with other layers (gemma.py) override this."""
        rotary = self.make_rotary(config, max_position)
        return [DecoderLayer(config, rotary, self.make_mlp(config, i)) for i in range(config.num_hidden_layers)]

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        """The norm after the last layer."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) token ids -> (num_tokens, hidden): the first layer's input."""
        return self.embed_tokens(input_ids)

    def make_rotary(self, config: PretrainedConfig, max_position: int) -> RotaryEmbedding:
        """The rotary embedding every layer shares; families with other rope rules (phi3.py) override this."""
        return RotaryEmbedding(config, head_dim_of(config), max_position)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx``; families with another one (moe.py) override this."""
        return dense_mlp(config)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """The attention backend every layer calls (the model runner's, chosen at start-up)."""
        self.attn_backend = backend
        for layer in self.layers:
            cast(DecoderLayer, layer).self_attn.backend = backend
        self._driver, self._driver_pools = None, None

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final (normed) hidden states of every row, or of ``meta.output_rows``' rows in its order."""
        x = self.embed(input_ids)  # (num_tokens, hidden)
        driver = self._step_driver(kv_caches)
        if driver is not None and not self.lora_active and driver.accepts(meta, x, positions):
            return driver(x, positions, meta)  # every layer and the last norm in one call
        residual = None
        last = len(self.layers) - 1
        with step_prompt_rows(meta.prompt_row_masks()):
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x, residual = layer(positions, x, residual, kv_cache, meta, meta.output_rows if i == last else None)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> LlamaForCausalLM:
        # .to(), .float(), ... replace the tensors the step driver points into: build it again.
        self._driver, self._driver_pools = None, None
        return super()._apply(fn, *args, **kwargs)

    def _step_driver(self, kv_caches: list[KVCache]) -> StepDriver | None:
        """The backend's decode-step driver over these pools (built on first use), or None where it has none."""
        if self._driver_pools is not kv_caches or (self._driver is not None and not self._driver.serves(kv_caches)):
            assert self.attn_backend is not None, "the model runner sets the attention backend"
            self._driver = self.attn_backend.step_driver(self, kv_caches)
            self._driver_pools = kv_caches
        return self._driver

    def compute_logits(self, hidden: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        """(num_selected, hidden) -> (num_selected, vocab) float32 logits (rounded to the model's dtype
        first, as transformers computes them). ``decode_step``: the rows are a decode-only step's (a
        quantized LM head then multiplies as the decoder's layers do)."""
        if isinstance(self.lm_head, PackedLinear):
            return self.lm_head(hidden, out_dtype=torch.float32)
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head(hidden, decode_step=decode_step).float()
        return self.lm_head(hidden).float()

    # ---------------------------------------------------------------- weights
    def checkpoint_names(self) -> dict[str, tuple[str, int]]:
        """Every weight name a checkpoint must provide -> (our parameter, shard index or -1)."""
        names: dict[str, tuple[str, int]] = {}
        for name, _ in self.named_parameters():
            fused = name.split(".")[-2]
            if fused in {ours for ours, _ in self.stacked_params.values()}:
                for hf, (ours, shard) in self.stacked_params.items():
                    if ours == fused:
                        names["model." + name.replace(fused, hf)] = (name, shard)
            elif name.startswith("lm_head"):
                names[name] = (name, -1)
            else:
                names["model." + name] = (name, -1)
        if self.tie_word_embeddings:
            names.pop("lm_head.weight", None)
        return names

    def shard_slice(self, param_name: str, shard: int) -> slice:
        """Rows of fused parameter ``param_name`` that shard ``shard`` fills."""
        first = cast(DecoderLayer, self.layers[0])  # (an nn.ModuleList of DecoderLayers)
        if "qkv_proj" in param_name:
            attn = first.self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            # The MLP that owns the parameter: layers (and experts) may differ in size.
            owner = cast(GatedMLP, self.get_submodule(param_name.rsplit(".", 2)[0]))
            size = owner.intermediate_size
            sizes = [size, size]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy checkpoint tensors in, checking names and shapes; raises ValueError on a mismatch.

        Quantized tensors (a GGUF file's, kept as stored) are not copied: they are collected in
        ``quantized_parts`` (parameter -> (first row, weight) pieces) for ``install_quantized``; the
        embedding is dequantized for its lookups, and a tied LM head keeps the quantized copy."""
        expected = self.checkpoint_names()
        params = dict(self.named_parameters())
        seen: set[str] = set()
        self.quantized_parts: dict[str, list[tuple[int, QuantizedWeight]]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # older checkpoints store the rotary table; we compute it
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in expected:
                raise ValueError(f"checkpoint has a weight {name!r} that {type(self).__name__} does not expect")
            ours, shard = expected[name]
            target = params[ours].data
            if shard >= 0:
                target = target[self.shard_slice(ours, shard)]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)} but the config implies "
                    f"{tuple(target.shape)}: the checkpoint does not match its config.json"
                )
            if isinstance(tensor, QuantizedWeight):
                if ours == "embed_tokens.weight":
                    target.copy_(tensor.dequantize())
                    if self.tie_word_embeddings:
                        self.quantized_parts["lm_head.weight"] = [(0, tensor)]
                else:
                    first_row = self.shard_slice(ours, shard).start if shard >= 0 else 0
                    self.quantized_parts.setdefault(ours, []).append((first_row, tensor))
            else:
                target.copy_(tensor)
            seen.add(name)
        missing = sorted(set(expected) - seen)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
