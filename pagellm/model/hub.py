"""Model ids from a hub: ``pagellm serve ORG/NAME`` downloads the model through ``huggingface_hub``.

Only the files a model needs come down (its config, tokenizer and generation config, and either its
safetensors or one GGUF file), into the hub's own cache (``HF_HUB_CACHE``, or ``--download-dir``), so
other tools share them. ``HF_TOKEN`` (or ``--hf-token``), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=1``
(the cache only, never the network) are honoured, as ``huggingface_hub`` itself honours them; a file
whose transfer breaks is resumed where it stopped, by the same start or, for the weights, by the next
one (``hub_resume.py``). A GGUF repository's file is picked by the
quantization after a colon (llama.cpp's ``-hf ORG/NAME-GGUF:Q4_K_M``), by ``--gguf-file``, or else
is its Q4_K_M, else the smallest of at least 4 bits.

Every failure is a ``HubError`` (a ValueError: the command line prints it and exits 2) that says what
to do: set ``HF_TOKEN`` for a gated repository, check the id or revision for a 404, download first
for an offline start, free disk space.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.model.hub_resume import DownloadInterrupted, fetch_weights

if TYPE_CHECKING:
    from pagellm.config import EngineArgs

logger = logging.getLogger(__name__)

# What a model needs besides its weights (transformers' file names).
SUPPORT_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt",
                 "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json"]
TOKENIZER_FILES = [f for f in SUPPORT_FILES if f not in ("generation_config.json", "preprocessor_config.json")]
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")
# The bits of a GGUF quantization named in a file name (Q4_K_M, IQ3_XS, F16, BF16, Q8_0, ...).
_QUANT = re.compile(r"(?:^|[-_.])(I?Q(\d)(?:_[A-Z0-9]+)*|F16|BF16|F32)(?=[-_.])", re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class HubError(ValueError):
    """A model id that cannot be had from the hub, and what to do about it."""


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository (``ORG/NAME``, optionally ``:QUANT``) rather than a path."""
    return bool(_ID.fullmatch(model)) and not Path(model).expanduser().exists()


@dataclass
class HubSettings:
    revision: str | None = None
    cache_dir: str | None = None  # --download-dir; None: the hub's cache
    token: str | None = None  # --hf-token; None: HF_TOKEN or the saved login
    gguf_file: str | None = None  # --gguf-file


def local_model_path(args: EngineArgs) -> Path:
    """``args.model`` as a local path: a hub id downloaded (or found in the cache), a path as it is."""
    assert args.model is not None
    if not is_hub_id(args.model):
        return Path(args.model)
    return download_model(args.model, HubSettings(args.revision, args.download_dir, args.hf_token, args.gguf_file))


def local_tokenizer(args: EngineArgs) -> str | None:
    """``args.tokenizer`` as a local folder (a hub id: its tokenizer files downloaded); None: the model's."""
    if args.tokenizer is None or not is_hub_id(args.tokenizer):
        return args.tokenizer
    return str(download_tokenizer(args.tokenizer, HubSettings(args.tokenizer_revision, args.download_dir,
                                                               args.hf_token)))


def download_model(model: str, settings: HubSettings) -> Path:
    """The local path of the hub model ``model``: a snapshot folder, or the GGUF file in it."""
    repo_id, _, tag = model.partition(":")
    revision = settings.revision or "main"
    offline = _offline()
    listing = None if offline else _call(repo_id, revision, lambda: _list_files(repo_id, settings))
    files = listing[0] if listing is not None else None
    patterns = _patterns(repo_id, files, tag or None, settings.gguf_file) if files is not None else None
    if listing is not None and listing[1]:  # the weights first, resumable across starts (hub_resume.py)
        _call(repo_id, revision, lambda: fetch_weights(repo_id, listing[1], list(listing[0]), patterns,
                                                         _storage(settings), _endpoint(), settings.token))
    folder = Path(_call(repo_id, revision, lambda: _snapshot(repo_id, settings, patterns, offline)))
    ggufs = sorted(folder.rglob("*.gguf"))
    if patterns is not None:
        ggufs = [g for g in ggufs if any(fnmatch.fnmatch(g.name, p) for p in patterns)]
    elif tag or settings.gguf_file:  # offline: the cached file of that quantization or name
        ggufs = [g for g in ggufs if _matches(g.name, tag, settings.gguf_file)]
    if ggufs:  # a split file's first part names the model (its parts load as one: gguf_file.gguf_parts)
        return next((g for g in ggufs if _split_part(g.name) in (None, 1)), ggufs[0])
    if not (folder / "config.json").is_file():
        raise HubError(f"{repo_id}: the cached snapshot {folder} holds no config.json and no GGUF file; download it "
                       "again without HF_HUB_OFFLINE")
    return folder


