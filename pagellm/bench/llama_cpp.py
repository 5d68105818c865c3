"""llama.cpp as a peer, through llama-cpp-python: the same GGUF file, the same thread count, one request
at a time (``pagellm bench throughput --backend llama.cpp`` and ``pagellm bench latency``).

llama-cpp-python is an optional extra (``pip install 'pagellm[llama]'``; it builds llama.cpp from
source on install): where it is missing, the backend is skipped with a message saying so. llama.cpp
reads only GGUF files: a Hugging Face folder is refused before any work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.bench.backends import BackendResult
from pagellm.bench.report import progress
from pagellm.bench.workloads import Workload
from pagellm.model import gguf_file

NAME = "llama.cpp"
INSTALL = "pip install 'pagellm[llama]'"


def unavailable() -> str | None:
    """Why llama.cpp cannot run here, or None where llama-cpp-python imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed: {INSTALL} (it builds llama.cpp from source, a few minutes)"
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load
        return f"llama-cpp-python does not load ({e}): reinstall it with {INSTALL}"
    return None


def check_gguf(model: str | Path) -> None:
    """ValueError unless ``model`` is a GGUF file (all llama.cpp reads)."""
    if not gguf_file.is_gguf_file(model):
        raise ValueError(f"--backend {NAME} needs a GGUF file as the model (llama.cpp reads nothing else), got "
                         f"{str(model)!r}: pass a .gguf file, which pagellm then runs too")


def load(model: Path, n_ctx: int, threads: int) -> Any:
    """The GGUF file in llama.cpp: ``n_ctx`` tokens of context, ``threads`` for prefill and decode alike.
    Everything else is llama-cpp-python's default (batches of 512 tokens, a float16 KV cache, flash
    attention off: on this project's 2-core machine it decoded slower with it on)."""
    from llama_cpp import Llama

    return Llama(model_path=str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0,
                 verbose=False)


def settings(llm: Any) -> dict[str, Any]:
    """What a run of ``llm`` used, for the results: version, context, batch sizes, threads, flash attention."""
    import llama_cpp

    p = llm.context_params
    return {"llama_cpp_python": str(llama_cpp.__version__), "n_ctx": llm.n_ctx(), "n_batch": p.n_batch,
            "n_ubatch": p.n_ubatch, "n_threads": p.n_threads, "n_threads_batch": p.n_threads_batch,
            "flash_attn": p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED}


@dataclass
class Generation:
    """One request's tokens and its two phases: prompt in to first token out (prefill and the first
    sample), and first token to last (decode)."""

    tokens: list[int]
    ttft_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time they took."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def generate(llm: Any, prompt: list[int], max_tokens: int, temperature: float = 0.0,
             seed: int | None = None) -> Generation:
    """``max_tokens`` tokens after the token ids ``prompt``, past any end-of-sequence token (as
    ``ignore_eos``): greedy at temperature 0, else plain sampling (no top-k, top-p, min-p or penalty)."""
    llm.reset()  # the whole prompt is computed again: llama-cpp-python would reuse a matching prefix
    if seed is not None:
        llm.set_seed(seed)
    tokens: list[int] = []
    t0 = first = time.perf_counter()
    # llama-cpp-python's generator never stops by itself (create_completion is what checks EOS).
    for token in llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return Generation(tokens, first - t0, time.perf_counter() - first)


def run_llama_cpp(model: Path, workload: Workload, threads: int) -> BackendResult:
    """The workload through llama.cpp one request at a time, as ``run_hf``: greedy (sampling, seeded, for
    ``n`` > 1 samples per prompt), each request's exact output length, ``threads`` threads."""
    why = unavailable()
    if why is not None:
        return BackendResult(NAME, 0.0, workload.num_requests, workload.prompt_tokens, 0, skipped=why)
    n_ctx = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    llm = load(model, n_ctx, threads)
    used = settings(llm)
    temperature = 1.0 if workload.n > 1 else 0.0
    produced, ttfts, decode = 0, [], []
    try:
        generate(llm, workload.prompts[0][:8], 2)  # warm-up
        with progress(NAME, workload.num_requests) as bar:
            t0 = time.perf_counter()
            for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
                for j in range(workload.n):
                    g = generate(llm, prompt, out_len, temperature, seed=i * workload.n + j)
                    produced += len(g.tokens)
                    ttfts.append(g.ttft_s)
                    decode.append(g.decode_tok_s)
                bar.update(1)
            elapsed = time.perf_counter() - t0
    finally:
        llm.close()  # now: left to interpreter exit, llama-cpp-python's finalizer fails noisily
    detail = {"ttft_mean_s": sum(ttfts) / len(ttfts), "decode_tok_s": decode, **used}
    return BackendResult(NAME, elapsed, workload.num_requests, workload.prompt_tokens, produced, detail)
