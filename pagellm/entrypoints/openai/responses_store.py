"""Stored responses (``store: true``, the default): for ``GET`` and ``DELETE /v1/responses/{id}`` and
for ``previous_response_id``. In memory, least recently used first out, bounded by a number of
responses and by their bytes (``--responses-store-max-responses``, ``--responses-store-max-bytes``).

An id the store forgot is remembered as such for a while (a bounded list of ids, with why), so that
a 404 says the response was evicted or deleted rather than that it never existed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagellm.text import plural

# How many forgotten ids (evicted or deleted) are kept to explain a 404, per stored response allowed.
FORGOTTEN_PER_SLOT = 4


@dataclass
class StoredResponse:
    """A response object and the conversation it ends: the items of the responses before it, its input
    items and its output items (what ``previous_response_id`` continues)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]
    size: int = field(init=False)

    def __post_init__(self) -> None:
        # The JSON text's length: close to what the objects hold, and what a client sent or read.
        self.size = len(json.dumps([self.response, self.input_items, self.context], ensure_ascii=False))


class ResponsesStore:
    """An LRU of responses by id; thread-safe (the handlers run on the event loop, tests may not)."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError(f"--responses-store-max-responses and --responses-store-max-bytes must be >= 0, got "
                             f"{max_responses} and {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # id -> why: "evicted" or "deleted"
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def limits(self) -> str:
        return (f"it keeps the {plural(self.max_responses, 'most recently used response')} up to "
                f"{plural(self.max_bytes, 'byte')} in all (--responses-store-max-responses, "
                "--responses-store-max-bytes)")

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry``, evicting the least recently used ones to make room; False when it alone
        is over the limits (it is then not stored)."""
        with self._lock:
            self._drop(response_id)
            if entry.size > self.max_bytes or self.max_responses == 0:
                self._forget(response_id, "too large")
                return False
            while self._items and (len(self._items) >= self.max_responses or self.bytes + entry.size > self.max_bytes):
                old_id, old = self._items.popitem(last=False)
                self.bytes -= old.size
                self._forget(old_id, "evicted")
            self._items[response_id] = entry
            self.bytes += entry.size
            self._forgotten.pop(response_id, None)
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            if not self._drop(response_id):
                return False
            self._forget(response_id, "deleted")
            return True

    def missing(self, response_id: str) -> str:
        """Why ``response_id`` is not here, in a sentence for a 404."""
        with self._lock:
            why = self._forgotten.get(response_id)
        if why == "evicted":
            return (f"the response '{response_id}' was stored but has been evicted to make room for newer ones: "
                    f"this server's responses store is in memory and {self.limits}")
        if why == "deleted":
            return f"the response '{response_id}' was deleted"
        if why == "too large":
            return (f"the response '{response_id}' was too large to store: this server's responses store "
                    f"{self.limits}")
        return (f"no response with id '{response_id}' is stored on this server (responses are stored in memory "
                "unless store is false, and are lost when the server restarts)")

    def _drop(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _forget(self, response_id: str, why: str) -> None:
        self._forgotten[response_id] = why
        self._forgotten.move_to_end(response_id)
        while len(self._forgotten) > max(64, FORGOTTEN_PER_SLOT * self.max_responses):
            self._forgotten.popitem(last=False)
