"""The root model's chat calls: ``openai.AsyncOpenAI`` with retries by ``tenacity``.

Retried: HTTP 408, 409, 429 and 5xx, connection errors and timeouts, and a 2xx body that
is not a chat completion (an HTML page: then :class:`~rlmq.common.errors.ModelError` says
so, as the sub-LLM client does); waits grow
exponentially with jitter (0.5 s doubling up to 20 s, plus up to 1 s at random).
A ``Retry-After`` header is *not* read here (the sub-LLM client,
:mod:`rlmq.workers.model`, does honour it). The openai client's own retries are set to
zero, so a call makes at most ``retries + 1`` attempts, never a product of two layers.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import openai
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from rlmq.common.connection import mask_url
from rlmq.common.errors import ModelError, PromptTooLongError
from rlmq.common.settings import setting_default

RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}

PROMPT_TOO_LONG_STATUS = frozenset({400, 413, 422})
"""HTTP statuses with which OpenAI-compatible servers refuse a prompt longer than the context."""

PROMPT_TOO_LONG_RE = re.compile(
    r"maximum context length"  # OpenAI; vLLM ("This model's maximum context length is N tokens")
    r"|context[_ ]length[_ ]exceeded"  # OpenAI's error code
    r"|exceeds? the (?:model's )?context window"  # OpenAI (newer models)
    r"|longer than the (?:model's context length|maximum model length)"  # SGLang; vLLM (newer)
    r"|exceeds? the available context size|exceed_context_size"  # llama.cpp server
    r"|prompt (?:is )?too long|prompt_too_long"  # Anthropic-style and proxies
    r"|tokens \+ `?max_new_tokens`? must be <=",  # text-generation-inference
    re.IGNORECASE,
)
"""What those servers say when they refuse a prompt for its length (matched in the error message
and body). A server that says it otherwise gets a plain :class:`ModelError`."""


def prompt_too_long(status: int | None, text: str) -> bool:
    """Whether an error answer (HTTP ``status``, message/body ``text``) refuses the prompt for its
    length: a 400, 413 or 422 whose text matches :data:`PROMPT_TOO_LONG_RE`."""
    return status in PROMPT_TOO_LONG_STATUS and PROMPT_TOO_LONG_RE.search(text) is not None


class RootClient(Protocol):
    """The root model as the rollout engine calls it: one chat completion per root turn.

    :class:`RootModel` is the production one; a test passes an in-memory fake.
    """

    async def chat(self, **kwargs: Any) -> Any:
        """``chat.completions.create(**kwargs)``: ``model``, ``messages`` (OpenAI chat messages),
        ``tools`` (the REPL tool) and, when the root has a completion-token limit, ``max_tokens``
        (tokens). Returns an OpenAI ``ChatCompletion`` (or an object of the same shape:
        ``choices[0].message.content`` / ``.tool_calls``, ``usage.prompt_tokens`` /
        ``.completion_tokens``).

        Raises:
            PromptTooLongError: the server refused the prompt for its length (the rollout
                ends with ``prompt_too_long``).
            ModelError: the call failed (the client's own retries, if any, are spent).
        """
        ...


class NotAChatCompletion(Exception):
    """The server answered (HTTP 2xx) with something else than a chat completion (an HTML page
    of a proxy, a login wall, ...). Retried like a 5xx."""


def _snippet(body: Any) -> str:
    text = str(body)
    return text[:200] + ("..." if len(text) > 200 else "")


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, NotAChatCompletion):
        return True
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500
    return False


class RootModel:
    """Chat completions for the root model.

    Args:
        base_url: OpenAI-compatible base URL (``http://host:port/v1``).
        api_key: the server's key (``EMPTY`` for local servers).
        retries: retries after the first attempt.
        timeout: seconds per HTTP attempt.
        client: an ``AsyncOpenAI``-like object (a seam for tests); built from the above if ``None``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str = setting_default("api_key").get_secret_value(),
        *,
        retries: int = setting_default("model_retries"),
        timeout: float = setting_default("root_model_timeout"),
        client: Any | None = None,
    ) -> None:
        self.client = client or openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
        self.retries = retries
        self.base_url = base_url

    async def chat(self, **kwargs: Any) -> Any:
        """``chat.completions.create(**kwargs)`` with retries.

        Raises:
            PromptTooLongError: the server refused the prompt for its length (not retried).
            ModelError: the call still failed after the retries.
        """
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_retryable),
                stop=stop_after_attempt(self.retries + 1),
                wait=wait_exponential(multiplier=0.5, max=20.0) + wait_random(0, 1.0),
                reraise=True,
            ):
                with attempt:
                    resp = await self.client.chat.completions.create(**kwargs)
                    if not getattr(resp, "choices", None):  # the openai client returns an HTML body as str
                        raise NotAChatCompletion(_snippet(resp))
                    return resp
        except NotAChatCompletion as exc:
            raise ModelError(
                f"root model at {mask_url(self.base_url)} answered with a body that is not a chat completion ({exc})"
            ) from None
        except openai.APIStatusError as exc:
            if prompt_too_long(exc.status_code, f"{exc.message} {exc.body}"):
                raise PromptTooLongError(
                    f"root model at {mask_url(self.base_url)} refused the prompt for its length "
                    f"({exc.status_code}): {exc.message}",
                    exc.status_code,
                ) from exc
            raise ModelError(
                f"root model at {mask_url(self.base_url)} answered {exc.status_code}: {exc.message}", exc.status_code
            ) from exc
        except openai.OpenAIError as exc:
            raise ModelError(f"root model call to {mask_url(self.base_url)} failed: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        await self.client.close()
