"""The mechanics of draft-model speculation on a synthetic pair (no real draft model for SmolLM2 exists
offline): single-stream greedy decode tok/s of a random target without drafts, with a draft 4x cheaper
that agrees with it, and with the target as its own draft; checks the tokens are the same.

The target has 8 layers of which the last 6 add nothing (their output projections are zero: the
residual stream passes through them), so it computes what its first 2 layers compute at the cost of 8;
the draft is those 2 layers with the same embeddings, norm and head. Real pairs agree less often; this
shows what the step's machinery costs and returns when the draft is cheap and right.

    python benchmarks/spec_decode_draft_mechanics.py [--runs 3] [--max-tokens 128] [-k 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import build_checkpoint

SIZES = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8,
             initializer_range=0.05)


def build_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) folders: the target's layers 2-7 zeroed at their outputs; the draft its first 2."""
    from safetensors.torch import load_file, save_file

    target = build_checkpoint(root / "target", "llama", seed=0, num_hidden_layers=8, **SIZES)
    draft = build_checkpoint(root / "draft", "llama", seed=0, num_hidden_layers=2, **SIZES)
    weights = load_file(str(target / "model.safetensors"))
    for name, tensor in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.")
               or int(k.split(".")[2]) < 2}, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return target, draft


def decode(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    tokens = list(out.outputs[0].token_ids)
    return tokens, (len(tokens) - 1) / (m.finished_time - m.first_token_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=None, help="--threads-per-worker (default: the engine's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_pair(Path(tmp))
        kwargs = dict(max_model_len=512, enable_prefix_caching=False, seed=0, threads_per_worker=args.threads)
        engines = {"plain": LLM(str(target), **kwargs)}
        for name, path in (("draft 2/8 layers", draft), ("target as draft", target)):
            engines[name] = LLM(str(target), speculative_config={"model": str(path), "num_speculative_tokens": args.k},
                                **kwargs)
        prompt = torch.randint(4, 500, (32,), generator=torch.Generator().manual_seed(0)).tolist()
        rates: dict[str, list[float]] = {name: [] for name in engines}
        tokens = {}
        for llm in engines.values():
            decode(llm, prompt, 8)  # warm up
        for _ in range(args.runs):
            for name, llm in engines.items():
                tokens[name], rate = decode(llm, prompt, args.max_tokens)
                rates[name].append(rate)
        base = statistics.median(rates["plain"])
        for name, llm in engines.items():
            stats = llm.llm_engine.get_stats()
            accepted = stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_draft_tokens)
            rate = statistics.median(rates[name])
            print(f"{name:18s} {rate:7.1f} tok/s  x{rate / base:.2f}  drafts accepted {accepted:.0%}  "
                  f"identical={tokens[name] == tokens['plain']}  runs {[round(r, 1) for r in rates[name]]}")


if __name__ == "__main__":
    main()
