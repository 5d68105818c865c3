"""Words in the messages pagellm prints: counts with the noun in the right number."""

from __future__ import annotations

# Nouns whose plural is not the singular plus "s".
_IRREGULAR = {"entry": "entries", "process": "processes", "prefix": "prefixes", "is": "are", "has": "have"}


def plural(count: int | float, noun: str, many: str | None = None) -> str:
    """``count`` and ``noun`` in the number ``count`` asks for: ``1 token``, ``2 tokens``, ``0 tokens``.

    ``many`` is the plural where it is not the noun plus "s" (a few common ones are known).
    """
    return f"{count} {word_for(count, noun, many)}"


def word_for(count: int | float, noun: str, many: str | None = None) -> str:
    """The noun alone in the number ``count`` asks for (``token`` / ``tokens``)."""
    return noun if count == 1 else (many or _IRREGULAR.get(noun) or noun + "s")
