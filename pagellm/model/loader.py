"""A model path -> config + model with weights: a Hugging Face folder (safetensors, single or sharded),
a GGUF file (gguf_file.py), or dummy weights."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.config import DTYPE_CHOICES, LOAD_FORMATS
from pagellm.kernels import native
from pagellm.model import gguf_file
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.packed_linear import pack_linear_layers
from pagellm.model.quant_linear import (
    QUANTIZERS,
    QuantLinear,
    install_quantized,
    quantize_linear_layers,
)
from pagellm.model.registry import model_class_for
from pagellm.model.row_padded_linear import pad_linear_rows
from pagellm.text import plural

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but PyTorch sees no CUDA device; use --device cpu or auto")
    return dev


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), unless hidden
    (PAGELLM_HIDE_CPU_FEATURES)."""
    from pagellm.kernels.cpu_features import cpu_flags

    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's parts are: ``folder`` holds config.json, the tokenizer and generation_config.json
    (for a GGUF file, the folder prepared from its metadata); the weights are the folder's safetensors,
    or ``gguf``."""

    path: Path  # what the user named
    folder: Path
    gguf: Path | None = None

    @property
    def tokenizer_folder(self) -> Path:
        """Tokenizer files beside a GGUF file take precedence over the ones in its metadata."""
        if self.gguf is not None and any((self.gguf.parent / n).is_file() for n in gguf_file.TOKENIZER_FILES):
            return self.gguf.parent
        return self.folder

    @property
    def generation_config_folder(self) -> Path:
        """A generation_config.json beside a GGUF file takes precedence over the ids in its metadata."""
        if self.gguf is not None and (self.gguf.parent / "generation_config.json").is_file():
            return self.gguf.parent
        return self.folder


def resolve_model_files(path: str | Path) -> ModelFiles:
    """A Hugging Face folder or a GGUF file; FileNotFoundError / ValueError saying what to pass instead."""
    p = Path(path).expanduser()
    if p.is_file():
        if not gguf_file.is_gguf_file(p):
            raise ValueError(f"model path {str(p)!r} is a file but not a GGUF file: pass a .gguf file or the "
                             "Hugging Face folder that holds config.json")
        return ModelFiles(p, gguf_file.prepared_folder(p), p)
    return ModelFiles(p, check_model_folder(p))


def check_model_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"model path {str(folder)!r} does not exist: pass a local Hugging Face model folder "
            "(config.json + *.safetensors), a .gguf file, or a hub model id ORG/NAME"
        )
    if not folder.is_dir():
        raise NotADirectoryError(f"model path {str(folder)!r} is a file; pass the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json: it is not a Hugging Face model folder")
    return folder


def load_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {folder / 'config.json'}: {e}") from e


def checkpoint_dtype(folder: Path) -> str | None:
    """The dtype the checkpoint was saved in, as written in config.json."""
    raw = json.loads((folder / "config.json").read_text())
    return raw.get("dtype") or raw.get("torch_dtype")


def resolve_dtype(dtype: str, folder: Path | None, device: torch.device) -> torch.dtype:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return DTYPES[dtype]
    saved = checkpoint_dtype(folder) if folder is not None else None
    resolved = DTYPES.get(str(saved), torch.float32)
    if device.type == "cpu" and resolved == torch.bfloat16 and not cpu_has_bf16():
        logger.info("this CPU has no native bfloat16: computing in float32")
        resolved = torch.float32
    return resolved


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map weight names to shard file names")
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(folder)!r} has no *.safetensors weights (only safetensors checkpoints are supported; "
            "use load_format='dummy' for random weights)"
        )
    return files


# Checkpoints at least this large take seconds to read: loading them shows a progress bar.
PROGRESS_MIN_BYTES = 256 * 2**20


def iterate_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(folder)
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", dynamic_ncols=True,
              disable=total < PROGRESS_MIN_BYTES) as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                        tensor = f.get_tensor(name)
                        bar.update(tensor.numel() * tensor.element_size())
                        yield name, tensor
            except SafetensorError as e:
                raise ValueError(f"cannot read the weights file {file}: {e} (is it truncated, or not "
                                 "safetensors?)") from e


def keeps_gguf_blocks(files: ModelFiles, quantization: str | None, device: torch.device, sharded: bool) -> bool:
    """Whether a GGUF file's quantized linear weights stay in their blocks (model/quant_linear.py):
    the default on CPU where the native kernels load; ``--quantization gguf`` insists, ``none`` declines.
    ``sharded``: the model is cut to a tensor-parallel rank's share (which takes dequantized weights)."""
    if files.gguf is None and quantization == "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's quantized weights, but {files.path} is a Hugging "
                         "Face folder: pass a .gguf file, or --quantization int8 / q4_0 to quantize this checkpoint")
    if files.gguf is None or quantization not in (None, "gguf"):
        return False
    reason = ("the native kernels are not available (see the warning above)" if native.load() is None
              else "they run on CPU only" if device.type != "cpu"
              else "tensor parallelism shards dequantized weights" if sharded
              else None)
    if reason is not None and quantization == "gguf":
        raise ValueError(f"--quantization gguf cannot keep the GGUF weights quantized: {reason}; leave "
                         "--quantization unset to dequantize them into --dtype")
    if reason is not None:
        logger.info("GGUF weights are dequantized into the model's dtype: %s", reason)
    return reason is None


