"""GGUF files (llama.cpp's single-file format): config, tokenizer and weights.

The file's header is read by ``gguf_header.py`` (checked field by field), its tensors are turned into
floats by the ``gguf`` package's dequantizers (llama.cpp's own), and its
metadata is turned into a Hugging Face config and tokenizer by transformers' GGUF support, the same
code ``from_pretrained(folder, gguf_file=...)`` runs. Turning 50k-token vocabularies into a
tokenizer takes seconds, so the result (config.json, tokenizer files with the chat template,
generation_config.json with every end-of-generation id) is written once per file into
``$PAGELLM_CACHE_DIR/gguf/`` and the rest of the engine reads that folder as it reads any
Hugging Face folder; only the weights come from the GGUF file itself. The folder also keeps the
map from the file's tensor names to the model's (``weights_map.json``), which transformers builds
by walking the whole model, so a warm start reads the weights straight from the file's tensor table
(``gguf_header.py``) without decoding its metadata again.

Weights go through transformers' name map and per-architecture fixes (llama.cpp permutes Llama's
q/k rows for its rotary layout and stores Gemma's norms as 1 + w; both are undone there). Linear
layers' quantized tensors of a type the native kernels read stay as stored, their rows permuted like
the floats' would be (``keep_quantized``; model/quant_linear.py runs them); every other tensor is
dequantized into the model's dtype (``gguf.dequantize``), tensor by tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from pagellm.model.gguf_header import GGUFHeader, TensorInfo, read_header, tensor_view
from pagellm.model.quant_linear import QuantizedWeight

logger = logging.getLogger(__name__)

# general.architecture -> the transformers model_type it becomes (llama.cpp tags Mistral as llama).
SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}

# The tensor types of llama.cpp's common files, which gguf's dequantizers turn into floats.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# Ids that end a generation besides tokenizer.ggml.eos_token_id (Llama 3's <|eot_id|>, <|eom_id|>).
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# GGUF metadata key (after "<arch>.") -> config attribute.
STATED_SIZES = {"attention.key_length": "head_dim", "expert_count": "num_local_experts",
                "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size"}
# Bumped when what the prepared folder holds changes: older folders are then rebuilt.
PREPARED_FORMAT = 2
WEIGHTS_MAP_FILE = "weights_map.json"


_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def gguf_parts(gguf_path: Path) -> list[Path]:
    """The files of a GGUF model: itself, or for a file split by llama.cpp's ``gguf-split``
    (``NAME-00001-of-00003.gguf``) every part, in order (the first holds the metadata)."""
    split = _SPLIT.search(gguf_path.name)
    if split is None:
        return [gguf_path]
    stem, count = gguf_path.name[:split.start()], int(split.group(2))
    parts = [gguf_path.with_name(f"{stem}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{gguf_path.name} is part of a GGUF file split in {count}: {', '.join(missing)} "
                                f"missing beside it in {gguf_path.parent}")
    return parts


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its magic bytes, whatever its name)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def _cache_root() -> Path:
    from pagellm.model.default_model import cache_dir

    return cache_dir() / "gguf"


def prepared_folder(gguf_path: Path) -> Path:
    """The folder with the file's config, tokenizer and generation config, built on first use."""
    stat = gguf_path.stat()
    from transformers import __version__ as transformers_version  # its GGUF reader and name map made the folder

    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{PREPARED_FORMAT}|"
                         f"{transformers_version}".encode())
    target = _cache_root() / f"{gguf_path.stem}-{key.hexdigest()[:16]}"
    if (target / "config.json").is_file() and (target / WEIGHTS_MAP_FILE).is_file():
        return target
    read_header(gguf_path)  # a malformed file fails here, with what is wrong, before any other reader sees it
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("reading the config and tokenizer of %s (first use of this file; kept in %s)", gguf_path.name, target)
    # Built beside the target and renamed: a crash or a concurrent start never leaves half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _write_prepared(gguf_path, tmp)
        with contextlib.suppress(OSError):  # another process won the race
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_prepared(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    keys = ("general.architecture", *END_OF_GENERATION_KEYS)
    header = read_header(gguf_path, keys + tuple(f"{arch}.{key}" for arch in SUPPORTED_ARCHITECTURES
                                                 for key in STATED_SIZES))
    arch = header.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; pagellm runs GGUF "
                         f"files of: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    check_tensor_types(header, gguf_path)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers' GGUF reader raises many types on fields it cannot use
        raise ValueError(f"cannot read the model settings of {gguf_path}: {e}") from e
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    # Sizes the file states but transformers' GGUF reader leaves at the config class's defaults.
    for key, attribute in STATED_SIZES.items():
        value = header.fields.get(f"{arch}.{key}")
        if value is not None and hasattr(config, attribute):
            setattr(config, attribute, int(value))
    # Quantized weights carry no compute dtype: --dtype auto takes bfloat16 where the CPU computes it
    # natively, else float32 (loader.resolve_dtype).
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # as above
        raise ValueError(f"cannot read the tokenizer of {gguf_path}: {e}") from e
    tokenizer.save_pretrained(str(out))
    stops = sorted({int(v) for key in END_OF_GENERATION_KEYS if isinstance(v := header.fields.get(key), int)})
    generation = {"eos_token_id": stops} if stops else {}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights_map = {"architecture": arch, "num_layers": config.num_hidden_layers, "names": _weights_map(config, arch)}
    (out / WEIGHTS_MAP_FILE).write_text(json.dumps(weights_map, indent=1) + "\n")


def _processor(arch: str, config: PretrainedConfig) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


def _weights_map(config: PretrainedConfig, arch: str) -> dict[str, str]:
    """GGUF tensor name -> the model's weight name, as transformers maps them (it walks every module
    of the model, building gguf's name table for each: seconds, hence kept in the prepared folder)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):  # only its parameter names are read: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    return dict(get_gguf_hf_weights_map(skeleton, _processor(arch, config)))


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(kind).name


def check_tensor_types(header: GGUFHeader, gguf_path: Path) -> None:
    """ValueError naming the tensors whose types the dequantizers do not take, and the ones they do (and
    for a big-endian file, whose numbers the dequantizers and kernels would read byte-swapped)."""
    if header.byte_order == ">":
        raise ValueError(f"{gguf_path.name} is a big-endian GGUF file: pagellm reads little-endian files, "
                         "the byte order llama.cpp's converter writes by default")
    bad = [f"{t.name} ({_type_name(t.type)})" for t in header.tensors
           if _type_name(t.type) not in SUPPORTED_TENSOR_TYPES]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{gguf_path.name} has tensors of types pagellm cannot load: {', '.join(bad[:3])}{more}; "
                         f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def quantized_types(gguf_path: Path) -> Counter[str]:
    """How many of the file's tensors have each quantized type (empty for a file of floats)."""
    from pagellm.model.gguf_type import FLOAT_TYPES, gguf_types

    return Counter({name: n for name, n in gguf_types(gguf_path).tensor_types.items() if name not in FLOAT_TYPES})


def _keeps_blocks(hf_name: str | None, tensor: TensorInfo) -> bool:
    """Whether this GGUF tensor can stay in its blocks: a linear layer's 2-D weight (the embedding
    too, for a tied LM head) in a type the kernels read."""
    from pagellm.model.quant_linear import kernels_read

    return (hf_name is not None and hf_name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))
            and len(tensor.dims) == 2 and kernels_read(tensor.type, tensor.dims[0]))


