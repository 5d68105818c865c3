"""The ``pagellm`` command: ``pagellm generate [--model PATH] [flags] PROMPT...``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from pagellm.config import EngineArgs
from pagellm.sampling_params import SamplingParams

# Sampling flags of `generate`: flag -> (SamplingParams field, type, help).
SAMPLING_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-tokens": ("max_tokens", int, "new tokens per completion (default 16)"),
    "--min-tokens": ("min_tokens", int, "generate at least this many tokens before EOS or stop"),
    "--temperature": ("temperature", float, "0 is greedy (default 1.0)"),
    "--top-p": ("top_p", float, "nucleus sampling mass, (0, 1]"),
    "--top-k": ("top_k", int, "keep the k most likely tokens; 0 disables"),
    "--min-p": ("min_p", float, "drop tokens less likely than min_p times the most likely"),
    "--repetition-penalty": ("repetition_penalty", float, "> 1 discourages repeats"),
    "--presence-penalty": ("presence_penalty", float, "[-2, 2]"),
    "--frequency-penalty": ("frequency_penalty", float, "[-2, 2]"),
    "--n": ("n", int, "completions per prompt"),
    "--sampling-seed": ("seed", int, "per-request sampling seed"),
    "--logprobs": ("logprobs", int, "also print the top N logprobs of each token"),
}


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("sampling")
    for flag, (dest, typ, help) in SAMPLING_FLAGS.items():
        s.add_argument(flag, dest=f"sp_{dest}", type=typ, default=None, help=help)
    s.add_argument("--stop", dest="sp_stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", dest="sp_ignore_eos", action="store_true", default=None)
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.llm import LLM

    fields = {k[3:]: v for k, v in vars(args).items() if k.startswith("sp_") and v is not None}
    params = SamplingParams(**fields)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)  # type: ignore[arg-type]
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs):
        print(f"Prompt: {prompt!r}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}Completion: {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
            if c.logprobs:
                for pos, entry in enumerate(c.logprobs):
                    chosen = c.token_ids[pos]
                    print(f"    {entry[chosen].decoded_token!r}: {entry[chosen].logprob:.4f}")
        print()
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pagellm.bench import memory, serve, throughput

    p = sub.add_parser("bench", help="benchmarks against the peers: throughput, serve, memory")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    memory.add_parser(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="PagedAttention LLM inference engine")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from pagellm.entrypoints.openai.api_server import add_serve_parser

    add_serve_parser(sub)
    _add_bench(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pagellm.bench import BenchError

    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2
    except BenchError as e:  # the input was fine; the run could not go on
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
