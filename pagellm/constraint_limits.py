"""The --structured-outputs-* bounds on a request's output constraint: settings that the server's
flags set and structured_output/limits.py checks constraints against (a light module: no heavy stack)."""

from __future__ import annotations

from dataclasses import dataclass

# Defaults of the --structured-outputs-* bounds on a request's output constraint (see
# structured_output/limits.py for what each guards against).
DEFAULT_MAX_BYTES = 256 * 1024
DEFAULT_MAX_DEPTH = 100
DEFAULT_MAX_RULES = 5000
DEFAULT_COMPILE_TIMEOUT = 10.0
DEFAULT_MAX_MASK_MS = 20.0


@dataclass(frozen=True)
class ConstraintLimits:
    """The --structured-outputs-* bounds on a request's output constraint (structured_output/limits.py
    checks constraints against them). ``max_bytes``: the constraint's text (schema, grammar, regex,
    choices) at most this long; ``max_depth``: a JSON schema nested at most this deep, as written;
    ``compile_timeout``: the time one constraint may take to compile before the request is refused;
    ``max_mask_ms``: the CPU time one token's mask may cost (it is spent inside every step the request is in)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_rules: int = DEFAULT_MAX_RULES
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    max_mask_ms: float = DEFAULT_MAX_MASK_MS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_rules"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{constraint_flag(name)} must be a positive integer, got {v!r}")
        for name in ("compile_timeout", "max_mask_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ValueError(f"{constraint_flag(name)} must be a positive number, got {v!r}")


def constraint_flag(name: str) -> str:
    """The server flag of a ConstraintLimits field."""
    return "--structured-outputs-" + name.replace("_", "-")
