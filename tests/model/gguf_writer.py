"""Tiny GGUF files for the tests, written from the tiny Hugging Face checkpoints with gguf's writer.

They follow what llama.cpp's converter writes for these architectures (the metadata keys, the
tensor names of gguf's name map, Llama's q/k rows permuted for llama.cpp's rotary layout, a gpt2
tokenizer with its merges and chat template), so that pagellm and transformers read them as they
read llama.cpp's own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

# transformers model_type -> GGUF architecture name.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from [first half | second half] to interleaved pairs (llama.cpp's rotary)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, out: Path, qtype: str = "F32") -> Path:
    """The checkpoint in ``folder`` as a GGUF file, its 2-D weights stored as ``qtype``."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, folder)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    quant = gguf.GGMLQuantizationType[qtype]
    for hf_name, w in load_file(str(folder / "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute_for_llama_cpp(w, heads if "attn_q" in name else kv_heads)
        if w.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quantize(w, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, folder: Path) -> None:
    """The byte-level BPE tokenizer as llama.cpp stores one: tokens, types, merges, ids, chat template."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special[tok_config["bos_token"]])
    writer.add_eos_token_id(special[tok_config["eos_token"]])
    writer.add_pad_token_id(special[tok_config["pad_token"]])
    writer.add_add_bos_token(False)
    template = tok_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
