"""The probe: a separate process that tries each new constraint before the server compiles it.

Run as a script (``python -I probe.py``), importing nothing of pagellm, so that it starts quickly and
nothing it does can reach the server's memory. It reads JSON lines on stdin: first the tokenizer,
then one request per line, each answered with one JSON line whose keys say what it found::

    request: {"kind": "grammar" | "llguidance", "grammar": str}   # Lark or GBNF, or llguidance's own

    answer:  {"grammar": str,       # the llguidance grammar probed (Lark or GBNF converted)
              "invalid": str,       # not valid Lark or GBNF
              "error": str,         # the grammar engine refuses it
              "dead_end": str,      # it compiles, but no output can satisfy it
              "later_error": str,   # the grammar engine gives up after the first tokens
              "mask_ms": float}     # the most CPU time one later token (consumed, masked) took

Converting GBNF is Python code that can take long on a large grammar: here it holds no lock the
server needs. The grammar is compiled on a thread with the stack the server's compile thread has,
so a grammar that would overflow that stack kills this process instead of the server; the server
kills it too when a grammar takes longer than its budget (compiler.py). Either way the next grammar
gets a fresh probe.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

# Tokens the probe walks after the first mask: enough for the masks of a grammar's steady state.
WALK_TOKENS = 4


def allowed_tokens(mask: bytes, limit: int) -> list[int]:
    """The token ids set in a bitmask (one bit per token, little-endian words), up to ``limit`` of them."""
    out: list[int] = []
    for i, byte in enumerate(mask):
        if byte:
            out.extend(i * 8 + b for b in range(8) if byte >> b & 1)
            if len(out) >= limit:
                break
    return out[:limit]


def first_line(error: str) -> str:
    """The grammar engine's message without the parser state it appends."""
    return error.strip().split("\n")[0]


def probe(llg: Any, tokenizer: Any, grammar: str) -> dict[str, Any]:
    """Compile ``grammar``, compute its first mask, then walk a few tokens timing each mask."""
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return {"error": first_line(matcher.get_error())}
    eos = set(tokenizer.eos_tokens)
    mask = matcher.compute_bitmask()
    if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
        return {"dead_end": first_line(matcher.get_error())}
    worst = 0.0
    for _ in range(WALK_TOKENS):
        tokens = [t for t in allowed_tokens(mask, 64) if t not in eos]
        if not tokens or matcher.is_stopped():
            break
        start = time.thread_time()
        if matcher.consume_token(tokens[0]):
            mask = matcher.compute_bitmask()
        worst = max(worst, (time.thread_time() - start) * 1000)
        if matcher.is_error():
            return {"later_error": first_line(matcher.get_error()), "mask_ms": worst}
    return {"mask_ms": worst}


def converted(llg: Any, kind: str, text: str) -> str:
    """The llguidance grammar of a request's grammar (Lark, or GBNF converted to Lark), or of an
    llguidance grammar given as is (``kind`` "llguidance")."""
    return text if kind == "llguidance" else str(llg.grammar_from("grammar", text))


def main() -> None:
    os.nice(10)  # a hostile grammar's compile yields the cores to the server's steps
    import llguidance

    setup = json.loads(sys.stdin.readline())
    spec = json.loads(setup["tokenizer"])
    spec["padding"] = spec["truncation"] = None  # (what llguidance's loader clears too)
    try:
        tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=setup["n_vocab"],
                                           eos_token=setup["eos"] or None)
    except Exception as e:  # the server says why, rather than that the probe died
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    threading.stack_size(setup["stack_mb"] << 20)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(on_big_stack(llguidance, tokenizer, json.loads(line))), flush=True)


def on_big_stack(llg: Any, tokenizer: Any, request: dict[str, Any]) -> dict[str, Any]:
    """``probe`` on a fresh thread (with the stack size set in ``main``); the result holds the grammar
    probed under "grammar"."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            grammar = result["grammar"] = converted(llg, request["kind"], request["grammar"])
        except Exception as e:  # not valid Lark or GBNF
            result["invalid"] = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            return
        try:
            result.update(probe(llg, tokenizer, grammar))
        except Exception as e:  # the library's refusal, whatever its type
            result["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result

if __name__ == "__main__":
    main()
