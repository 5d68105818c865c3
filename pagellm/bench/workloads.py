"""Benchmark workloads and the random-weight models they run on."""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagellm.model.default_model import cache_dir

logger = logging.getLogger(__name__)

# Model shapes (random weights). `w1-llama` is workload W1's model; `qwen2-0.5b` has Qwen2-0.5B's shape.
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)),
    "w1-llama": ("llama", dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=8)),
    "qwen2-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
}


def build_word_tokenizer(folder: Path, vocab_size: int) -> Any:
    """A word-level tokenizer with one word per model token id, saved to ``folder``.

    Random token ids then always decode to text, so streams carry a chunk per token and
    detokenisation costs what it would with a real tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(special)}
    vocab.update({f"w{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(folder))
    return fast


def build_bpe_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` entries trained on synthetic text (seeded: the same
    vocabulary on every machine), saved to ``folder``: one that can spell JSON, for constrained workloads."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(4 * vocab_size)]
    # Zipf-like word frequencies, and the punctuation of JSON, as text has them.
    cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(words))))
    lines = [" ".join(rng.choices(words, cum_weights=cum, k=12))
             + rng.choice(['", "', '": ', ", ", ".\n", "}, {", "]"]) for _ in range(40_000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(folder))
    return fast


def bench_model_path(preset: str, dtype: str = "bfloat16", bpe: bool = False) -> Path:
    """A saved random-weight checkpoint of ``preset`` (built once, cached), readable by every backend;
    ``bpe``: with a byte-level BPE tokenizer instead of the word-level one (the weights are the same)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(MODEL_PRESETS)}")
    if bpe:
        target = cache_dir() / "bench" / f"{preset}-{dtype}-bpe"
        if not (target / "config.json").is_file():
            words = bench_model_path(preset, dtype)
            tmp = Path(tempfile.mkdtemp(dir=words.parent))
            try:
                for f in ("config.json", "generation_config.json"):
                    if (words / f).is_file():
                        shutil.copy(words / f, tmp / f)
                (tmp / "model.safetensors").symlink_to(words / "model.safetensors")
                build_bpe_tokenizer(tmp, MODEL_PRESETS[preset][1]["vocab_size"])
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    target = cache_dir() / "bench" / f"{preset}-{dtype}"
    if (target / "config.json").is_file():
        if not (target / ".word-tokenizer").exists():  # built before the word-level tokenizer: upgrade it
            build_word_tokenizer(target, MODEL_PRESETS[preset][1]["vocab_size"])
            (target / ".word-tokenizer").touch()
        return target
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, shape = MODEL_PRESETS[preset]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        tokenizer = build_word_tokenizer(tmp, shape["vocab_size"])
        (tmp / ".word-tokenizer").touch()
        config = config_cls(max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
        torch.manual_seed(0)
        model = model_cls(config).to(getattr(torch, dtype))
        model.save_pretrained(str(tmp))
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built benchmark model %s at %s", preset, target)
    return target


@dataclass
class Workload:
    """Requests as token ids with exact output lengths (every backend ignores EOS)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    n: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens) * self.n


def random_workload(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                    seed: int = 0, name: str = "random") -> Workload:
    """Prompt and output lengths uniform in the (inclusive) ranges, random token ids."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num,), generator=g).tolist()
    olens = torch.randint(output_range[0], output_range[1] + 1, (num,), generator=g).tolist()
    # Skip the few special ids at the bottom of the vocabulary.
    prompts = [torch.randint(4, vocab, (p,), generator=g).tolist() for p in plens]
    return Workload(name, prompts, olens, meta={"prompt_range": list(prompt_range), "output_range": list(output_range),
                                                "seed": seed})


def shared_prefix_workload(num: int, prefix_len: int, suffix_range: tuple[int, int], output_range: tuple[int, int],
                           vocab: int, seed: int = 0) -> Workload:
    """Every prompt starts with the same ``prefix_len`` tokens (a system prompt)."""
    base = random_workload(num, suffix_range, output_range, vocab, seed, name="shared-prefix")
    g = torch.Generator().manual_seed(seed + 1)
    prefix = torch.randint(4, vocab, (prefix_len,), generator=g).tolist()
    base.prompts = [prefix + p for p in base.prompts]
    base.meta["prefix_len"] = prefix_len
    return base


def parallel_workload(num: int, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                      seed: int = 0) -> Workload:
    """``n`` samples per prompt (parallel sampling)."""
    base = random_workload(num, prompt_range, output_range, vocab, seed, name=f"parallel-n{n}")
    base.n = n
    base.meta["n"] = n
    return base


# The json-schema workload's constraint: an open-ended list keeps the grammar at work for the whole
# output, as a long extraction would.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "items": {"type": "array", "items": {"type": "object", "properties": {
                       "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
                       "required": ["name", "count"]}}},
    "required": ["title", "items"],
}


def json_schema_workload(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                         seed: int = 0) -> Workload:
    """The random workload with every other request constrained to ``BENCH_SCHEMA``."""
    base = random_workload(num, prompt_range, output_range, vocab, seed, name="json-schema")
    base.meta["constrained"] = [i % 2 == 1 for i in range(num)]
    base.meta["schema"] = BENCH_SCHEMA
    return base
