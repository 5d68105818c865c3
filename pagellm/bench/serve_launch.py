"""How `pagellm bench serve` launches each server it compares (pagellm, transformers, vLLM,
llama-server) and stops it."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench import BenchError, peers
from pagellm.bench.servers import free_port, wait_healthy
from pagellm.model import gguf_file
from pagellm.model.loader import ModelFiles


def pagellm_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--port", str(port), "--dtype", args.dtype,
           "--kv-cache-memory", args.kv_cache_memory, "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd


def _transformers_cli() -> str:
    """transformers' own console script: the one installed beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("transformers")
    cli = str(beside) if beside.exists() else shutil.which("transformers")
    if cli is None:
        raise BenchError("--server transformers needs the `transformers` command; it was not found beside "
                         f"{sys.executable} nor on PATH")
    if importlib.util.find_spec("accelerate") is None:
        raise BenchError("--server transformers needs `accelerate` (transformers serve loads models with it): "
                         "pip install 'pagellm[bench]'")
    return cli


def _transformers_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    return [_transformers_cli(), "serve", model, "--continuous-batching", "--device", "cpu", "--dtype", args.dtype,
            "--host", "127.0.0.1", "--port", str(port)]


# name -> (launch command of pagellm's own venv, accepts vLLM's ignore_eos extension); vllm and
# llama-server are launched from outside it (plan_server).
SERVERS: dict[str, tuple[Callable[[str, int, argparse.Namespace], list[str]], bool]] = {
    "pagellm": (pagellm_command, True),
    "transformers": (_transformers_command, False),
}


@dataclass
class ServerPlan:
    """How one server is launched: its command, environment, the model name it serves under, and the
    settings recorded beside its results."""

    name: str
    command: list[str]
    url: str
    served: str
    ignore_eos: bool
    start_timeout: float
    env: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Peers:
    """What the launched servers need beyond the model, found before any work."""

    vllm_python: Path | None = None
    llama_server: Path | None = None


def find_peers(servers: list[str], args: argparse.Namespace) -> Peers:
    """The peers' paths and the tools the flags need; ValueError (a usage error) naming what is missing."""
    found = Peers()
    if args.base_url is not None:
        return found
    if "vllm" in servers:
        found.vllm_python = peers.find_vllm_python(args.vllm_python)
    elif args.vllm_python is not None:
        raise ValueError("--vllm-python points at vLLM for --server vllm, which is not among the servers")
    if "llama-server" in servers:
        found.llama_server = peers.find_llama_server(args.llama_server)
        if args.model and not gguf_file.is_gguf_file(args.model):
            raise ValueError(f"--server llama-server serves GGUF files only, got --model {args.model!r}: pass a "
                             "GGUF file (e.g. `pagellm default-model`), which every other server then runs too")
        if not args.model:
            raise ValueError("--server llama-server serves GGUF files only: pass --model FILE.gguf (e.g. "
                             "`pagellm default-model`), which every other server then runs too")
    elif args.llama_server is not None or args.llama_server_flags is not None:
        raise ValueError("--llama-server/--llama-server-flags are for --server llama-server, which is not among "
                         "the servers")
    if "transformers" in servers:
        _transformers_cli()  # missing tools are found now, not after the pagellm server's run
    return found


def _hf_folder(files: ModelFiles) -> Path:
    """A Hugging Face folder with weights of the model: itself, or for a GGUF file its bfloat16 export."""
    if files.gguf is None:
        return files.folder
    return peers.hf_folder_of_gguf(files.gguf, files.folder)


def plan_server(server: str, files: ModelFiles, args: argparse.Namespace, found: Peers, streams: int,
          longest: int) -> ServerPlan:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    timeout = args.start_timeout or 180.0
    if server == "pagellm":
        served = args.served_model_name or str(files.path)
        command = pagellm_command(str(files.path), port, args)
        if args.served_model_name:
            command += ["--served-model-name", served]
        return ServerPlan(server, command, url, served, True, timeout,
                          settings={"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
                                    "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                                    "max_num_batched_tokens": args.max_num_batched_tokens})
    if server == "transformers":
        folder = str(_hf_folder(files))
        return ServerPlan(server, _transformers_command(folder, port, args), url,
                          args.served_model_name or folder, False, timeout,
                          settings={"dtype": args.dtype, "model_folder": folder})
    if server == "vllm":
        assert found.vllm_python is not None
        hf = _hf_folder(files)
        served = args.served_model_name or str(files.path)
        vs = peers.VllmSettings(max_model_len=max(2048, -(-longest // 256) * 256),
                                kv_cache_gib=args.vllm_kv_cache_gib, threads_bind=args.vllm_threads_bind)
        return ServerPlan(server, peers.vllm_command(found.vllm_python, hf, served, port, vs), url, served, True,
                          args.start_timeout or 1800.0, env=vs.env(),
                          settings={**vs.record(), "python": str(found.vllm_python), "model_folder": str(hf),
                                    "version": peers.vllm_version(found.vllm_python)})
    if server == "llama-server":
        assert found.llama_server is not None and files.gguf is not None
        served = args.served_model_name or str(files.path)
        ls = peers.LlamaServerSettings.for_load(streams, longest, args.llama_server_flags)
        return ServerPlan(server, peers.llama_server_command(found.llama_server, files.gguf, served, port, ls), url,
                          served, True, timeout,
                          settings={**ls.record(), "binary": str(found.llama_server),
                                    "version": peers.llama_server_version(found.llama_server)})
    raise ValueError(f"unknown server {server!r}")


def launch_server(plan: ServerPlan, args: argparse.Namespace) -> tuple[subprocess.Popen, Path]:
    """Start ``plan``'s server, its output going to ``server-<name>.log`` in the output folder. In a
    session of its own, so that :func:`stop_server` ends its children too (vLLM's engine and workers)."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.output_dir / f"server-{plan.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(plan.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **plan.env},
                                start_new_session=True)
    try:
        wait_healthy(plan.url, proc, timeout=plan.start_timeout)
    except RuntimeError as e:
        stop_server(proc)
        raise BenchError(f"{plan.name}: {e}; its output is in {log_path}") from None
    return proc, log_path


def stop_server(proc: subprocess.Popen) -> None:
    """End a launched server and its process group: SIGTERM, then SIGKILL after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
