"""``RLMEnv``: Recursive Language Model rollouts whose sub-LLM calls go through Redis.

The constructor follows the verifiers ``RLMEnv`` as simplified in March 2026
(``max_turns=50``, ``sub_llm_max_turns``, ``max_sub_llm_parallelism``,
``sub_llm_max_completion_tokens``, one interception server per environment on 127.0.0.1
with an OS-assigned port). What differs: sub-LLM calls leave the trainer process as RQ
jobs served by ``rlmq worker`` processes, and the sub-LLM budget is a hard guarantee
enforced in Redis (:mod:`rlmq.common.budget.ledger`), not a counter that parallel calls overshoot.

``RLMEnv`` owns the process's resources (the Redis connection, the root model client, the
interception server, the root tools, metrics, the live-rollout key refresh) and runs each
rollout with the rollout engine (:func:`rlmq.producer.engine.run_rollout`), which reads only
the rollout options. One rollout: the root model gets the scaffold and the row's question, and calls
``call_python_repl(code)`` (``call_bash_repl`` with ``repl_language="bash"``); each call runs in
the rollout's persistent REPL, whose working directory holds the row's context as files
(:mod:`rlmq.producer.repl`), where ``llm_batch`` posts to the interception server
(:mod:`rlmq.producer.interception`), which dispatches the batch (:mod:`rlmq.producer.dispatch`).
The rollout stops on ``answer["ready"]``, after ``max_turns`` root turns, on a root reply
without a tool call, on a prompt too long for the root model, on a timed-out cell (with
``abort_on_code_timeout``), or on an error; the stop reason is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import re
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, Final, Literal

from redis.asyncio import Redis

from rlmq.common.aio import cancel_and_wait
from rlmq.common.connection import async_client
from rlmq.common.errors import ConfigError
from rlmq.common.fleet_checks import check_eviction_policy
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import DatasetRow, ResultRow, normalize_sampling
from rlmq.common.settings import (
    ReplLanguage,
    RolloutOptions,
    Settings,
    SystemPromptMode,
    Verbosity,
    build_settings,
    setting_default,
)
from rlmq.common.settings.schema import arguments_doc
from rlmq.producer.engine import RolloutHost, raise_if_cancelled, run_rollout
from rlmq.producer.host import root_model, start_host
from rlmq.producer.hosted_tools import HostedTools
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.rollout import RolloutResult, normalize_answer
from rlmq.producer.root import RootModel
from rlmq.producer.root_tools import (
    RootToolbox,
    ToolLike,
    hosted_sub_tool_path,
    import_path,
    resolve_tool,
    shared_tool_paths,
)

__all__ = ["FROM_SETTINGS", "RLMEnv", "RolloutResult", "normalize_answer", "raise_if_cancelled"]


log = logging.getLogger("rlmq.env")


class _FromSettings(enum.Enum):
    """The default of every :class:`RLMEnv` setting argument: take the value from ``settings``."""

    FROM_SETTINGS = "from settings"


FROM_SETTINGS: Final = _FromSettings.FROM_SETTINGS


class RLMEnv:
    """An RLM environment whose sub-LLM calls run on the rlmq worker fleet.

    Every setting argument is a field of :class:`~rlmq.common.settings.RolloutOptions` of the
    same name (the one declaration of its type, default and unit): left out, it comes from
    ``settings``; given, it overrides ``settings`` for this environment (``None`` included:
    ``sub_llm_max_completion_tokens=None`` switches a budget off). The result is validated
    once, as a whole, and kept as ``env.settings``, which is all the rollout reads. Where the
    verifiers ``RLMEnv`` (0.1.14) has an argument of the same name, ``docs/verifiers-rlmenv.md``
    says whether its default and meaning are the same (``tests/unit/test_reference_table.py``
    holds the ``same`` ones to the reference's defaults); ``repl_language`` and
    ``max_sub_llm_parallelism`` are two that differ.

    Args (keyword only; one that is no ``RolloutOptions`` field raises
    :class:`~rlmq.common.errors.ConfigError`):
        tools: tools for the root REPL and the sub-LLMs alike, as the reference's ``tools``:
            callables or dotted import paths (``pkg.mod:func``). In the REPL each is a global of
            its own name that runs here, in the producer (:mod:`rlmq.producer.root_tools`). A
            sub-LLM's call runs on its worker when the worker allow-lists the tool's import path,
            else here too, through Redis (:mod:`rlmq.producer.hosted_tools`); a callable needs a
            module-level name either way (a lambda belongs in ``root_tools``). Default:
            ``settings.tools``.
        root_tools: tools for the root REPL only (callables or dotted paths; a lambda will
            do). Default: ``settings.root_tools``.
        hosted_sub_tools: callables for the sub-LLMs only (the reference's ``sub_tools`` as
            callables), nested functions included: they join ``sub_tools`` and run here, in the
            rollout's process, for every worker that does not allow-list their import path.
        settings: the base settings (Redis URL, queue, model server); default
            :func:`~rlmq.common.settings.load_settings` (the ``RLMQ_*`` and ``REDIS_URL`` variables).
        root: the root model client (a seam for tests); built from ``settings`` if ``None``.
        metrics: :class:`~rlmq.common.metrics.Metrics` to update with batches and refused calls.
    {setting_arguments}
    Raises:
        ConfigError: an unknown argument, or a value ``Settings`` refuses (named as the argument,
            or as the ``RLMQ_*`` variable it came from).

    Use as ``async with RLMEnv(...) as env: result = await env.rollout(row, model=...)``.
    """

    def __init__(
        self,
        *,
        max_turns: int | _FromSettings = FROM_SETTINGS,
        sub_llm_max_turns: int | _FromSettings = FROM_SETTINGS,
        sub_llm_max_completion_tokens: int | None | _FromSettings = FROM_SETTINGS,
        sub_llm_per_call_max_tokens: int | None | _FromSettings = FROM_SETTINGS,
        root_max_completion_tokens: int | None | _FromSettings = FROM_SETTINGS,
        max_sub_llm_parallelism: int | _FromSettings = FROM_SETTINGS,
        max_depth: int | _FromSettings = FROM_SETTINGS,
        child_root_min_grant_tokens: int | _FromSettings = FROM_SETTINGS,
        sub_model: str | None | _FromSettings = FROM_SETTINGS,
        sub_tools: list[str] | None | _FromSettings = FROM_SETTINGS,
        max_output_length: int | _FromSettings = FROM_SETTINGS,
        code_execution_timeout: float | _FromSettings = FROM_SETTINGS,
        max_startup_wait_seconds: float | _FromSettings = FROM_SETTINGS,
        repl_language: ReplLanguage | _FromSettings = FROM_SETTINGS,
        expose_message_history: bool | _FromSettings = FROM_SETTINGS,
        enable_sub_llms: bool | _FromSettings = FROM_SETTINGS,
        repl_output_format: Literal["rlmq", "reference"] | _FromSettings = FROM_SETTINGS,
        retain_filesystem_after_rollout: bool | _FromSettings = FROM_SETTINGS,
        abort_on_code_timeout: bool | _FromSettings = FROM_SETTINGS,
        root_context_tokens: int | None | _FromSettings = FROM_SETTINGS,
        context_warning_threshold: float | _FromSettings = FROM_SETTINGS,
        pip_install_packages: list[str] | str | _FromSettings = FROM_SETTINGS,
        root_prompt_verbosity: Verbosity | _FromSettings = FROM_SETTINGS,
        sub_prompt_verbosity: Verbosity | _FromSettings = FROM_SETTINGS,
        include_sub_llm_in_trajectory: bool | _FromSettings = FROM_SETTINGS,
        trajectory_token_max_bytes: int | _FromSettings = FROM_SETTINGS,
        rollout_timeout: float | _FromSettings = FROM_SETTINGS,
        sub_call_timeout: float | _FromSettings = FROM_SETTINGS,
        rollout_key_ttl: int | _FromSettings = FROM_SETTINGS,
        max_batch_prompts: int | _FromSettings = FROM_SETTINGS,
        max_batch_bytes: int | _FromSettings = FROM_SETTINGS,
        root_tool_timeout: float | _FromSettings = FROM_SETTINGS,
        root_tool_max_args_bytes: int | _FromSettings = FROM_SETTINGS,
        root_tool_max_result_bytes: int | _FromSettings = FROM_SETTINGS,
        hosted_tool_timeout: float | _FromSettings = FROM_SETTINGS,
        sub_tool_max_result_chars: int | _FromSettings = FROM_SETTINGS,
        system_prompt: str | None | _FromSettings = FROM_SETTINGS,
        system_prompt_mode: SystemPromptMode | _FromSettings = FROM_SETTINGS,
        sub_llm_final_answer_turn: bool | _FromSettings = FROM_SETTINGS,
        tools: Sequence[ToolLike] | None = None,
        root_tools: Sequence[ToolLike] | None = None,
        hosted_sub_tools: Sequence[Callable[..., Any]] = (),
        sampling_args: dict[str, Any] | _FromSettings = FROM_SETTINGS,
        sub_sampling_args: dict[str, Any] | _FromSettings = FROM_SETTINGS,
        settings: Settings | None = None,
        root: RootModel | None = None,
        metrics: Metrics | None = None,
        **unknown: Any,
    ) -> None:
        strangers = sorted(set(unknown) - set(RolloutOptions.model_fields))
        if strangers:
            known = ", ".join((*RolloutOptions.model_fields, "settings", "root", "metrics"))
            raise ConfigError(f"unknown RLMEnv argument(s): {', '.join(strangers)}; known: {known}")
        given = locals()
        # A RolloutOptions field not (yet) written out in the signature is taken all the same.
        overrides = {name: given[name] for name in _OVERRIDABLE if given[name] is not FROM_SETTINGS} | unknown
        if settings is not None and not isinstance(settings, Settings):
            raise ConfigError(f"settings must be a rlmq Settings, not {type(settings).__name__}")
        base = settings if settings is not None else build_settings(overrides, label=_argument)
        shared = list(base.tools if tools is None else tools)
        root_only = list(base.root_tools if root_tools is None else root_tools)
        sub_only = [(hosted_sub_tool_path(fn), fn) for fn in hosted_sub_tools]
        paths: dict[str, Any] = {
            "tools": shared_tool_paths(shared),
            "root_tools": [t if isinstance(t, str) else import_path(t) or repr(t) for t in root_only],  # as recorded
        }
        if sub_only:
            paths["sub_tools"] = [*overrides.get("sub_tools", base.sub_tools), *(p for p, _ in sub_only)]
        # The arguments over the given settings, or over the RLMQ_* variables (validated with them).
        self.settings: Settings = base.with_values({**overrides, **paths} if settings is not None else paths, _argument)
        s = self.settings
        self.toolbox = RootToolbox(
            [*shared, *root_only], timeout=s.root_tool_timeout, max_result_bytes=s.root_tool_max_result_bytes
        )
        """The root (REPL) tools: refused here when a name collides or does not resolve."""
        self.hosted = HostedTools(
            [(path, resolve_tool(tool)) for path, tool in zip(paths["tools"], shared, strict=True)] + sub_only,
            timeout=s.hosted_tool_timeout,
            max_args_bytes=s.root_tool_max_args_bytes,
            max_result_chars=s.sub_tool_max_result_chars,
        )
        """The shared tools, run here for the sub-LLMs' workers that do not allow-list them."""
        self._root = root
        self.metrics = metrics
        self._options = s.rollout_options()
        self._redis: Redis | None = None
        self._server: InterceptionServer | None = None
        self._host: RolloutHost | None = None
        self._refresher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> RLMEnv:
        """Connect to Redis and start the interception server and the live-rollout refresh.

        Raises:
            ConfigError: no Redis URL (or no root model URL when no ``root`` was given).
        """
        s = self.settings
        if not s.redis_url:
            raise ConfigError("RLMEnv needs settings.redis_url (or REDIS_URL)")
        if self._root is None:
            self._root = root_model(s, needed_for="RLMEnv needs settings.base_url for the root model")
        self._redis = async_client(
            s.redis_url, replica_acks=s.redis_replica_acks, replica_ack_timeout=s.redis_replica_ack_timeout
        )
        await self._redis.ping()
        try:
            await check_eviction_policy(self._redis, allow=s.allow_evicting_redis)
        except BaseException:
            await self._redis.aclose()
            self._redis = None
            raise
        started = await start_host(s, self._redis, self._root, metrics=self.metrics, toolbox=self.toolbox)
        self._server, self._host = started.server, started.host
        self._host.hosted = self.hosted
        self._refresher = asyncio.create_task(self._host.live.refresh_forever(s.rollout_key_ttl / 3))
        return self

    async def close(self) -> None:
        """Stop the interception server and close connections; idempotent."""
        if self._refresher:
            await cancel_and_wait([self._refresher])
            self._refresher = None
        self._host = None
        if self._server:
            await self._server.stop()
            self._server = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        if self._root is not None:
            with contextlib.suppress(Exception):
                await self._root.close()
        self.toolbox.close()

    async def __aenter__(self) -> RLMEnv:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ one rollout

    async def rollout(
        self,
        row: DatasetRow,
        *,
        model: str,
        rollout_id: str | None = None,
        rollout_index: int | None = None,
        sampling_args: dict[str, Any] | None = None,
    ) -> RolloutResult:
        """Run one rollout of ``row`` with root model ``model`` (:func:`~rlmq.producer.engine.run_rollout`
        with this environment's rollout options and connections); ``rollout_index`` (which of the
        row's rollouts, from 0; ``None``: the row has one) goes into the result row's ``rollout``;
        ``sampling_args`` (a verifiers rollout's own), when given, replace the ``sampling_args``
        setting for this rollout, root turns and sub-LLM calls alike (the per-call cap and the
        budget still apply).

        Never raises for a failure inside the rollout: it ends with ``stop_reason="error"``
        and the message in ``row.error``.

        Raises:
            RuntimeError: the environment was not started.
            asyncio.CancelledError: the rollout was cancelled before it finished (a stop
                signal, a caller's timeout), also when the cancellation surfaced as another
                exception inside it: a rollout cut short never becomes a row.
        """
        if self._host is None:
            raise RuntimeError("RLMEnv.start() first (or use `async with`)")
        s = self.settings
        queue = s.producer_queue(s.sub_model or model)
        options = self._options
        if sampling_args is not None:
            options = options.model_copy(update={"sampling_args": normalize_sampling(sampling_args, sub=False)})
        return await run_rollout(
            self._host, row, options, model=model, queue=queue, rollout_id=rollout_id, rollout_index=rollout_index
        )

    # ------------------------------------------------------------------ many rollouts

    async def evaluate(
        self,
        rows: Iterable[DatasetRow],
        *,
        model: str,
        concurrency: int = setting_default("concurrency"),
        on_done: Any = None,
        rollouts_per_example: int = setting_default("rollouts_per_example"),
        skip: Container[tuple[str, int]] = (),
    ) -> list[RolloutResult]:
        """Run ``rollouts_per_example`` rollouts per row, ``concurrency`` at a time; results in
        the rows' order (a row's rollouts in index order).

        Args:
            on_done: optional callable ``(RolloutResult) -> None`` called as each finishes
                (progress bars, incremental writes).
            rollouts_per_example: rollouts of each row (result rows ``rollout`` 0, 1, ...).
            skip: ``(row id, rollout index)`` pairs not to run (a resumed run's finished ones).
        """
        # A pool of ``concurrency`` runners takes the rollouts one after another: no task (nor
        # list entry) per rollout waiting its turn, so -r 100000000 starts at once.
        todo = ((row, k) for row in rows for k in range(rollouts_per_example) if (row.id, k) not in skip)
        out: dict[int, RolloutResult] = {}

        async def one(row: DatasetRow, k: int) -> RolloutResult:
            index = k if rollouts_per_example > 1 else None
            try:
                return await self.rollout(row, model=model, rollout_index=index)
            except Exception as exc:  # one rollout's failure (even past rollout's own guard) never ends the others
                raise_if_cancelled(f"rollout of row {row.id}")
                log.exception("rollout of row %s failed", row.id)
                return RolloutResult(
                    row=ResultRow(
                        id=row.id,
                        final_answer=None,
                        answer=row.answer,
                        correct=None,
                        stop_reason="error",
                        metrics={},
                        error=f"{type(exc).__name__}: {exc}",
                        rollout=index,
                    )
                )

        shared = enumerate(todo)  # one iterator for all the runners: each rollout is taken once

        async def runner() -> None:
            for i, (row, k) in shared:
                res = await one(row, k)
                out[i] = res
                if on_done is not None:
                    on_done(res)

        tasks = [asyncio.ensure_future(runner()) for _ in range(max(1, concurrency))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # gather ends at the first cancelled rollout; the others may still be closing their
            # REPLs. Wait for every one, so none outlives the environment (a REPL left running).
            await cancel_and_wait(tasks)
            raise
        return [out[i] for i in sorted(out)]


_OVERRIDABLE: Final = tuple(
    name for name, p in inspect.signature(RLMEnv.__init__).parameters.items() if p.default is FROM_SETTINGS
)
"""The setting arguments of :class:`RLMEnv`: every :class:`~rlmq.common.settings.RolloutOptions`
field (``tests/unit/test_settings_paths.py`` holds the two equal, types included)."""


def _argument(name: str) -> str:
    """How an error names a setting given to :class:`RLMEnv`: as the argument."""
    return f"RLMEnv argument {name}"


RLMEnv.__doc__ = re.sub(
    r"^[ \t]*\{setting_arguments\}", lambda _: arguments_doc(_OVERRIDABLE, indent=8), RLMEnv.__doc__ or "", flags=re.M
)
