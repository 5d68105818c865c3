"""GGUF embedding models as llama.cpp stores them (``general.architecture`` ``bert`` or ``nomic-bert``), for the
pooling runner. transformers' GGUF reader does not take these architectures, so the file is turned into a
Hugging Face folder here, once per file (kept in ``$PAGELLM_CACHE_DIR/gguf/``), and the pooling engine reads
that folder as any other:

- config.json from the file's ``<arch>.*`` sizes (``BertModel``, or ``NomicBertModel`` in Nomic's spelling);
- the tokenizer: files beside the GGUF file where there are some, else a WordPiece tokenizer from the file's
  vocabulary, undoing llama.cpp's "phantom space" spelling (a word's first piece is stored as ``▁piece``, a
  continuation ``##piece`` as ``piece``) and lower-casing where the vocabulary has no upper-case words;
- sentence-transformers' pooling files from ``<arch>.pooling_type`` (mean, CLS or last token), normalised as
  llama.cpp's embeddings are by default;
- model.safetensors: every tensor dequantized (``gguf.dequantize``) to float32 and named by gguf's own map
  from Hugging Face names (``gguf.get_tensor_name_map``), the one llama.cpp's converter wrote them with.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagellm.model.gguf_header import read_header

ENCODER_ARCHITECTURES = ("bert", "nomic-bert")
# gguf.PoolingType -> sentence-transformers' pooling mode.
_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
_PREPARED_FORMAT = 1


def gguf_encoder_architecture(path: str | Path) -> str | None:
    """The file's architecture where ``path`` is a GGUF file of an encoder llama.cpp embeds with, else None."""
    p = Path(path).expanduser()
    if not p.is_file():
        return None
    try:
        arch = read_header(p, ("general.architecture",)).fields.get("general.architecture")
    except (ValueError, OSError):
        return None
    return str(arch) if arch in ENCODER_ARCHITECTURES else None


