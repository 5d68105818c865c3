"""Constrained decoding: JSON schemas, regexes, choices and grammars as per-token bitmasks.

``StructuredOutputManager`` (manager.py) compiles and caches constraints and fills each step's
bitmask; backend_guidance.py is the grammar engine (llguidance); bitmask.py applies masks to logits.
"""

from pagellm.structured_output.bitmask import GrammarMask, apply_token_bitmask
from pagellm.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarMask", "StructuredOutputManager", "apply_token_bitmask"]