def download_tokenizer(tokenizer: str, settings: HubSettings) -> Path:
    """The local folder of the hub tokenizer ``tokenizer`` (its tokenizer files only)."""
    return Path(_call(tokenizer, settings.revision or "main",
                      lambda: _snapshot(tokenizer, settings, TOKENIZER_FILES, _offline())))


def download_adapter(adapter: str, settings: HubSettings) -> Path:
    """The local folder of the hub LoRA adapter ``adapter`` (its PEFT config and safetensors only)."""
    return Path(_call(adapter, settings.revision or "main", lambda: _snapshot(
        adapter, settings, ["adapter_config.json", "adapter_model.safetensors"], _offline())))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _list_files(repo_id: str, settings: HubSettings) -> tuple[dict[str, int], str | None]:
    """The repository's files at the revision, with their sizes; the revision's commit."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=_endpoint()).model_info(repo_id, revision=settings.revision, files_metadata=True,
                                                  token=settings.token)
    return {s.rfilename: s.size or 0 for s in info.siblings or []}, info.sha


def _storage(settings: HubSettings) -> str:
    """The hub cache the files go to: --download-dir, HF_HUB_CACHE (or HF_HOME's), or the default."""
    from huggingface_hub import constants

    return settings.cache_dir or _cache_dir() or constants.HF_HUB_CACHE


def _snapshot(repo_id: str, settings: HubSettings, patterns: list[str] | None, offline: bool) -> str:
    from huggingface_hub import constants, errors, snapshot_download

    if offline:  # the cache's snapshot of the revision, as other tools left it (never the network)
        storage = Path(settings.cache_dir or _cache_dir() or constants.HF_HUB_CACHE)
        storage /= f"models--{repo_id.replace('/', '--')}"
        revision = settings.revision or "main"
        ref = storage / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        if not (storage / "snapshots" / commit).is_dir():
            raise errors.LocalEntryNotFoundError(f"no cached snapshot of {repo_id} at {revision}")
        logger.info("%s (revision %s): from the cache (HF_HUB_OFFLINE), %s", repo_id, revision, storage)
        return str(storage / "snapshots" / commit)
    logger.info("%s (revision %s): downloading what is missing into %s", repo_id, settings.revision or "main",
                settings.cache_dir or _cache_dir() or constants.HF_HUB_CACHE)
    return str(snapshot_download(repo_id, revision=settings.revision, cache_dir=settings.cache_dir or _cache_dir(),
                                 token=settings.token, allow_patterns=patterns, endpoint=_endpoint()))


def _patterns(repo_id: str, files: dict[str, int], tag: str | None, gguf_file: str | None) -> list[str]:
    """The files to fetch: the support files, and the safetensors or the one GGUF file (all its parts)."""
    ggufs = {f: n for f, n in files.items() if f.endswith(".gguf")}
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    if not tag and not gguf_file and has_safetensors:
        return SUPPORT_FILES + SAFETENSORS
    if not ggufs:
        what = f"no GGUF file{f' of {tag}' if tag else ''}" if (tag or gguf_file) else "no weights pagellm reads"
        raise HubError(f"{repo_id} has {what} (*.safetensors or *.gguf); it holds: {', '.join(sorted(files)) or '-'}")
    chosen = _pick_gguf(repo_id, ggufs, tag, gguf_file)
    split = _SPLIT.search(chosen)
    if split is None:
        return [*SUPPORT_FILES, chosen]
    return [*SUPPORT_FILES, *(f for f in ggufs if f.startswith(chosen[:split.start()]) and _SPLIT.search(f))]


def _pick_gguf(repo_id: str, ggufs: dict[str, int], tag: str | None, gguf_file: str | None) -> str:
    if gguf_file:
        if gguf_file not in ggufs:
            raise HubError(f"{repo_id} has no file {gguf_file!r}; its GGUF files: {', '.join(sorted(ggufs))}")
        return gguf_file
    if tag:
        tagged = sorted(f for f in ggufs if _matches(f, tag, None))
        if not tagged:
            raise HubError(f"{repo_id} has no GGUF file of {tag}; its GGUF files: {', '.join(sorted(ggufs))}")
        chosen, why = tagged[0], f"the {tag} file"
    else:
        q4km = sorted(f for f in ggufs if _matches(f, "Q4_K_M", None))
        usable = {f: n for f, n in ggufs.items() if (_bits(f) or 4) >= 4}  # (a name without a quantization: kept)
        if q4km:
            chosen, why = q4km[0], "no tag given: the repository's Q4_K_M"
        elif usable:
            chosen = min(usable, key=lambda f: _total_size(f, ggufs))
            why = "no tag given and no Q4_K_M: the smallest file of at least 4 bits"
        else:
            raise HubError(f"{repo_id} has only GGUF files below 4 bits ({', '.join(sorted(ggufs))}): name one "
                           "with ORG/NAME:QUANT or --gguf-file")
    logger.info("%s: %s (%s; ORG/NAME:QUANT or --gguf-file picks another)", repo_id, chosen, why)
    return chosen


def _matches(name: str, tag: str | None, gguf_file: str | None) -> bool:
    if gguf_file:
        return name == gguf_file
    return bool(tag) and re.search(rf"(?:^|[-_.]){re.escape(tag or '')}(?=[-_.])", name, re.IGNORECASE) is not None


def _bits(name: str) -> int | None:
    """The bits of the quantization a GGUF file name says (None: it says none)."""
    m = _QUANT.search(name)
    if m is None:
        return None
    return int(m.group(2)) if m.group(2) else {"f16": 16, "bf16": 16, "f32": 32}[m.group(1).lower()]


def _split_part(name: str) -> int | None:
    """The part number of a split GGUF file (``-00002-of-00003.gguf``: 2); None for a whole one."""
    split = _SPLIT.search(name)
    return int(split.group(1)) if split else None


def _total_size(name: str, ggufs: dict[str, int]) -> int:
    """A GGUF file's size, all its parts' for a split one."""
    split = _SPLIT.search(name)
    if split is None:
        return ggufs[name]
    return sum(n for f, n in ggufs.items() if f.startswith(name[:split.start()]))


def _call(repo_id: str, revision: str, fn: Any) -> Any:
    """``fn()``, its hub failures turned into ``HubError`` saying what to do."""
    from huggingface_hub import errors

    try:
        return fn()
    except DownloadInterrupted as e:
        raise HubError(f"{repo_id}: {e}. The {e.kept} bytes that arrived are kept in the hub cache ({e.partial}): "
                       "start again (the same command) to resume the download where it stopped") from e
    except errors.GatedRepoError as e:
        raise HubError(f"{repo_id}: 401 unauthorized: the repository is gated or private; accept its terms on the "
                       "hub, then set HF_TOKEN (or pass --hf-token, or run `hf auth login`)") from e
    except errors.RepositoryNotFoundError as e:
        status = getattr(getattr(e, "response", None), "status_code", 404)
        if status in (401, 403):
            raise HubError(f"{repo_id}: {status}: the repository is private or needs a token: set HF_TOKEN (or pass "
                           "--hf-token)") from e
        raise HubError(f"{repo_id}: 404: no such repository on {_endpoint()} (check the id; a private one needs "
                       "HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise HubError(f"{repo_id}: 404: no revision {revision!r} (a branch, tag or commit of the repository)") from e
    except errors.LocalEntryNotFoundError as e:
        if _offline():
            raise HubError(f"{repo_id} (revision {revision}) is not in the cache and HF_HUB_OFFLINE is set: download "
                           f"it first (unset HF_HUB_OFFLINE, or `hf download {repo_id}`)") from e
        raise _unreachable(repo_id) from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise HubError(f"{repo_id}: the disk filled up while downloading (a file goes into the snapshot only "
                           "once whole, so no half model is left where the next start reads it): free space, or "
                           "pass --download-dir on a larger disk") from e
        raise
    except Exception as e:  # the HTTP client's own connection errors (huggingface_hub's httpx fork)
        if any(c.__name__ in ("TransportError", "TimeoutException") for c in type(e).__mro__):
            raise _unreachable(repo_id) from e
        raise


def _unreachable(repo_id: str) -> HubError:
    return HubError(f"{repo_id}: the hub at {_endpoint()} cannot be reached and the cache lacks the model: check the "
                    "network (or HF_ENDPOINT), or download it where the hub can be reached and set HF_HUB_OFFLINE=1")


def _endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, when first imported)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or str(constants.ENDPOINT)


def _cache_dir() -> str | None:
    """HF_HUB_CACHE (or HF_HOME's) as it is now; None: huggingface_hub's own default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None
