"""``--config FILE``: a YAML file of a command's flags, as vLLM's ``vllm serve --config``.

Keys are flag names without the leading dashes (``max-model-len`` and ``max_model_len`` alike; ``model``
is the model); values are YAML scalars, lists for flags that take several values, and mappings for
the flags that take JSON. Each value goes through the flag's own parser (its type, its choices), and
a flag given on the command line wins over the file's.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn


class ConfigFileError(ValueError):
    pass


def read_config_file(path: str) -> dict[str, Any]:
    """The YAML mapping in ``path``; ValueError naming the file and what is wrong."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigFileError(f"--config {path!r} is not a file")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"--config {path!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigFileError(f"--config {path!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path!r} must hold a mapping of flag names to values (such as "
                              f"'port: 8000'), not a {type(data).__name__}")
    return data


def _action_for(parser: argparse.ArgumentParser, key: Any, path: str) -> argparse.Action:
    if not isinstance(key, str) or not key.strip():
        raise ConfigFileError(f"--config {path!r}: key {key!r} is not a flag name")
    flag = "--" + key.strip().lstrip("-").replace("_", "-")
    action = parser._option_string_actions.get(flag)
    if action is None:
        known = [f for f in parser._option_string_actions if f.startswith("--")]
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        hint = f": did you mean {near[0][2:]}?" if near else f"; see `{parser.prog} --help`"
        raise ConfigFileError(f"--config {path!r}: {key!r} is not a flag of {parser.prog}{hint}")
    if action.dest == "config" or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        raise ConfigFileError(f"--config {path!r}: {key!r} cannot be set in a config file")
    return action


def _words(action: argparse.Action, key: str, value: Any, path: str) -> list[str]:
    """``key: value`` as the command line would say it."""
    long = next(f for f in action.option_strings if f.startswith("--"))
    if value is None:
        raise ConfigFileError(f"--config {path!r}: {key!r} has no value; give one or remove the key")
    if action.nargs == 0:  # store_true, BooleanOptionalAction
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path!r}: {key!r} is a switch: give true or false, got {value!r}")
        if value:
            return [long]
        negative = "--no-" + long[2:]
        if negative in action.option_strings:
            return [negative]
        return []  # a store_true flag left off
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int) or isinstance(action, argparse._ExtendAction)
    if isinstance(value, list) and many:
        if not value:
            raise ConfigFileError(f"--config {path!r}: {key!r} is an empty list; give at least one value")
        return [long, *(_scalar(v, key, path) for v in value)]
    if isinstance(value, (dict, list)):  # the flags that take JSON (--hf-overrides, --allowed-origins)
        return [f"{long}={json.dumps(value)}"]
    return [f"{long}={_scalar(value, key, path)}"]


def _scalar(value: Any, key: str, path: str) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigFileError(f"--config {path!r}: {key!r} takes plain values, got {json.dumps(value)}")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@contextmanager
def _suppressed_defaults(parser: argparse.ArgumentParser, path: str | None) -> Iterator[None]:
    """Defaults suppressed (a parse then holds only what it was given); with ``path``, errors
    raise ConfigFileError naming the file instead of exiting."""
    saved = [(a, a.default) for a in parser._actions]
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    if path is not None:
        def fail(message: str) -> NoReturn:
            raise ConfigFileError(f"--config {path!r}: {message}")

        parser.error = fail  # type: ignore[method-assign]
    try:
        yield
    finally:
        for action, default in saved:
            action.default = default
        if path is not None:
            del parser.error


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations ``argv`` (a command's words) sets."""
    with _suppressed_defaults(parser, None):
        namespace, _ = parser.parse_known_args(list(argv))
    return set(vars(namespace))


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace) -> None:
    """Set on ``args`` (parsed from ``argv`` by ``parser``) the flags of its ``--config`` file that the
    command line does not give; ValueError naming the file, the key and the problem."""
    path = args.config
    data = read_config_file(path)
    words: list[str] = []
    for key, value in data.items():
        action = _action_for(parser, key, path)
        words += _words(action, str(key), value, path)
    with _suppressed_defaults(parser, path):
        from_file = vars(parser.parse_known_args(words)[0])
    explicit = given_on_command_line(parser, argv)
    if getattr(args, "model_tag", None) is not None:
        explicit.add("model")  # `serve MODEL`: the command line's model
    for dest, value in from_file.items():
        if dest not in explicit:
            setattr(args, dest, value)