def check_quantization(quantization: str | None, device: torch.device, files: ModelFiles | None = None) -> None:
    """ValueError where --quantization int8/q4_0 cannot run here, or would quantize a GGUF file's
    already quantized weights a second time (each rounding loses accuracy the file's own blocks keep)."""
    if quantization in QUANTIZERS and files is not None and files.gguf is not None:
        types = gguf_file.quantized_types(files.gguf)
        if types:
            counts = ", ".join(f"{plural(n, 'tensor')} of {t}" for t, n in types.most_common())
            raise ValueError(
                f"--quantization {quantization} quantizes 16/32-bit weights, but {files.gguf.name} is already "
                f"quantized ({counts}): quantizing its dequantized weights again compounds two roundings. "
                "Leave --quantization unset to run the file's own blocks, or give a float checkpoint (a Hugging "
                "Face folder, or an F16/BF16/F32 GGUF file)")
    if quantization in QUANTIZERS and (device.type != "cpu" or native.load() is None):
        raise ValueError(f"--quantization {quantization} runs on the native CPU kernels, which "
                         f"{'do not run on ' + device.type if device.type != 'cpu' else 'are not available here'}"
                         "; leave --quantization unset")


# The initialisers nn.Linear and nn.Embedding draw their starting weights with.
_RANDOM_INITS = ("kaiming_uniform_", "kaiming_normal_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_",
                 "xavier_normal_")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Build a model without drawing random starting weights: every parameter is then loaded from the
    checkpoint (load_weights refuses a checkpoint that misses one) or drawn by ``load_format="dummy"``,
    and drawing them took seconds of every start. It replaces ``torch.nn.init``'s functions for the
    whole process while the model is built: the loader runs before the engine starts any thread."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in _RANDOM_INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def load_model(
    files: ModelFiles, config: PretrainedConfig, dtype: torch.dtype, device: torch.device, load_format: str,
    max_position: int, shard: Callable[[LlamaForCausalLM], None] | None = None, quantization: str | None = None,
    batch_invariant: bool = True, rename: Callable[[Iterator[tuple[str, Any]]], Iterator[Any]] | None = None,
    lora: bool = False,
) -> LlamaForCausalLM:
    """The model with its weights. ``shard``: cuts the model to one tensor-parallel rank's share, in
    place (distributed/sharding.py's ``shard_model_`` for that rank), from the whole weights before
    they are packed. ``quantization``: as ``--quantization``; ``batch_invariant``: as
    ``--batch-invariant``, how quantized layers multiply (model/quant_linear.py); ``rename``: the
    checkpoint's (name, tensor) pairs on their way to the model (the pooling runner's decoders);
    ``lora``: adapters will add to the MLP's gate and up projections, so they are packed apart."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    check_quantization(quantization, device, files)
    keep_blocks = load_format != "dummy" and keeps_gguf_blocks(files, quantization, device, shard is not None)
    cls = model_class_for(getattr(config, "architectures", None))
    with torch.device(device), _no_random_init():
        model = cls(config, max_position=max_position)
    # Parameters only: the rotary tables (buffers) stay float32 and are cast per use.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    continue
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02).to(p.dtype))
    else:
        with torch.no_grad():
            weights = (gguf_file.iterate_weights(files.gguf, config, dtype, keep_blocks) if files.gguf is not None
                       else iterate_weights(files.folder))
            model.load_weights(weights if rename is None else rename(weights))
    model.eval()
    if shard is not None:
        shard(model)
    parts = getattr(model, "quantized_parts", None)
    if parts:
        count = install_quantized(model, parts, batch_invariant)
        types = Counter(s.type_name for m in model.modules() if isinstance(m, QuantLinear) for s in m.segments)
        logger.info("%d linear layers keep the GGUF file's quantized blocks (%s)", count,
                    ", ".join(f"{n} {t}" for t, n in types.most_common()))
    if hasattr(model, "quantized_parts"):
        del model.quantized_parts
    if quantization in QUANTIZERS:
        count = quantize_linear_layers(model, quantization, batch_invariant)
        logger.info("quantized %d linear layers to %s at load", count, quantization)
    pack_linear_layers(model, dtype, device, gated=not lora)
    if batch_invariant and device.type == "cpu":
        pad_linear_rows(model)  # the layers left to PyTorch's matmul
    return model
