"""docs/cli.md, written from the parsers themselves: every command's flags, defaults and help.

    python -m pagellm.entrypoints.cli_docs > docs/cli.md     # write it
    python -m pagellm.entrypoints.cli_docs --check           # exit 1 where docs/cli.md differs

A test runs the check, so the page cannot drift from the flags (``make docs-cli`` rewrites it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagellm.entrypoints.cli import build_parser, command_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
HEADER = """# Command-line flags

Generated from the parsers by `python -m pagellm.entrypoints.cli_docs` (`make docs-cli`); a test fails
when this page differs from what it generates. `pagellm COMMAND --help` prints the same. The engine
flags are `EngineArgs`' fields, the same names as vLLM's, and `LLM(**kwargs)` takes them too.
"""


def _cell(text: str) -> str:
    return " ".join(text.replace("%%", "%").replace("|", "\\|").split())


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def _flags(action: argparse.Action) -> str:
    names = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")] + [n for n in names if n.startswith("--no-")]
    if not names:
        return f"`{action.dest}` (positional)"
    return ", ".join(f"`{n}`" for n in names)


# The group every engine-running command shares: listed once, at the top.
ENGINE_GROUP = "engine"


def _table(actions: list[argparse.Action]) -> list[str]:
    return ["| flag | default | meaning |", "| --- | --- | --- |",
            *(f"| {_flags(a)} | {_cell(_default(a))} | {_cell(a.help or '')} |" for a in actions), ""]


def _shown(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    return [a for a in group._group_actions if a.help is not argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _tables(parser: argparse.ArgumentParser, title: str) -> list[str]:
    out = [f"## {title}", ""]
    if parser.description:
        out += [_cell(parser.description), ""]
    for group in parser._action_groups:
        actions = _shown(group)
        if group.title == ENGINE_GROUP and actions:
            out += [f"The [engine flags](#{ENGINE_GROUP}-flags), and:", ""]
        elif actions:
            out += [f"### {group.title}", "", *_table(actions)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out += _tables(child, f"{title} {name}")
    return out


def render() -> str:
    """The whole page."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = command_parser(parser, "serve")
    engine = next(g for g in serve._action_groups if g.title == ENGINE_GROUP)
    lines = [HEADER, f"## {ENGINE_GROUP.capitalize()} flags", "", *_table(_shown(engine))]
    for name in sub.choices:
        lines += _tables(command_parser(parser, name), f"pagellm {name}")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help=f"exit 1 where {DOC} differs from what is generated")
    ns = args.parse_args(argv)
    text = render()
    if ns.check:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run `make docs-cli`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
