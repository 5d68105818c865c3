"""Single stream on input-grounded tasks (rewrite a passage with a small edit, summarise with quotes, edit
code): decode tok/s of pagellm without and with speculation (n-gram, or a draft model's), and of llama.cpp's
server on the same GGUF file, same prompt tokens, greedy; checks that speculation leaves the tokens unchanged.

Each task is chat-templated once (the model's template) and sent to every backend as token ids; pagellm
stops at the end-of-sequence token, and the other backends then generate exactly as many tokens. Decode
tok/s counts the tokens after the first over the time they took. Backends take turns within each run.

    python benchmarks/spec_decode_grounded.py [--runs 3] [--llama-server build/bin/llama-server] \
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}']
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import embedded_gguf_path

PASSAGE = (
    "The library on Harbour Street opens at nine in the morning and closes at seven in the evening, except on "
    "Sundays, when it opens at noon. Members may borrow up to twelve books at a time for three weeks, and renew "
    "them twice online. The reading room on the first floor has forty desks, each with a lamp and a power "
    "socket, and the cafe beside the entrance serves coffee, tea and sandwiches until six."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
TASKS = {
    "rewrite": f"Rewrite the following text exactly, changing only 'library' to 'museum':\n\n{PASSAGE}",
    "summary": f"Summarise the following text in three sentences, quoting its exact words where you can:\n\n{PASSAGE}",
    "code": f"Rename the function total_price to order_total in this code and return the whole code:\n\n{CODE}",
}
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama.cpp's server on the GGUF file: /completion with token ids, its own decode timings."""

    def __init__(self, binary: str, model: str, threads: int, ctx: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "-m", model, "--port", str(self.port), "--host", "127.0.0.1", "-t", str(threads),
             "-tb", str(threads), "-c", str(ctx), "-np", "1", "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return list(out.get("tokens", [])), float(out["timings"]["predicted_per_second"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def pagellm_decode(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens),
                       use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    tokens = list(out.outputs[0].token_ids)
    return tokens, (len(tokens) - 1) / (m.finished_time - m.first_token_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (skipped without)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    model = args.model or str(embedded_gguf_path())
    spec = json.loads(args.speculative_config)
    label = "pagellm+" + ("ngram" if spec.get("method", "ngram" if "model" not in spec else "") == "ngram" else "draft")
    plain = LLM(model, max_model_len=2048)
    speculative = LLM(model, max_model_len=2048, speculative_config=spec)
    tokenizer = plain.get_tokenizer()
    prompts = {name: list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                        return_dict=False))
               for name, text in TASKS.items()}
    server = LlamaServer(args.llama_server, model, args.threads, 2048) if args.llama_server else None
    results: dict[str, Any] = {}
    try:
        for name, prompt in prompts.items():
            pagellm_decode(plain, prompt, 8), pagellm_decode(speculative, prompt, 8)  # warm up
            rates: dict[str, list[float]] = {"pagellm": [], label: [], "llama.cpp": []}
            same = True
            for run in range(args.runs):
                order = ["plain", "spec"] if run % 2 == 0 else ["spec", "plain"]
                got = {}
                for which in order:
                    llm = plain if which == "plain" else speculative
                    got[which], rate = pagellm_decode(llm, prompt, args.max_tokens)
                    rates["pagellm" if which == "plain" else label].append(rate)
                same = same and got["plain"] == got["spec"]
                if server is not None:
                    rates["llama.cpp"].append(server.decode(prompt, len(got["plain"]))[1])
            stats = speculative.llm_engine.get_stats()
            row = {k: statistics.median(v) for k, v in rates.items() if v}
            row.update(tokens=len(got["plain"]), identical=same, runs=rates,
                       acceptance=stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_draft_tokens))
            results[name] = row
            ratio = row[label] / row["pagellm"]
            llama = f"  llama.cpp {row['llama.cpp']:.1f} tok/s (x{row[label] / row['llama.cpp']:.2f})" \
                if "llama.cpp" in row else ""
            print(f"{name:8s} {row['tokens']:4d} tokens  pagellm {row['pagellm']:.1f} tok/s  {label} "
                  f"{row[label]:.1f} tok/s (x{ratio:.2f}){llama}  identical={same}  "
                  f"accepted {row['acceptance']:.0%}")
    finally:
        if server is not None:
            server.close()
    if args.output:
        args.output.write_text(json.dumps({"model": model, "speculative_config": spec, "tasks": results}, indent=1))


if __name__ == "__main__":
    main()
