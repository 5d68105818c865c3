"""Memory sizing: the KV cache's bytes per token and per block, the blocks a byte budget holds, and a
model's weight bytes (whole and per tensor-parallel rank).

The engine allocates its KV pool by these numbers (``startup.allocate_kv_cache``) and ``pagellm plan``
reports them, so a plan and a running engine cannot disagree. Nothing here loads weights: the weight
sizes come from the checkpoint's headers (safetensors) or tensor table (GGUF).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from pagellm.config import KV_CACHE_DTYPES
from pagellm.core.kv_cache_manager import cdiv
from pagellm.distributed.sharding import kv_heads_per_rank
from pagellm.model.llama import head_dim_of

# Bytes per element of the model dtypes (vLLM's --dtype names and aliases, and torch's).
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# safetensors' dtype codes -> bytes per element.
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                           "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a model dtype: a ``torch.dtype`` or one of vLLM's names (``"bfloat16"``)."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_element_bytes(kv_cache_dtype: str, model_dtype: Any) -> int:
    """Bytes of one K or V element: the model dtype's for ``auto``, 1 for the fp8 formats."""
    if kv_cache_dtype == "auto":
        return dtype_bytes(model_dtype)
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return 1
    raise ValueError(f"unknown kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype!r}: use one of "
                     f"{', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class KVCacheSizing:
    """The KV pool of one rank: K and V of ``num_layers`` layers, ``num_kv_heads`` heads (this rank's)
    of ``head_dim`` elements of ``element_bytes`` bytes, in blocks of ``block_size`` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    element_bytes: int

    @classmethod
    def for_model(cls, config: PretrainedConfig, block_size: int, dtype: Any, kv_cache_dtype: str = "auto",
                  tensor_parallel_size: int = 1) -> KVCacheSizing:
        """One rank's KV sizing: from the whole model's config and ``tensor_parallel_size``, or from a
        rank's sharded config (its KV heads already its share) with the default of 1."""
        total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, kv_heads_per_rank(total_kv_heads, tensor_parallel_size),
                   head_dim_of(config), block_size, kv_element_bytes(kv_cache_dtype, dtype))

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks(self, budget_bytes: int) -> int:
        """Whole blocks that fit ``budget_bytes``."""
        return budget_bytes // self.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds."""
        return cdiv(num_tokens, self.block_size)


# ----------------------------------------------------------------------------------------- weights


# The CPU defaults where --kv-cache-memory / --swap-space are not given: shares of the host memory
# available once the weights are loaded. The pools are mapped lazily (worker/cpu_tuning.py), so a
# generous pool costs memory only as its blocks are used.
DEFAULT_KV_SHARE = 0.2
DEFAULT_SWAP_SHARE = 0.1


def default_kv_cache_bytes(kv: KVCacheSizing, max_model_len: int, max_num_seqs: int, available: int) -> int:
    """The KV pool a CPU engine takes by default: what ``max_num_seqs`` sequences of ``max_model_len``
    could ever hold, but at most ``DEFAULT_KV_SHARE`` of the ``available`` host memory; raised to one
    whole sequence of ``max_model_len`` where that takes at most half of it."""
    one_sequence = kv.blocks_for(max_model_len) * kv.bytes_per_block
    budget = min(max_num_seqs * one_sequence, int(available * DEFAULT_KV_SHARE))
    if budget < one_sequence <= available // 2:
        budget = one_sequence
    return budget


def default_swap_bytes(kv_pool_bytes: int, available: int) -> int:
    """The swap pool a CPU engine takes by default: as large as the KV pool, but at most
    ``DEFAULT_SWAP_SHARE`` of the ``available`` host memory."""
    return min(kv_pool_bytes, int(available * DEFAULT_SWAP_SHARE))


@dataclass(frozen=True)
class WeightTensor:
    """One tensor of a checkpoint: its name (Hugging Face's or GGUF's), elements and bytes in the file."""

    name: str
    numel: int
    file_bytes: int


def safetensors_tensors(files: list[Path]) -> list[WeightTensor]:
    """The tensors of safetensors files, read from their headers only."""
    tensors = []
    for file in files:
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as e:
            raise ValueError(f"cannot read the header of the weights file {file}: {e} (is it safetensors?)") from e
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            tensors.append(WeightTensor(name, math.prod(entry["shape"]), end - begin))
    return tensors


def gguf_tensors(path: Path) -> list[WeightTensor]:
    """The tensors of a GGUF file, from its header's tensor table: the metadata before it (a tokenizer's
    vocabulary among it) is skipped, not decoded, and no tensor data is read."""
    from pagellm.model.gguf_header import read_header

    return [WeightTensor(t.name, t.numel, t.num_bytes) for t in read_header(path).tensors]


# Tensors every rank holds whole: embeddings, the LM head, norms and MoE routers (counted whole on
# each rank, an upper bound where an implementation splits the vocabulary).
_REPLICATED = re.compile(r"embed_tokens|token_embd|lm_head|^output\.weight$|norm|ffn_gate_inp|\.gate\.weight$")
# Tensors that are not parameters (the engine computes rotary tables itself).
_NOT_PARAMETERS = re.compile(r"rotary_emb\.inv_freq|rope_freqs|rope_factors")
_KV_PROJECTION = re.compile(r"[kv]_proj\.|attn_[kv]\.")
_FUSED_QKV = re.compile(r"qkv_proj\.|attn_qkv\.")


def rank_share(name: str, num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> float:
    """The share of tensor ``name`` that one rank holds: attention and MLP weights split over the
    ranks (K/V projections by KV heads, replicated where they are fewer than the ranks), the rest whole."""
    tp = tensor_parallel_size
    if tp == 1 or _REPLICATED.search(name):
        return 1.0
    kv_share = kv_heads_per_rank(num_kv_heads, tp) / num_kv_heads
    if _FUSED_QKV.search(name):  # before K/V alone: "qkv_proj." holds "v_proj."
        return (num_heads / tp + 2 * num_kv_heads * kv_share) / (num_heads + 2 * num_kv_heads)
    if _KV_PROJECTION.search(name):
        return kv_share
    return 1.0 / tp


@dataclass(frozen=True)
class WeightSizing:
    """A checkpoint's weights: parameters, bytes in the files, bytes in memory at the compute dtype,
    and the bytes one rank holds. For a GGUF file the memory figures are an upper bound: every tensor
    is counted dequantized, as under tensor parallelism, on CUDA or with ``--quantization none``, though
    on CPU the linear layers keep their smaller quantized blocks after loading."""

    num_params: int
    file_bytes: int
    bytes: int
    bytes_per_rank: int

    @classmethod
    def from_tensors(cls, tensors: list[WeightTensor], dtype: Any, num_heads: int, num_kv_heads: int,
                     tensor_parallel_size: int = 1) -> WeightSizing:
        element = dtype_bytes(dtype)
        params = [t for t in tensors if not _NOT_PARAMETERS.search(t.name)]
        num_params = sum(t.numel for t in params)
        per_rank = sum(t.numel * rank_share(t.name, num_heads, num_kv_heads, tensor_parallel_size) for t in params)
        return cls(num_params, sum(t.file_bytes for t in tensors), num_params * element, math.ceil(per_rank) * element)
