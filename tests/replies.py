"""Reading a batch's reply stream in tests (what the producer reads with ``XREAD``)."""

from __future__ import annotations

from typing import Any

from rlmq.common import keys as K
from rlmq.common.schemas import SubLLMResult, load_result


def reply_raw(client: Any, key: str) -> list[bytes]:
    """The raw result entries of the reply stream ``key`` (a sync client), oldest first."""
    field = K.REPLY_FIELD.encode()
    return [fields[field] for _id, fields in client.xrange(key)]


def reply_results(client: Any, key: str) -> list[SubLLMResult]:
    """The results on the reply stream ``key``, oldest first."""
    return [load_result(raw) for raw in reply_raw(client, key)]
