"""The scripted model's constants and its ``[[mock:...]]`` directives: root code and fault markers.

See :mod:`rlmq.scripted` for what each directive does.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

MODEL_FINGERPRINT = "rlmq-scripted-model"
"""``system_fingerprint`` of every completion, and the first name in ``GET /v1/models``."""
ROOT_TOOL_NAME = "call_python_repl"
BASH_TOOL_NAME = "call_bash_repl"
"""The bash REPL's tool: a request offering it is a root too, and its code is bash."""
ROOT_TOOL_NAMES = (ROOT_TOOL_NAME, BASH_TOOL_NAME)
NOT_FOUND = "NOT FOUND"
DEFAULT_MAX_TOKENS = 4096
"""Completion limit in tokens (words) when a request gives neither max_tokens nor max_completion_tokens."""
ROOT_FOLLOW_UP = "The answer is in answer['content']."
NO_TOOL_REPLY = "The scripted model answers without the REPL: NOT FOUND"
LISTEN_LINE = "rlmq scripted model (test double) listening on {url}"


_DIRECTIVE_RE = re.compile(r"\[\[mock:.*?\]\]", re.DOTALL)
_ROOT_CODE_RE = re.compile(r"\[\[mock:root-code(?:-(\d+))?:([A-Za-z0-9+/=_\-\s]*)\]\]")
_ROOT_CALL_RE = re.compile(r"\[\[mock:root-call-(\d+):([A-Za-z_][A-Za-z0-9_]*):([A-Za-z0-9+/=_\-\s]*)\]\]")
_ROOT_TOOL_RE = re.compile(r"\[\[mock:root-tool:([A-Za-z_][A-Za-z0-9_]*)\]\]")
_TOOL_RE = re.compile(r"\[\[mock:tool:([^:\]\s]+):(.*?)\]\]", re.DOTALL)
_STATUS_RE = re.compile(r"\[\[mock:status:(\d{3})(?::retry-after=(\d+(?:\.\d+)?))?\]\]")
_SLEEP_RE = re.compile(r"\[\[mock:sleep:(\d+(?:\.\d+)?)\]\]")
_FAIL_TIMES_RE = re.compile(r"\[\[mock:fail-times:(\d+)\]\]")
_TOKENS_RE = re.compile(r"\[\[mock:tokens:(\d+)(?:-(\d+))?\]\]")
_CONTEXT_RE = re.compile(r"\[\[mock:context-tokens:(\d+)\]\]")
_TPS_RE = re.compile(r"\[\[mock:tps:(\d+(?:\.\d+)?)\]\]")
_TAG_RE = re.compile(r"\[\[mock:tag:([A-Za-z0-9_.\-]{1,64})\]\]")


def decode_seconds(text: str, completion_tokens: int) -> float:
    """Seconds a ``[[mock:tps:<n>]]`` directive in ``text`` makes the answer take: a server that
    decodes ``n`` tokens per second per request (``completion_tokens / n``); 0 without one."""
    match = _TPS_RE.search(text)
    rate = float(match.group(1)) if match else 0.0
    return completion_tokens / rate if rate > 0 else 0.0


def tag_of(text: str) -> str | None:
    """The accounting tag a ``[[mock:tag:<name>]]`` directive in ``text`` gives (``GET /stats``
    counts served tokens per tag, ``per_tag``: e.g. one tag per tree, on every prompt of it)."""
    match = _TAG_RE.search(text)
    return match.group(1) if match else None


def context_tokens(first_user: str) -> int | None:
    """The root model's context window (tokens = words) a ``[[mock:context-tokens:<n>]]``
    directive in the first user message sets, or ``None``."""
    match = _CONTEXT_RE.search(first_user)
    return int(match.group(1)) if match else None


def context_length_message(limit: int, prompt_tokens: int) -> str:
    """vLLM's error message for a prompt longer than the context window."""
    return (
        f"This model's maximum context length is {limit} tokens. However, your request has {prompt_tokens} "
        "input tokens. Please reduce the length of the input messages."
    )


def answer_tokens(prompt: str) -> int | None:
    """The answer length (tokens = words) a ``[[mock:tokens:...]]`` directive in ``prompt`` asks for.

    ``[[mock:tokens:250]]`` gives 250; ``[[mock:tokens:1-400]]`` gives a length in 1..400 drawn
    by the CRC-32 of the whole prompt (deterministic, so a test can add up its demand).
    ``None`` when the prompt has no such directive.
    """
    match = _TOKENS_RE.search(prompt)
    if match is None:
        return None
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if high <= low:
        return max(1, low)
    return max(1, low + zlib.crc32(prompt.encode()) % (high - low + 1))


def root_code_directive(code: str, turn: int = 1) -> str:
    """The directive that makes root turn ``turn`` (1-based) run exactly ``code``.

    Put it in the question (the first user message) of a rollout.
    """
    encoded = base64.b64encode(code.encode("utf-8")).decode("ascii")
    suffix = "" if turn == 1 else f"-{turn}"
    return f"[[mock:root-code{suffix}:{encoded}]]"


def _decode_b64(data: str) -> str:
    data = "".join(data.split())
    data += "=" * (-len(data) % 4)
    try:
        if "-" in data or "_" in data:
            return base64.urlsafe_b64decode(data).decode("utf-8")
        return base64.b64decode(data, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"bad base64 in root-code directive: {exc}") from exc


def root_call_directive(name: str, arguments: dict[str, Any], turn: int) -> str:
    """The directive that makes root turn ``turn`` (1-based: one plus the assistant messages of
    the prompt it is sent) call the function tool ``name`` with ``arguments`` instead of the REPL.

    Put it in the question (the first user message) of a rollout.
    """
    encoded = base64.b64encode(json.dumps(arguments).encode("utf-8")).decode("ascii")
    return f"[[mock:root-call-{turn}:{name}:{encoded}]]"


def _root_calls(first_user: str) -> dict[int, tuple[str, str]]:
    """Turn -> (tool name, JSON arguments) of the ``root-call`` directives in ``first_user``."""
    return {int(m.group(1)): (m.group(2), _decode_b64(m.group(3))) for m in _ROOT_CALL_RE.finditer(first_user)}


def _root_codes(first_user: str) -> dict[int, str]:
    codes: dict[int, str] = {}
    for match in _ROOT_CODE_RE.finditer(first_user):
        turn = int(match.group(1)) if match.group(1) else 1
        codes[turn] = _decode_b64(match.group(2))
    return codes


@dataclass(frozen=True, slots=True)
class _Faults:
    sleep: float | None = None
    reset: bool = False
    status: int | None = None
    retry_after: str | None = None
    malformed: bool = False
    no_usage: bool = False
    fail_times: int | None = None

    @property
    def any(self) -> bool:
        return self.sleep is not None or self.reset or self.status is not None or self.malformed or self.no_usage


def _parse_faults(prompt: str) -> _Faults:
    status = _STATUS_RE.search(prompt)
    sleep = _SLEEP_RE.search(prompt)
    fail_times = _FAIL_TIMES_RE.search(prompt)
    return _Faults(
        sleep=float(sleep.group(1)) if sleep else None,
        reset="[[mock:reset]]" in prompt,
        status=int(status.group(1)) if status else None,
        retry_after=status.group(2) if status else None,
        malformed="[[mock:malformed]]" in prompt,
        no_usage="[[mock:no-usage]]" in prompt,
        fail_times=int(fail_times.group(1)) if fail_times else None,
    )