def encoder_folder(gguf_path: Path) -> Path:
    """The Hugging Face folder of this GGUF encoder, built on first use."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|enc{_PREPARED_FORMAT}".encode())
    from pagellm.model.default_model import cache_dir

    target = cache_dir() / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:  # built beside the target and renamed: never half a folder
        _write_folder(gguf_path, tmp)
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fields(gguf_path: Path) -> tuple[Any, dict[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    return reader, {name: field.contents() for name, field in reader.fields.items()
                    if not name.startswith("tokenizer.ggml.merges")}


def _config(arch: str, f: dict[str, Any], vocab: int, types: int) -> dict[str, Any]:
    def need(key: str) -> Any:
        if f"{arch}.{key}" not in f:
            raise ValueError(f"the GGUF file has no {arch}.{key}: it is not a complete {arch} model")
        return f[f"{arch}.{key}"]

    special = {"pad_token_id": f.get("tokenizer.ggml.padding_token_id", 0)}
    if arch == "bert":
        return {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab,
                "hidden_size": need("embedding_length"), "num_hidden_layers": need("block_count"),
                "num_attention_heads": need("attention.head_count"), "intermediate_size": need("feed_forward_length"),
                "max_position_embeddings": need("context_length"), "type_vocab_size": types,
                "layer_norm_eps": f.get(f"{arch}.attention.layer_norm_epsilon", 1e-12), "hidden_act": "gelu",
                "dtype": "float32", **special}
    return {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": vocab,
            "n_embd": need("embedding_length"), "n_layer": need("block_count"), "n_head": need("attention.head_count"),
            "n_inner": need("feed_forward_length"), "n_positions": need("context_length"), "type_vocab_size": types,
            "layer_norm_epsilon": f.get(f"{arch}.attention.layer_norm_epsilon", 1e-12),
            "rotary_emb_base": f.get(f"{arch}.rope.freq_base", 1000.0), "activation_function": "swiglu",
            "dtype": "float32", **special}


def _wordpiece(tokens: list[str]) -> list[str]:
    """llama.cpp's phantom-space vocabulary -> BERT's WordPiece one."""
    out = []
    for tok in tokens:
        if tok.startswith("[") and tok.endswith("]"):
            out.append(tok)
        elif tok.startswith("\u2581"):
            out.append(tok[1:])
        else:
            out.append("##" + tok)
    return out


def _write_tokenizer(gguf_path: Path, f: dict[str, Any], out: Path, max_len: int) -> None:
    beside = [p for p in gguf_path.parent.iterdir() if p.name in ("tokenizer.json", "tokenizer_config.json",
                                                                  "vocab.txt", "special_tokens_map.json")]
    if any(p.name in ("tokenizer.json", "vocab.txt") for p in beside):
        for p in beside:
            shutil.copy(p, out / p.name)
        return
    if f.get("tokenizer.ggml.model") != "bert":
        raise ValueError(f"{gguf_path.name}: its tokenizer ({f.get('tokenizer.ggml.model')!r}) is not a WordPiece "
                         "one; put the model's tokenizer.json beside the file")
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    vocab = _wordpiece([str(t) for t in f["tokenizer.ggml.tokens"]])
    words = [w for w in vocab if not w.startswith(("[", "##"))]
    lower = not any(c.isupper() for w in words for c in w)

    def token(key: str, default: str) -> str:
        i = f.get(f"tokenizer.ggml.{key}")
        if key == "cls_token_id" and i is None:
            i = f.get("tokenizer.ggml.bos_token_id")  # llama.cpp's WordPiece files: [CLS] is the BOS token
        return vocab[int(i)] if isinstance(i, int) and 0 <= i < len(vocab) else default

    unk, cls = token("unknown_token_id", "[UNK]"), token("cls_token_id", "[CLS]")
    sep = token("seperator_token_id", "[SEP]")
    ids = {t: i for i, t in reversed(list(enumerate(vocab)))}
    tok = Tokenizer(models.WordPiece(ids, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token=unk, sep_token=sep, cls_token=cls,
                             pad_token=token("padding_token_id", "[PAD]"), mask_token=token("mask_token_id", "[MASK]"),
                             model_max_length=max_len)
    fast.save_pretrained(str(out))


def _write_pooling(arch: str, f: dict[str, Any], out: Path, hidden: int) -> None:
    from pagellm.model.default_model import write_sentence_transformers_files

    kind = int(f.get(f"{arch}.pooling_type", 1))
    if kind not in _POOLING:
        raise ValueError(f"{arch}.pooling_type {kind} is not an embedding model's pooling (mean, CLS or last); "
                         "GGUF rerankers are not supported: serve the model's Hugging Face folder")
    write_sentence_transformers_files(out, _POOLING[kind], True, hidden)


def _write_folder(gguf_path: Path, out: Path) -> None:
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from pagellm.model.encoders import encoder_class_for

    reader, f = _fields(gguf_path)
    arch = str(f["general.architecture"])
    tensors = {t.name: t for t in reader.tensors}
    # (GGUF lists a tensor's dimensions fastest first: the last is its rows.)
    types = int(tensors["token_types.weight"].shape[-1]) if "token_types.weight" in tensors else 2
    vocab = len(f.get("tokenizer.ggml.tokens") or []) or int(tensors["token_embd.weight"].shape[-1])
    settings = _config(arch, f, vocab, types)
    # Both spellings' sizes: BERT's keys, or Nomic's.
    layers, hidden, positions = (int(settings["num_hidden_layers" if arch == "bert" else "n_layer"]),
                                 int(settings["hidden_size" if arch == "bert" else "n_embd"]),
                                 int(settings["max_position_embeddings" if arch == "bert" else "n_positions"]))
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    config = AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        skeleton = encoder_class_for(config.architectures)(config)
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, layers)
    ours: dict[str, str] = {}
    for name, _ in skeleton.named_parameters():
        stem, suffix = name.rsplit(".", 1)
        mapped = names.get_name(stem)
        if mapped is not None:
            ours[f"{mapped}.{suffix}"] = name
    weights: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name not in ours:
            continue  # a classifier or an LM head the embedding model does not run
        data = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        shape = tuple(int(d) for d in reversed(t.shape))
        weights[ours[name]] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
    missing = sorted(set(ours.values()) - set(weights))
    if missing:
        raise ValueError(f"{gguf_path.name} lacks the tensors of {', '.join(missing[:3])}: not a complete {arch} "
                         "embedding model")
    save_file(weights, str(out / "model.safetensors"))
    _write_tokenizer(gguf_path, f, out, positions)
    _write_pooling(arch, f, out, hidden)
