"""The front door: README.md stays a short page that starts a new user, BENCHMARKS.md a results page,
and every relative link of the README, CONTRIBUTING.md and docs/ leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED_PAGES = [README, ROOT / "CONTRIBUTING.md", *DOCS]

# [text](target) and ![alt](target), the target up to a space (a title) or the closing parenthesis;
# fenced code blocks and inline code are left out first, since shell and Python are full of brackets.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def relative_links(markdown: str) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", markdown))
    targets = [m.group(1) for m in _LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_readme_is_short():
    assert README.stat().st_size < 12 * 1024, "README.md is the front door: move reference material into docs/"


def test_benchmarks_page_is_short():
    assert BENCHMARKS.stat().st_size < 15 * 1024, (
        "BENCHMARKS.md shows the latest table per workload: move replaced sections, verbatim, into a dated "
        "file under benchmarks/results/ (indexed in benchmarks/results/README.md)")


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page: Path):
    missing = []
    for target in relative_links(page.read_text()):
        path = unquote(target.split("#", 1)[0])
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_link_finder_skips_code_and_urls():
    sample = ("[a](docs/a.md) ![p](x.png \"t\") [u](https://e.org) [h](#top) [s](b.md#part) `[c](no.md)`\n"
              "```bash\n[f](fenced.md)\n```\n")
    assert relative_links(sample) == ["docs/a.md", "x.png", "b.md#part"]


def test_readme_has_the_quick_start_commands():
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make test" in quick_start
    assert "make serve" in quick_start and "pagellm serve" in text


def test_readme_indexes_every_docs_page():
    text = README.read_text()
    index = text.split("## Documentation", 1)[1]
    missing = [p.name for p in DOCS if f"](docs/{p.name})" not in index]
    assert not missing, f"README.md's documentation index does not list {missing}"
