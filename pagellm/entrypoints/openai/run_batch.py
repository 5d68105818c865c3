"""The flags of ``pagellm run-batch`` (vLLM's ``run-batch``), kept apart from the runner so that building
the parser imports neither torch nor FastAPI."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagellm.config import EngineArgs
from pagellm.entrypoints.openai.cli_args import REASONING_PARSERS, TOOL_CALL_PARSERS

HELP = "run a file of OpenAI batch requests (JSON lines) offline, as the server would answer them"
DESCRIPTION = (
    "Each line of the input is one request of OpenAI's batch file format: {\"custom_id\", \"method\": \"POST\", "
    "\"url\": \"/v1/completions\" or \"/v1/chat/completions\", \"body\": {...}}. Each is answered as `pagellm serve` "
    "would (the same checks and errors) and its result written to the output as it finishes: {\"id\", "
    "\"custom_id\", \"response\": {\"status_code\", \"request_id\", \"body\"}, \"error\"}. A line that fails "
    "gets its error in its result; the others go on.")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("run-batch", help=HELP, description=DESCRIPTION)
    p.add_argument("-i", "--input-file", required=True,
                   help="the requests: a JSON lines file in OpenAI's batch format (empty lines are skipped)")
    p.add_argument("-o", "--output-file", required=True,
                   help="where the results go, one JSON line per request in the order they finish (match them "
                        "to the requests by custom_id); written over")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("requests")
    s.add_argument("--response-role", default="assistant",
                   help="the role of chat responses' messages (with add_generation_prompt false: the last message's)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, used instead of the "
                        "tokenizer's own (default: the tokenizer's)")
    s.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="how the chat template reads a message's content, as serve's flag")
    s.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call format, as serve's flag")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a reasoning model's thinking from its answer, as serve's flag")
    s.add_argument("--strict-requests", action="store_true",
                   help="a request with a field no OpenAI or vLLM body defines fails (default: such fields are "
                        "ignored, with a warning, as serve does)")
    s.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="the most requests of the file in the engine at once (default: twice --max-num-seqs)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    source = Path(args.input_file)
    if not source.is_file():
        raise FileNotFoundError(f"--input-file {args.input_file!r} is not a file")
    target = Path(args.output_file)
    if target.is_dir() or not target.absolute().parent.is_dir():
        raise NotADirectoryError(f"--output-file {args.output_file!r} cannot be written: give a file in an "
                                 "existing folder")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise ValueError(f"--max-concurrent-requests must be >= 1, got {args.max_concurrent_requests}")
    if not args.response_role.strip():
        raise ValueError("--response-role must be a role name such as assistant, got an empty string")
    # The server stack (torch, FastAPI's handlers) once the flags are checked: `run-batch --help` imports neither.
    from pagellm.entrypoints.openai.batch_runner import run_batch_command

    return run_batch_command(args)
