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
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "phi3": "phi3", "qwen3_moe": "qwen3moe"}
EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from [first half | second half] to interleaved pairs (llama.cpp's rotary)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, out: Path, qtype: str = "F32", eot_token_id: int | None = None,
               split_max_tensors: int = 0) -> Path:
    """The checkpoint in ``folder`` as a GGUF file, its 2-D weights stored as ``qtype`` (with an
    end-of-turn id besides the eos one where given, as Llama 3's files have); with
    ``split_max_tensors``, split as llama.cpp's gguf-split does (``out``'s stem with
    ``-0000K-of-0000N``: returns the first part)."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
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
    if arch.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _add_tokenizer(writer, folder)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, w in _gguf_tensors(load_file(str(folder / "model.safetensors")), names):
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute_for_llama_cpp(w, heads if "attn_q" in name else kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        if w.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quantize(w, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return next(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))
    return out


def _gguf_tensors(weights: dict[str, np.ndarray], names) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array): each tensor under its GGUF name; a layer's experts stacked into one 3-D
    tensor per projection, as llama.cpp stores them."""
    out, experts = [], {}
    for hf_name, w in weights.items():
        parts = hf_name.split(".")
        if "experts" in parts:  # model.layers.N.mlp.experts.E.gate_proj.weight
            layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
            experts.setdefault((layer, proj), {})[expert] = w
            continue
        base, suffix = hf_name.rsplit(".", 1)
        out.append((f"{names.get_name(base)}.{suffix}", w))
    for (layer, proj), by_expert in sorted(experts.items()):
        out.append((f"blk.{layer}.{EXPERT_TENSORS[proj]}.weight", np.stack([by_expert[e] for e in sorted(by_expert)])))
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


def write_encoder_gguf(folder: Path, out: Path, qtype: str = "F32", pooling: str = "mean") -> Path:
    """A BERT or NomicBERT checkpoint as llama.cpp's converter writes it (``bert`` / ``nomic-bert``): the sizes,
    the pooling type, gguf's tensor names and the WordPiece vocabulary in llama.cpp's phantom-space spelling."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch = {"bert": "bert", "nomic_bert": "nomic-bert"}[config["model_type"]]
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type({"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}[pooling])
    if arch == "nomic-bert":
        writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    vocab = [line for line in (folder / "vocab.txt").read_text().splitlines()] if (folder / "vocab.txt").is_file() \
        else [t for t, _ in sorted(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].items(),
                                   key=lambda kv: kv[1])]
    phantom = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t
               for t in vocab]
    writer.add_tokenizer_model("bert")
    writer.add_token_list(phantom)
    writer.add_token_types([3 if t.startswith("[") and t.endswith("]") else 1 for t in vocab])
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    for add, token in ((writer.add_bos_token_id, "[CLS]"), (writer.add_sep_token_id, "[SEP]"),
                       (writer.add_pad_token_id, "[PAD]"), (writer.add_unk_token_id, "[UNK]"),
                       (writer.add_mask_token_id, "[MASK]")):
        add(vocab.index(token))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    quant = gguf.GGMLQuantizationType[qtype]
    for hf_name, w in load_file(str(folder / "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            continue  # the pooler, which llama.cpp's converter drops
        w = w.astype(np.float32)
        if w.ndim == 2 and quant != gguf.GGMLQuantizationType.F32 and not name.startswith(("token_types",)):
            writer.add_tensor(f"{name}.{suffix}", gguf.quantize(w, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{name}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
