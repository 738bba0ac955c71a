"""What a cell prints, as the parent keeps it: the first ``limit`` characters and a count of the rest."""

from __future__ import annotations

import codecs
from typing import Any

__all__ = ["OutputBuffer", "truncate_output", "with_marker"]


def _truncation_marker(dropped: int) -> str:
    return f"...\n[output truncated: {dropped} more characters]"


def truncate_output(text: str, limit: int) -> str:
    """Cut ``text`` to its first ``limit`` characters and append a visible marker.

    Args:
        text: the output to shorten.
        limit: the number of characters kept (>= 0).

    Returns:
        ``text`` unchanged when it has at most ``limit`` characters; otherwise its
        first ``limit`` characters followed by
        ``"...\\n[output truncated: N more characters]"`` (so the result is longer
        than ``limit`` by the marker).

    Raises:
        ValueError: ``limit`` is negative.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if len(text) <= limit:
        return text
    return text[:limit] + _truncation_marker(len(text) - limit)


def with_marker(text: str, dropped: int) -> str:
    """``text`` followed by the truncation marker when ``dropped`` (characters) > 0."""
    return text + _truncation_marker(dropped) if dropped else text


def _new_decoder() -> Any:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class OutputBuffer:
    """Keeps the first ``limit`` characters of a byte stream (UTF-8) and counts the rest.

    Memory stays at about ``limit`` characters whatever the child writes: what is over the
    limit is decoded chunk by chunk, counted and dropped.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0
        self._decoder = _new_decoder()

    def feed(self, data: bytes, final: bool = False) -> None:
        """Add a chunk of bytes (``final``: flush a trailing partial UTF-8 sequence)."""
        self._add(self._decoder.decode(data, final))

    def _add(self, text: str) -> None:
        room = self._limit - self._kept
        if room <= 0:
            self._dropped += len(text)
            return
        head = text[:room]
        self._parts.append(head)
        self._kept += len(head)
        self._dropped += len(text) - len(head)

    def take(self) -> tuple[str, int]:
        """Return (kept text, characters dropped) and start afresh."""
        self.feed(b"", final=True)
        text, dropped = "".join(self._parts), self._dropped
        self._parts, self._kept, self._dropped = [], 0, 0
        self._decoder = _new_decoder()
        return text, dropped
