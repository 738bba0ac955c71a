"""The REPL globals that reach the rollout's endpoint: ``llm_batch``, ``rlm_batch`` and the root
tools, posting JSON over HTTP (TCP or the interception server's Unix socket)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["make_llm_batch", "make_rlm_batch", "make_root_tool"]


def _post(
    opener: urllib.request.OpenerDirector,
    url: str,
    body: bytes,
    token: str,
    timeout: float,
    *,
    refused: str,
    unreachable: str,
) -> bytes:
    """POST the JSON ``body`` to ``url`` (the rollout's own endpoint) with its bearer ``token``,
    waiting at most ``timeout`` seconds; returns the response body.

    Raises:
        RuntimeError: ``<refused> (HTTP <code>): <the server's message>`` for an HTTP error,
            ``<unreachable>: <reason>`` when the endpoint cannot be reached (no chained traceback).
    """
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    error: str | None = None
    try:
        with opener.open(request, timeout=timeout) as response:
            raw: bytes = response.read()
            return raw
    except urllib.error.HTTPError as exc:
        error = f"{refused} (HTTP {exc.code}): {_server_message(exc)}"
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        error = f"{unreachable}: {reason}"
    raise RuntimeError(error)


def _server_message(err: urllib.error.HTTPError) -> str:
    try:
        raw = err.read()
    except Exception:  # noqa: BLE001
        raw = b""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return text or str(err.reason)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the interception server's Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _UnixHandler(urllib.request.HTTPHandler):
    """Sends every ``http://`` request of the opener through the Unix socket (replaces the
    opener's default HTTP handler)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        path = self._path
        return self.do_open(lambda host, timeout=60.0, **kw: _UnixHTTPConnection(path, timeout), req)


def _batch_results(raw: bytes, n: int, name: str, service: str) -> list[str]:
    """The ``n`` string results of an ``llm_batch``/``rlm_batch`` response ``raw``, after printing
    its summary; ``name`` and ``service`` word the error.

    Raises:
        RuntimeError: the response is not JSON with ``n`` string ``results``.
    """
    try:
        payload = json.loads(raw)
        results = payload["results"]
        summary = payload.get("summary", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RuntimeError(f"{name} got a malformed response from {service}") from None
    if not isinstance(results, list) or len(results) != n or not all(isinstance(r, str) for r in results):
        raise RuntimeError(f"{name} got a malformed response: expected {n} string results")
    if summary:
        print(summary if isinstance(summary, str) else str(summary))
    return list(results)


def _opener(unix_socket: str | None) -> urllib.request.OpenerDirector:
    """The HTTP opener of the REPL's calls to the interception endpoint: no proxy from the
    environment, and over ``unix_socket`` when the endpoint is one."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if unix_socket:
        handlers.append(_UnixHandler(unix_socket))
    return urllib.request.build_opener(*handlers)


def _non_string_prompts(prompts: list[Any]) -> dict[int, str]:
    """Place -> the error answer of each prompt that is not a str (verifiers 0.1.14's
    ``llm_batch`` answers such a prompt with an error and runs the others)."""
    return {
        i: f"Error: llm_batch prompt at index {i} must be a string, not {type(p).__name__}"
        for i, p in enumerate(prompts)
        if not isinstance(p, str)
    }


@dataclass(frozen=True)
class _BatchKind:
    """What tells ``llm_batch`` and ``rlm_batch`` apart on the way out (see :func:`_send_batch`)."""

    name: str
    """The REPL global: ``llm_batch`` or ``rlm_batch``."""
    items: str
    """What one batch holds, plural: ``prompts`` or ``tasks``."""
    service: str
    """Who answers, for the errors: ``the sub-LLM service`` or ``the producer``."""
    shorter: str
    """The advice of the too-many-bytes error."""
    encode: Callable[[list[Any]], bytes]
    """The request body of a batch's items (JSON, UTF-8).

    Raises: TypeError or ValueError, worded for the model."""


def _llm_body(prompts: list[Any]) -> bytes:
    return json.dumps({"prompts": prompts}).encode("utf-8", "surrogatepass")


def _rlm_body(tasks: list[Any]) -> bytes:
    try:
        text = json.dumps({"tasks": tasks}, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"rlm_batch(tasks): a context is not a JSON value: {exc}") from None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"rlm_batch: a prompt or context is not valid Unicode text (a lone surrogate at character {exc.start})"
        ) from None


_LLM = _BatchKind("llm_batch", "prompts", "the sub-LLM service", "send shorter prompts or split the batch",
                  _llm_body)  # fmt: skip
_RLM = _BatchKind("rlm_batch", "tasks", "the producer",
                  "send shorter prompts and contexts or split the batch", _rlm_body)  # fmt: skip


def _send_batch(
    kind: _BatchKind,
    items: list[Any],
    opener: urllib.request.OpenerDirector,
    url: str,
    token: str,
    timeout: float,
    in_flight: threading.BoundedSemaphore,
    max_batch_bytes: int,
    max_batch_prompts: int,
) -> list[str]:
    """The one core of ``llm_batch`` and ``rlm_batch``: send a non-empty list of checked ``items``
    (prompt strs, task dicts) to ``url`` and return one answer string per item, in order.

    ``in_flight`` bounds the batches of one global in flight at once: the producer serves one batch
    of a rollout at a time and keeps a bounded number of its connections open (closing extras at
    once), so threads of a cell wait here, not there.

    Raises:
        TypeError, ValueError: more than ``max_batch_prompts`` items or ``max_batch_bytes`` bytes
            of body, or an item :attr:`_BatchKind.encode` refuses.
        RuntimeError: the batch was refused, the endpoint could not be reached (``timeout``
            seconds), or its answer is malformed.
    """
    if len(items) > max_batch_prompts:
        raise ValueError(
            f"{kind.name} got {len(items)} {kind.items}; at most {max_batch_prompts} per call: split the batch"
        )
    body = kind.encode(items)
    if len(body) > max_batch_bytes:
        raise ValueError(
            f"{kind.name} {kind.items} take {len(body)} bytes; at most {max_batch_bytes} per call: {kind.shorter}"
        )
    with in_flight:
        raw = _post(
            opener, url, body, token, timeout,
            refused=f"{kind.name} failed", unreachable=f"{kind.name} could not reach {kind.service}",
        )  # fmt: skip
    return _batch_results(raw, len(items), kind.name, kind.service)


def make_llm_batch(
    url: str,
    token: str,
    timeout: float,
    unix_socket: str | None,
    max_batch_bytes: int,
    max_batch_prompts: int,
) -> Callable[[list[str]], list[str]]:
    """The REPL global ``llm_batch``: posts ``{"prompts"}`` to ``url`` with the bearer ``token``
    (``timeout`` seconds per request; over ``unix_socket`` when given), at most
    ``max_batch_prompts`` prompts and ``max_batch_bytes`` bytes of JSON per call."""
    opener = _opener(unix_socket)
    in_flight = threading.BoundedSemaphore(8)

    def llm_batch(prompts: list[str]) -> list[str]:
        """Send a batch of prompts to sub-LLMs and return their answers, in order.

        Args:
            prompts: a list of prompt strings; each becomes one sub-LLM call and the
                calls run in parallel.

        Returns:
            One answer string per prompt, in the order of ``prompts``. A summary of
            the batch (tokens, turns, seconds per prompt, budget) is printed.

        A prompt that is not a str gets ``Error: llm_batch prompt at index i must be a
        string, ...`` as its answer; the other prompts run.

        Raises:
            TypeError: ``prompts`` is not a list.
            ValueError: the batch is over the limits (prompts, bytes), or a prompt is not valid
                Unicode text (a lone surrogate); send smaller batches of text.
            RuntimeError: the batch was refused (for example the budget is spent)
                or the sub-LLM service could not be reached.
        """
        if not isinstance(prompts, list):
            raise TypeError(f"llm_batch(prompts) expects a list of str, got {type(prompts).__name__}")
        refused = _non_string_prompts(prompts)
        if refused:  # those answered with an error, the rest sent, as the reference's llm_batch does
            sent = [p for i, p in enumerate(prompts) if i not in refused]
            answers = iter(llm_batch(sent) if sent else [])
            return [refused[i] if i in refused else next(answers) for i in range(len(prompts))]
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"llm_batch: prompts[{i}] is not valid Unicode text (a lone surrogate at character {exc.start})"
                ) from None
        return _send_batch(_LLM, prompts, opener, url, token, timeout, in_flight, max_batch_bytes, max_batch_prompts)

    return llm_batch


def make_rlm_batch(
    url: str,
    token: str,
    timeout: float,
    unix_socket: str | None,
    max_batch_bytes: int,
    max_batch_prompts: int,
) -> Callable[[list[Any]], list[str]]:
    """The REPL global ``rlm_batch``: posts its tasks to ``<url's folder>/rlm_batch`` (arguments
    as :func:`make_llm_batch`'s)."""
    opener = _opener(unix_socket)
    rlm_url = url.rsplit("/", 1)[0] + "/rlm_batch"
    in_flight = threading.BoundedSemaphore(8)

    def rlm_batch(tasks: list[Any]) -> list[str]:
        """Run each task as a child RLM (its own REPL and model) and return their answers, in order.

        Args:
            tasks: a list; each task is a prompt (str) or ``{"prompt": str, "context": JSON}``,
                ``context`` (a str, list or dict) being the child's ``context`` variable.

        Returns:
            One answer string per task, in order (``[error] ...`` / ``[rejected] ...`` for a task
            that failed or was refused). A summary of the batch is printed.

        Raises:
            TypeError: ``tasks`` is not a list of str or {"prompt": str, "context": JSON} dicts.
            ValueError: the batch is over the limits (tasks, bytes), or a prompt or context is not
                valid Unicode text; send smaller batches of text.
            RuntimeError: the batch was refused or the service could not be reached.
        """
        if not isinstance(tasks, list):
            raise TypeError(f"rlm_batch(tasks) expects a list, got {type(tasks).__name__}")
        body_tasks = [_rlm_task(i, task) for i, task in enumerate(tasks)]
        if not body_tasks:
            return []
        return _send_batch(
            _RLM, body_tasks, opener, rlm_url, token, timeout, in_flight, max_batch_bytes, max_batch_prompts
        )

    return rlm_batch


def _rlm_task(i: int, task: Any) -> dict[str, Any]:
    """Task ``i`` of an ``rlm_batch`` as it goes on the wire: ``{"prompt"}`` or ``{"prompt", "context"}``.

    Raises:
        TypeError: not a str nor a ``{"prompt": str, "context": str | list | dict | None}`` dict.
    """
    if isinstance(task, str):
        return {"prompt": task}
    if not isinstance(task, dict):
        raise TypeError(
            f'rlm_batch(tasks): tasks[{i}] is {type(task).__name__}; give a str or {{"prompt": str, "context": ...}}'
        )
    strangers = sorted(str(k) for k in task if k not in ("prompt", "context"))
    if strangers:
        raise TypeError(f"rlm_batch(tasks): tasks[{i}] has unknown key(s) {', '.join(strangers)}")
    if not isinstance(task.get("prompt"), str):
        raise TypeError(f'rlm_batch(tasks): tasks[{i}]["prompt"] must be a str')
    context = task.get("context")
    if context is not None and not isinstance(context, (str, list, dict)):
        raise TypeError(
            f'rlm_batch(tasks): tasks[{i}]["context"] must be a str, list or dict, not {type(context).__name__}'
        )
    return {"prompt": task["prompt"], "context": context}


def make_root_tool(
    spec: dict[str, Any], url: str, token: str, timeout: float, unix_socket: str | None, max_bytes: int
) -> Callable[..., Any]:
    """The REPL global of one root tool: posts its JSON arguments to ``<endpoint>/root_tool``."""
    opener = _opener(unix_socket)
    name = str(spec["name"])
    tool_url = url.rsplit("/", 1)[0] + "/root_tool"

    def tool(*args: Any, **kwargs: Any) -> Any:
        try:
            body = json.dumps({"name": name, "args": list(args), "kwargs": kwargs}).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}() takes JSON values (str, int, float, bool, None, list, dict): {exc}") from None
        if len(body) > max_bytes:
            raise ValueError(f"{name}() arguments take {len(body)} bytes of JSON; at most {max_bytes}")
        raw = _post(
            opener, tool_url, body, token, timeout,
            refused=f"{name}() was refused", unreachable=f"{name}() could not reach the producer",
        )  # fmt: skip
        try:
            payload = json.loads(raw)
        except ValueError:
            raise RuntimeError(f"{name}() got a malformed response from the producer") from None
        if isinstance(payload, dict) and "result" in payload:
            return payload["result"]
        if isinstance(payload, dict) and isinstance(payload.get("error"), str):
            raise RuntimeError(payload["error"])
        raise RuntimeError(f"{name}() got a malformed response from the producer")

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = str(spec.get("doc") or "") or None
    tool.__module__ = "__main__"
    return tool
