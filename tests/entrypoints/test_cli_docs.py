"""docs/cli.md is what the parsers generate: a flag added, renamed or re-documented changes the page."""

from __future__ import annotations

from pagellm.config import EngineArgs
from pagellm.entrypoints import cli_docs


def test_docs_cli_md_is_what_the_parsers_generate():
    assert cli_docs.main(["--check"]) == 0, "docs/cli.md is out of date: run `make docs-cli`"


def test_every_engine_and_server_flag_is_on_the_page():
    page = cli_docs.render()
    for name in ("--structured-outputs-max-bytes", "--api-key", "--max-logprobs", "--enable-fastapi-docs"):
        assert f"`{name}`" in page, name
    fields = [f.name for f in EngineArgs.__dataclass_fields__.values()]
    assert all(f"`--{f.replace('_', '-')}`" in page for f in fields)