def iterate_weights(gguf_path: Path, config: PretrainedConfig, dtype: torch.dtype, keep_quantized: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face weight name, tensor in ``dtype``) for every tensor of the file, dequantized one
    at a time; with ``keep_quantized``, linear layers' tensors the kernels read come as
    ``QuantizedWeight`` instead."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from tqdm.auto import tqdm

    # Every part's tensors, each read from its own file (a whole file is one part).
    tensors: list[tuple[GGUFHeader, Any, TensorInfo]] = []
    for part in gguf_parts(gguf_path):
        header = read_header(part)
        check_tensor_types(header, part)
        data = np.memmap(part, dtype=np.uint8, mode="r")
        tensors += [(header, data, t) for t in header.tensors]
    prepared = json.loads((prepared_folder(gguf_path) / WEIGHTS_MAP_FILE).read_text())
    name_map: dict[str, str] = prepared["names"]
    if config.num_hidden_layers != prepared.get("num_layers"):
        # --hf-overrides changed the model's shape: the file's extra layers must map to nothing.
        name_map = _weights_map(config, prepared["architecture"])
    processor = _processor(prepared["architecture"], config)
    # Processors of MoE files put the experts straight into parsed["tensors"], gate and up of a layer
    # filling halves of one tensor from two GGUF tensors: each is handed on once its last part is in.
    parsed: dict[str, Any] = {"config": config.to_dict(), "tensors": {}}
    targets = [name_map.get(t.name) or name_map.get(t.name.rsplit(".", 1)[0]) for _, _, t in tensors]
    parts_left = Counter(targets)
    for (header, data, tensor), target in tqdm(list(zip(tensors, targets)), desc="Loading GGUF weights",
                                               unit="tensor", dynamic_ncols=True,
                                               disable=gguf_path.stat().st_size < 256 * 2**20):
        view = tensor_view(header, data, tensor)
        if keep_quantized and _keeps_blocks(target, tensor):
            raw = np.asarray(view)
            # The processors only reorder rows (Llama's q/k), which moves whole rows of blocks alike.
            result = processor.process(weights=raw, name=tensor.name, tensor_key_mapping=name_map,
                                       parsed_parameters=parsed)
            if result.name in name_map and result.weights.shape == raw.shape:
                yield name_map[result.name], QuantizedWeight(
                    torch.from_numpy(np.array(result.weights, copy=True)), tensor.type, (raw.shape[0], tensor.dims[0]))
                parts_left[target] -= 1
                continue
        weights = dequantize(view, GGMLQuantizationType(tensor.type))
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=name_map,
                                   parsed_parameters=parsed)
        if result.name in name_map:
            yield name_map[result.name], torch.from_numpy(np.array(result.weights, copy=True)).to(dtype)
        parts_left[target] -= 1
        for name in [n for n in parsed["tensors"] if parts_left[n] <= 0]:
            value = parsed["tensors"].pop(name)
            yield name, (value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))).to(dtype)
