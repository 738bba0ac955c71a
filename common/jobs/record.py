"""RQ's job record, written and read directly on rlmq's hot path.

The producer enqueues sub-LLM jobs by writing exactly the hash RQ's own
``Queue.enqueue`` writes (JSON serializer, never pickle), so ``rq info``, rq-dashboard
and a stock ``rq worker`` all see ordinary RQ jobs; ``tests/unit/test_dispatch.py``
(``test_enqueued_jobs_are_ordinary_rq_jobs``, ``test_short_job_data_is_stored_uncompressed_and_rq_reads_both``)
reads them back through RQ's ``Job.fetch`` to prove it. Doing it here instead of through
``Queue.enqueue_many`` saves most of RQ's per-job Python and Redis work (see bench/).

rlmq adds fields RQ ignores: ``rlmq_reply`` (the batch's reply list), ``rlmq_reply_ttl`` (how
long that list lives: the producer's), ``rlmq_meta``
(JSON: rollout id, batch id, index, for error results written by the reaper),
``rlmq_attempts`` (incremented when an abandoned job is re-queued) and ``rlmq_started``
(``created_at/attempt`` of the execution a worker last started; see
``rlmq.common.jobs.lua.START_LUA``). The producer writes only the first three, so an enqueue
applied twice leaves the others as they were.
"""

from __future__ import annotations

import base64
import json
import zlib
from datetime import UTC, datetime
from typing import Any

# rlmq's own fields of RQ's job hash: spelled here only (the Lua scripts get them spliced in).
F_REPLY = "rlmq_reply"
"""The batch's reply stream (written by the producer)."""
F_META = "rlmq_meta"
"""JSON ``{"rollout_id", "batch_id", "index"}`` (written by the producer)."""
F_ATTEMPTS = "rlmq_attempts"
"""Executions taken back so far (the reaper increments it)."""
F_STARTED = "rlmq_started"
"""``created_at/attempt`` of the execution a worker last started."""
F_EXEC = "rlmq_exec"
"""Execution id ``START`` last granted (lets a ``START`` re-sent after a lost reply find its own jobs)."""
F_REPLY_TTL = "rlmq_reply_ttl"
"""Seconds the reply stream lives after a result (written by the producer, which owns the stream:
``FINISH`` and ``REAP`` use it, never the worker's own TTL)."""
JOB_FIELDS = {
    "F_REPLY": F_REPLY,
    "F_META": F_META,
    "F_ATTEMPTS": F_ATTEMPTS,
    "F_STARTED": F_STARTED,
    "F_EXEC": F_EXEC,
    "F_REPLY_TTL": F_REPLY_TTL,
}
"""The names above by constant name, for splicing into Lua (``string.Template``: ``$F_REPLY``)."""

# The job functions, by import path (the producer never imports the workers package). rlmq's
# worker runs their jobs through its kind registry (rlmq.workers.kinds) by these names, without
# calling them; a stock RQ worker calls them (rlmq.workers.job). The names are part of every job
# record: renaming one would make old and new workers of one fleet refuse each other's jobs.
SUB_LLM_FUNC = "rlmq.workers.job.run_sub_llm"
CHILD_ROLLOUT_FUNC = "rlmq.workers.job.run_child_rollout"
"""A child rollout of ``rlm_batch``: its one argument is a
:class:`~rlmq.common.schemas.ChildRolloutRequest`, its result a
:class:`~rlmq.common.schemas.SubLLMResult` with ``child`` set. The function it names refuses on a
stock RQ worker (:func:`rlmq.workers.job.run_child_rollout`): a child needs a REPL host."""


def utcformat(dt: datetime) -> str:
    """RQ's timestamp format: ``2026-11-22T06:20:01.546671Z`` (UTC)."""
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utcnow_str() -> str:
    """Now in RQ's timestamp format."""
    return utcformat(datetime.now(UTC))


COMPRESS_MIN_BYTES = 1024
"""Job data shorter than this is stored uncompressed: zlib's set-up costs more than it saves
on a short prompt, and RQ reads uncompressed data as well (``Job.restore`` falls back)."""


