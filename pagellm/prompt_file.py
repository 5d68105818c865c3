"""``--preload-prompts FILE``: the prompts a file holds."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a file: a JSON list of strings, or one prompt per line."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--preload-prompts file {path!r} does not exist")
    text = file.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--preload-prompts file {path!r} is not a valid JSON list: {e}") from e
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"--preload-prompts file {path!r} must hold a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]
