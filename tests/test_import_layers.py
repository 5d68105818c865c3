"""The import contracts of pyproject.toml ([tool.importlinter]: docs/architecture.md's layers, no import
cycles, what may not be imported where) hold; `make lint` checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    if not lint_imports.is_file():
        pytest.skip("import-linter is not installed: pip install -c constraints.txt -e '.[test]'")
    run = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
