"""The root model's chat calls: ``openai.AsyncOpenAI`` with retries by ``tenacity``.

Retried: HTTP 408, 409, 429 and 5xx, connection errors and timeouts; waits grow
exponentially with jitter (``wait_exponential_jitter(multiplier=0.5, max=20)``: seconds).
A ``Retry-After`` header is *not* read here (the sub-LLM client,
:mod:`rlmq.workers.model`, does honour it). The openai client's own retries are set to
zero, so a call makes at most ``retries + 1`` attempts, never a product of two layers.
"""

from __future__ import annotations

from typing import Any

import openai
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from rlmq.common.connection import mask_url
from rlmq.common.errors import ModelError

RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}


def _retryable(exc: BaseException) -> bool:
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
        api_key: str = "EMPTY",
        *,
        retries: int = 3,
        timeout: float = 600.0,
        client: Any | None = None,
    ) -> None:
        self.client = client or openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
        self.retries = retries
        self.base_url = base_url

    async def chat(self, **kwargs: Any) -> Any:
        """``chat.completions.create(**kwargs)`` with retries.

        Raises:
            ModelError: the call still failed after the retries.
        """
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_retryable),
                stop=stop_after_attempt(self.retries + 1),
                wait=wait_exponential_jitter(multiplier=0.5, max=20.0),
                reraise=True,
            ):
                with attempt:
                    return await self.client.chat.completions.create(**kwargs)
        except openai.APIStatusError as exc:
            raise ModelError(
                f"root model at {mask_url(self.base_url)} answered {exc.status_code}: {exc.message}", exc.status_code
            ) from exc
        except openai.OpenAIError as exc:
            raise ModelError(f"root model call to {mask_url(self.base_url)} failed: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        await self.client.close()
