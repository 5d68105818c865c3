"""`pagellm bench throughput --workload rag`: the KV tier on disk (``--kv-offload-dir``) across restarts.

Each repeat runs four processes (``rag_phase.py``), one after the other:

1. cold: the rag workload's requests one at a time on a fresh engine whose tier folder is empty (it
   fills the folder as it stops);
2. warm: the same requests on a new process pointed at that folder: TTFT against cold's, and the
   greedy tokens, which must be the same;
3. and 4. W1 (``--model-preset``'s random workload, batched) without the tier, then with it on an
   empty folder that never hits: what the tier costs when every lookup misses.

The ratios are taken per repeat and their median printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagellm.bench.rag_workload import rag_workload
from pagellm.bench.report import write_json
from pagellm.bench.workloads import Workload
from pagellm.model.default_model import default_model_path
from pagellm.model.loader import resolve_model_files
from pagellm.text import plural


def add_rag_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rag-docs", type=int, default=10, help="rag: documents the questions are about")
    p.add_argument("--rag-requests", type=int, default=50, help="rag: questions (requests), the documents in turn")
    p.add_argument("--rag-doc-len", type=int, nargs=2, default=(2000, 4000), metavar=("MIN", "MAX"),
                   help="rag: document lengths in tokens, drawn uniformly")
    p.add_argument("--rag-answer-len", type=int, default=16, help="rag: most tokens per answer (greedy)")
    p.add_argument("--kv-offload-size", default="16GiB", help="rag: the KV tier's size (default 16GiB)")
    p.add_argument("--repeats", type=int, default=3, help="rag: repeats of the four runs (the median is reported)")


def check_rag_args(args: argparse.Namespace) -> None:
    for flag, value in (("--rag-docs", args.rag_docs), ("--rag-requests", args.rag_requests),
                        ("--rag-answer-len", args.rag_answer_len), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    low, high = args.rag_doc_len
    if not 1 <= low <= high:
        raise ValueError(f"--rag-doc-len MIN MAX needs 1 <= MIN <= MAX, got {low} {high}")


def _run_process(spec: dict[str, Any], folder: Path, name: str) -> dict[str, Any]:
    """Run ``spec`` in a new interpreter (``rag_phase.py``); its results."""
    spec = {**spec, "out": str(folder / f"{name}.out.json"), "label": name}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, "-m", "pagellm.bench.rag_phase", str(path)], check=True)
    return dict(json.loads(Path(spec["out"]).read_text()))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_rag(args: argparse.Namespace, w1_model: Path, w1: Workload, engine_kwargs: dict[str, Any]) -> int:
    """The rag benchmark (see the module's docstring); ``w1_model`` and ``w1``: the miss-cost workload,
    ``engine_kwargs``: the engine flags of every run."""
    from transformers import AutoTokenizer

    check_rag_args(args)
    model = Path(args.model) if args.model else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_files(str(model)).folder))
    workload = rag_workload(tokenizer, args.rag_requests, args.rag_docs, tuple(args.rag_doc_len), args.rag_answer_len,
                            args.seed)
    doc_of = workload.meta["doc_of"]
    first_of_doc = [i for i, d in enumerate(doc_of) if d not in doc_of[:i]]
    print(f"rag: {plural(workload.num_requests, 'request')} about {plural(len(first_of_doc), 'document')} of "
          f"{min(workload.meta['doc_tokens'])}-{max(workload.meta['doc_tokens'])} tokens, one at a time, greedy, "
          f"<= {args.rag_answer_len} tokens each; model {model.name} ({args.dtype}); each run in its own process, "
          f"{plural(args.repeats, 'repeat')}")
    rag_spec = {"kind": "rag", "model": str(model), "dtype": args.dtype, "threads": args.threads,
                "workload": {"name": workload.name, "prompts": workload.prompts, "output_lens": workload.output_lens}}
    w1_spec = {"kind": "w1", "model": str(w1_model), "dtype": args.dtype, "threads": args.threads,
               "workload": {"name": w1.name, "prompts": w1.prompts, "output_lens": w1.output_lens}}
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="pagellm-rag-") as tmp:
            folder = Path(tmp)
            tier = {**engine_kwargs, "kv_offload_dir": str(folder / "tier"), "kv_offload_size": args.kv_offload_size}
            empty = {**tier, "kv_offload_dir": str(folder / "empty-tier")}
            cold = _run_process({**rag_spec, "engine_kwargs": tier}, folder, f"cold-{r + 1}")
            warm = _run_process({**rag_spec, "engine_kwargs": tier}, folder, f"warm-{r + 1}")
            off = _run_process({**w1_spec, "engine_kwargs": engine_kwargs}, folder, f"w1-no-tier-{r + 1}")
            on = _run_process({**w1_spec, "engine_kwargs": empty}, folder, f"w1-empty-tier-{r + 1}")
            tier_bytes = sum(f.stat().st_size for f in (folder / "tier").rglob("*.kv"))
        run = {
            "cold": cold, "warm": warm, "w1_no_tier": off, "w1_empty_tier": on, "tier_bytes": tier_bytes,
            "ttft_cold_s": _mean(cold["ttft_s"]), "ttft_warm_s": _mean(warm["ttft_s"]),
            "ttft_first_cold_s": _mean([cold["ttft_s"][i] for i in first_of_doc]),
            "ttft_first_warm_s": _mean([warm["ttft_s"][i] for i in first_of_doc]),
            "identical": sum(a == b for a, b in zip(cold["tokens"], warm["tokens"])),
            "differing_requests": [i for i, (a, b) in enumerate(zip(cold["tokens"], warm["tokens"])) if a != b],
            "w1_tok_s_no_tier": off["output_tokens_per_s"], "w1_tok_s_empty_tier": on["output_tokens_per_s"],
        }
        run["ttft_ratio"] = run["ttft_cold_s"] / run["ttft_warm_s"]
        run["ttft_first_ratio"] = run["ttft_first_cold_s"] / run["ttft_first_warm_s"]
        run["miss_cost"] = 1 - run["w1_tok_s_empty_tier"] / run["w1_tok_s_no_tier"]
        runs.append(run)
        print(f"repeat {r + 1}: TTFT cold {run['ttft_cold_s']:.3f} s, warm {run['ttft_warm_s']:.3f} s "
              f"({run['ttft_ratio']:.1f}x; first question about each document {run['ttft_first_cold_s']:.3f} s vs "
              f"{run['ttft_first_warm_s']:.3f} s, {run['ttft_first_ratio']:.1f}x); outputs identical "
              f"{run['identical']}/{workload.num_requests}; W1 "
              f"{run['w1_tok_s_no_tier']:.1f} tok/s without the tier, {run['w1_tok_s_empty_tier']:.1f} with an "
              f"empty one ({run['miss_cost']:+.1%})", flush=True)
        if r + 1 < args.repeats:  # (a long benchmark: what is done so far is kept if it is stopped)
            report(args, workload, model, runs, final=False)
    return report(args, workload, model, runs)


def report(args: argparse.Namespace, workload: Workload, model: Path, runs: list[dict[str, Any]],
           final: bool = True) -> int:
    """Print the medians and ratios (``final``), write the JSON of the runs so far; 0."""
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    same = all(r["identical"] == workload.num_requests for r in runs)
    tokens = [r["cold"]["tokens"] for r in runs] + [r["warm"]["tokens"] for r in runs]
    summary = {
        "ttft_cold_s": med("ttft_cold_s"), "ttft_warm_s": med("ttft_warm_s"), "ttft_ratio": med("ttft_ratio"),
        "ttft_first_cold_s": med("ttft_first_cold_s"), "ttft_first_warm_s": med("ttft_first_warm_s"),
        "ttft_first_ratio": med("ttft_first_ratio"), "outputs_identical": same,
        "outputs_identical_across_repeats": all(t == tokens[0] for t in tokens),
        "w1_tok_s_no_tier": med("w1_tok_s_no_tier"), "w1_tok_s_empty_tier": med("w1_tok_s_empty_tier"),
        "miss_cost": med("miss_cost"), "tier_bytes": med("tier_bytes"),
        "warm_load_s": statistics.median(r["warm"]["load_s"] for r in runs),
        "cold_load_s": statistics.median(r["cold"]["load_s"] for r in runs),
    }
    n = len(runs)
    stem = f"throughput-rag-{model.stem if model.is_file() else model.name}"
    payload = {"command": "throughput", "workload": {"name": "rag", "num_requests": workload.num_requests,
                                                     "prompt_tokens": workload.prompt_tokens, **workload.meta},
               "model": model.name, "dtype": args.dtype, "repeats": n, "summary": summary,
               "runs": [{k: v for k, v in r.items() if k not in ("cold", "warm")}
                        | {"cold": _brief(r["cold"]), "warm": _brief(r["warm"])} for r in runs],
               "date": time.strftime("%Y-%m-%d")}
    written = write_json(args.output_dir / f"{stem}.json", payload)
    if not final:
        return 0
    print(f"\nmedian of {n}: mean TTFT cold {summary['ttft_cold_s']:.3f} s, warm tier {summary['ttft_warm_s']:.3f} s: "
          f"{summary['ttft_ratio']:.1f}x lower (target >= 5x); first question about each document "
          f"{summary['ttft_first_cold_s']:.3f} s vs {summary['ttft_first_warm_s']:.3f} s "
          f"({summary['ttft_first_ratio']:.1f}x)")
    print(f"outputs identical cold vs warm: {'yes' if same else 'NO'} "
          f"({', '.join(str(r['identical']) for r in runs)} of {workload.num_requests})")
    print(f"tier cost when every lookup misses (W1): {summary['w1_tok_s_no_tier']:.1f} tok/s without, "
          f"{summary['w1_tok_s_empty_tier']:.1f} with an empty tier: {summary['miss_cost']:+.1%} "
          f"(target < 3%); tier filled {summary['tier_bytes'] / 2**20:.0f} MiB")
    print(f"\nwrote {written}")
    return 0


def _brief(phase: dict[str, Any]) -> dict[str, Any]:
    """A rag run's results without the tokens (kept: their count)."""
    return {k: v for k, v in phase.items() if k != "tokens"} | {"output_tokens": sum(map(len, phase["tokens"]))}
