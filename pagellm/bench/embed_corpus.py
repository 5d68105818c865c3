"""The corpus of `pagellm bench embed`: real passages of mixed lengths, the documentation strings of the
Python standard library (modules, classes, functions and methods), as paragraphs and as whole docstrings,
de-duplicated and drawn in a seeded order. Every interpreter carries it, so every machine benches the same
kind of text without a download."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import random
import sys
import warnings

# Modules that open windows, print, start programs or take long to import: never imported.
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "venv", "lib2to3",
         "pydoc_data", "msilib", "winreg", "winsound", "msvcrt", "nturl2path", "_winapi", "test", "unittest"}
MIN_CHARS = 40


def _docs_of(module: object) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for _, obj in inspect.getmembers(module):
        if (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)) \
                and getattr(obj, "__module__", None) == getattr(module, "__name__", None):
            docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                docs += [inspect.getdoc(m) or "" for name, m in vars(obj).items()
                         if not name.startswith("_") and callable(m)]
    return [d for d in docs if d]


def stdlib_passages(count: int = 2000, seed: int = 0) -> list[str]:
    """``count`` passages (fewer where the standard library has fewer): paragraphs of at least
    ``MIN_CHARS`` characters and whole docstrings, in a seeded random order."""
    docs: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _SKIP:
            continue
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 (a platform's missing module: skipped)
                continue
        docs += _docs_of(module)
    passages = set()
    for doc in docs:
        paragraphs = [p.strip() for p in doc.split("\n\n") if len(p.strip()) >= MIN_CHARS]
        passages.update(paragraphs)
        if len(paragraphs) > 1:
            passages.add(doc.strip())  # the whole docstring too: the long end of the mix
    ordered = sorted(passages)
    random.Random(seed).shuffle(ordered)
    return ordered[:count]
