"""A provider's hard quota for the scripted model (a **test double** of a rate-limited provider).

With a quota (``python -m rlmq.scripted.server --quota-rpm R --quota-tpm T --quota-window W``,
or ``create_app(quota=ProviderQuota(...))``), the server counts every caller together, as a
provider counts one API key: a chat completion is answered 429 with a ``Retry-After`` header
(whole seconds, at least 1) when, counting it, more than ``rpm`` requests or ``tpm`` tokens would
have been accepted in the last ``window`` seconds of the server's clock. A request counts its
prompt words plus its completion limit when it is accepted, corrected to its prompt plus
completion words when it is answered. Refused requests count nothing. ``GET /stats`` shows the
counters under ``quota``: ``accepted``, ``refused`` (429s) and ``accepted_at`` (Unix seconds of
each accepted request, the last 100,000).
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from typing import Any


class ProviderQuota:
    """The counters of a hard provider quota (see the module docstring).

    Args:
        rpm: requests per window (``None``: no limit).
        tpm: tokens (words) per window (``None``: no limit).
        window: seconds.
        clock: Unix seconds (a seam for tests).
    """

    def __init__(self, rpm: int | None = None, tpm: int | None = None, window: float = 60.0, clock: Any = time.time):
        self.rpm, self.tpm, self.window, self.clock = rpm, tpm, window, clock
        self._log: collections.deque[tuple[float, int]] = collections.deque()  # (accepted at, entry id)
        self._tokens: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.accepted = 0
        self.refused = 0
        self.accepted_at: collections.deque[float] = collections.deque(maxlen=100_000)

    def _prune(self, now: float) -> None:
        while self._log and self._log[0][0] <= now - self.window:
            _, entry = self._log.popleft()
            self._tokens.pop(entry, None)

    def admit(self, tokens: int) -> tuple[int | None, int]:
        """Count one request of ``tokens`` tokens: ``(entry, 0)`` when accepted, ``(None, seconds)``
        (the ``Retry-After`` to send) when refused."""
        now = self.clock()
        self._prune(now)
        wait = 0.0
        if self.rpm is not None and len(self._log) >= self.rpm:
            wait = self._log[len(self._log) - self.rpm][0] + self.window - now
        if self.tpm is not None and self._log and sum(self._tokens.values()) + tokens > self.tpm:
            free = self.tpm - sum(self._tokens.values())
            for at, entry in self._log:
                free += self._tokens.get(entry, 0)
                if free >= tokens:
                    wait = max(wait, at + self.window - now)
                    break
        if wait > 0:
            self.refused += 1
            return None, max(1, math.ceil(wait))
        entry = next(self._ids)
        self._log.append((now, entry))
        self._tokens[entry] = tokens
        self.accepted += 1
        self.accepted_at.append(now)
        return entry, 0

    def settle(self, entry: int, tokens: int) -> None:
        """The accepted request ``entry`` was answered with ``tokens`` tokens (while in the window)."""
        if entry in self._tokens:
            self._tokens[entry] = tokens

    def snapshot(self) -> dict[str, Any]:
        """The ``quota`` part of ``/stats``."""
        return {
            "rpm": self.rpm, "tpm": self.tpm, "window": self.window, "accepted": self.accepted,
            "refused": self.refused, "accepted_at": list(self.accepted_at),
        }  # fmt: skip