def encode_job_data(func: str, args: list[Any] | None = None, *, args_json: str | None = None) -> bytes:
    """RQ's ``data`` field with the JSON serializer: ``[func, null, args, {}]``, zlib-compressed
    from ``COMPRESS_MIN_BYTES`` on.

    Args:
        func: the job function's import path.
        args: its positional arguments (JSON-able); give either these or ``args_json``.
        args_json: the arguments already encoded as a JSON array (saves encoding them twice).
    """
    text = args_json if args_json is not None else json.dumps(args or [], separators=(",", ":"))
    raw = f"[{json.dumps(func)},null,{text},{{}}]".encode()
    return zlib.compress(raw, 1) if len(raw) >= COMPRESS_MIN_BYTES else raw


MAX_JOB_DATA = 256 * 1024 * 1024
"""Bytes a job's data may decompress to (a batch body is at most ``max_batch_bytes``, 64 MiB by
default); more is refused before it is read whole, so a 2 KB compression bomb in a job costs a
worker nothing."""


def decode_job_data(raw: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    """Inverse of :func:`encode_job_data`; returns ``(func, args, kwargs)``.

    Raises:
        ValueError: the data is not a JSON-serialized RQ job (pickled jobs are refused), or it
            decompresses to more than :data:`MAX_JOB_DATA` bytes (a compression bomb).
    """
    try:
        inflater = zlib.decompressobj()
        text = inflater.decompress(raw, MAX_JOB_DATA + 1)
    except zlib.error:
        text = raw
    else:
        if len(text) > MAX_JOB_DATA or inflater.unconsumed_tail:
            raise ValueError(f"job data decompresses to more than {MAX_JOB_DATA} bytes")
    try:
        func, _instance, args, kwargs = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise ValueError("job data is not JSON (rlmq never runs pickled jobs)") from exc
    if not isinstance(func, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("job data has an unexpected shape")
    return func, args, kwargs


def job_hash(
    *,
    queue: str,
    args: list[Any] | None = None,
    description: str,
    timeout: int,
    result_ttl: int,
    failure_ttl: int,
    ttl: int,
    reply_key: str,
    meta: dict[str, Any],
    reply_ttl: int | None = None,
    now: str | None = None,
    func: str = SUB_LLM_FUNC,
    data: bytes | None = None,
) -> dict[str, bytes | str | int]:
    """The hash of a freshly queued job, field for field as ``Queue.enqueue`` writes it.

    Args:
        queue: RQ queue name (``origin``).
        args: positional arguments of the job function (JSON-able); not needed with ``data``.
        description: what rq-dashboard shows; keep it short (never the prompt).
        timeout: RQ job timeout, seconds.
        result_ttl / failure_ttl: seconds RQ keeps the finished / failed job.
        ttl: seconds the job may wait in the queue before it expires unstarted.
        reply_key: the batch's reply list.
        meta: rollout id, batch id, index (for results the reaper writes).
        reply_ttl: seconds the reply stream lives after a result (``None``: not written; the
            worker then falls back to a default, never to its own settings).
        data: the ``data`` field already encoded by :func:`encode_job_data`.
    """
    stamp = now or utcnow_str()
    fields: dict[str, bytes | str | int] = {
        "status": "queued",
        "created_at": stamp,
        "data": data if data is not None else encode_job_data(func, args),
        "success_callback_name": "",
        "failure_callback_name": "",
        "stopped_callback_name": "",
        "started_at": "",
        "ended_at": "",
        "last_heartbeat": "",
        "worker_name": "",
        "group_id": "",
        "origin": queue,
        "description": description,
        "enqueued_at": stamp,
        "timeout": timeout,
        "result_ttl": result_ttl,
        "failure_ttl": failure_ttl,
        "ttl": ttl,
        F_REPLY: reply_key,
        F_META: json.dumps(meta, separators=(",", ":")),
    }
    if reply_ttl is not None:
        fields[F_REPLY_TTL] = reply_ttl
    return fields


def rq_return_value(value: Any) -> str:
    """RQ's result-stream encoding of a return value with the JSON serializer."""
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode()


def rq_exc_string(text: str) -> str:
    """RQ's result-stream encoding of an exception string."""
    return base64.b64encode(zlib.compress(text.encode())).decode()
