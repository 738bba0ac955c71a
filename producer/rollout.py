"""One rollout's state.

A :class:`Rollout` is everything one rollout carries from its first root turn to its result
row: its ids, the sub-model and queue its ``llm_batch`` calls go to, its options (no secrets),
its budget ledger, its running figures (:class:`RolloutStats`), its trajectory and its
messages. The root loop that fills it is :mod:`rlmq.producer.root_loop`; the engine that runs
one rollout is :mod:`rlmq.producer.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlmq.common.schemas import DatasetRow, ResultRow, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.common.token_servers import TokenApi, TokenFieldsLog
from rlmq.common.token_wire import TokenCap, TurnEncoder
from rlmq.common.tool_wire import HostedTool
from rlmq.producer.child_trajectory import KeptChildren
from rlmq.producer.inflight import RolloutInFlight

if TYPE_CHECKING:
    from rlmq.producer.budget import RolloutBudget


def normalize_answer(text: str | None) -> str:
    """Case-folded, whitespace-collapsed, outer punctuation stripped (for ``correct``)."""
    if text is None:
        return ""
    t = " ".join(str(text).split()).casefold()
    return t.strip(" .,:;!?'\"`")


@dataclass
class RolloutResult:
    """A finished rollout: its result row and its trajectory.

    ``trajectory`` is a list of events: ``{"type": "root", ...}`` per root turn,
    ``{"type": "cell", "code", "output", "seconds", ...}`` per REPL cell and
    ``{"type": "llm_batch", "prompts", "results": [...]}`` per batch,
    ``{"type": "rlm_batch", "batch_id", "seconds", "tasks", "results": [...]}`` per ``rlm_batch``
    call (a result a child rollout answered carries ``child``: its depth, stop reason, metrics and
    own trajectory, nested the same way; see :mod:`rlmq.producer.tree_metrics`) and
    ``{"type": "root_tool", "name", "arguments", "ok", "result" | "error", "seconds"}`` per
    root-tool call (arguments and result cut to a preview).
    """

    row: ResultRow
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutStats:
    """Running figures of one rollout; :meth:`metrics` names them as verifiers does."""

    batches: list[int] = field(default_factory=list)
    """Size (prompts) of each ``llm_batch`` call."""
    sub: list[SubLLMResult] = field(default_factory=list)
    root_turns: int = 0
    root_prompt_tokens: int = 0
    root_completion_tokens: int = 0
    repl_times: list[float] = field(default_factory=list)
    """Seconds of each REPL cell."""
    root_tool_calls: dict[str, int] = field(default_factory=dict)
    """Calls of each root (REPL) tool, by name (every tool of the environment, 0 when uncalled)."""
    root_tool_seconds: float = 0.0
    root_tool_errors: int = 0
    llm_batch_seconds: list[float] = field(default_factory=list)
    """Seconds each ``llm_batch`` call took, as the producer served it."""
    rlm_batches: int = 0
    """``rlm_batch`` calls that started child rollouts (their batch ids ``r1``, ``r2``, ...; the
    tree's figures come from their trajectory events, :mod:`rlmq.producer.tree_metrics`)."""

    def metrics(self) -> dict[str, float | int]:
        """The result row's metrics (names of verifiers' ``RLMEnv`` plus rlmq's own)."""
        sub = self.sub
        waits = [r.queue_wait_seconds for r in sub if r.status != "rejected" and r.job_id]
        batches = self.batches
        times = self.repl_times
        tools = sum(self.root_tool_calls.values())
        return {
            "sub_llm_call_count": sum(1 for r in sub if r.status != "rejected"),  # the calls that ran
            "sub_llm_total_turns": sum(r.turns for r in sub),
            "sub_llm_prompt_tokens": sum(r.prompt_tokens for r in sub),
            "sub_llm_completion_tokens": sum(r.completion_tokens for r in sub),
            "sub_llm_total_tool_calls": sum(r.tool_calls for r in sub),
            "sub_llm_batch_count": len(batches),
            "sub_llm_max_batch_size": max(batches, default=0),
            "sub_llm_mean_batch_size": round(sum(batches) / len(batches), 3) if batches else 0.0,
            "main_rlm_turns": self.root_turns,
            "main_rlm_prompt_tokens": self.root_prompt_tokens,
            "main_rlm_completion_tokens": self.root_completion_tokens,
            "repl_call_count": len(times),
            "repl_total_time_seconds": round(sum(times), 4),
            "repl_mean_time_seconds": round(sum(times) / len(times), 4) if times else 0.0,
            "sub_llm_rejected_count": sum(1 for r in sub if r.status == "rejected"),
            "sub_llm_error_count": sum(1 for r in sub if r.status == "error"),
            "sub_llm_budget_waits": sum(r.budget_waits for r in sub),
            "sub_llm_budget_wait_seconds": round(sum(r.budget_wait_seconds for r in sub), 4),
            "sub_llm_truncated_count": sum(1 for r in sub if r.truncated),
            "sub_llm_segment_count": sum(r.segments for r in sub),
            "sub_llm_overrun_tokens": sum(r.overrun_tokens for r in sub),
            "sub_llm_underreported_tokens": sum(r.underreported_tokens for r in sub),
            "sub_llm_queue_wait_seconds_mean": round(sum(waits) / len(waits), 5) if waits else 0.0,
            # as the reference (0.1.14), where llm_batch is a root tool: its calls count too
            "root_tool_call_count": tools + len(batches),
            "llm_batch_mean_time_seconds": _mean(self.llm_batch_seconds),
            "root_tool_non_llm_mean_time_seconds": round(self.root_tool_seconds / tools, 4) if tools else 0.0,
            "root_llm_turns": self.root_turns,
            "root_llm_prompt_tokens": self.root_prompt_tokens,
            "root_llm_completion_tokens": self.root_completion_tokens,
            "sub_llm_max_turns_reached_frac": (
                round(sum(1 for r in sub if r.final_turn is not None) / len(sub), 4) if sub else 0.0
            ),
            "root_tool_total_time_seconds": round(self.root_tool_seconds, 4),
            "root_tool_error_count": self.root_tool_errors,
            **{f"{name}_root_calls": n for name, n in self.root_tool_calls.items()},
        }


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


@dataclass
class Rollout:
    """One rollout in flight.

    Attributes:
        id: the rollout id (``[A-Za-z0-9_-]``, the hash tag of its Redis keys).
        row: the dataset row.
        model / sub_model: root and sub-LLM model names.
        queue: the tenant queue its sub-calls are enqueued on.
        options: every limit and knob of this rollout (no connection, no secret).
        ledger: the rollout's sub-LLM budget in Redis (``None``: no budget).
    """

    id: str
    row: DatasetRow
    model: str
    sub_model: str
    queue: str
    options: RolloutOptions
    ledger: RolloutBudget | None = None
    stats: RolloutStats = field(default_factory=RolloutStats)
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    ledger_id: str = ""
    """The budget ledger its calls charge (``""``: its own, id = the rollout id; a child rollout
    of a tree carries its top rollout's)."""
    hosted_tools: tuple[HostedTool, ...] = ()
    """Shared tools its tree's top rollout runs in its process for the workers of its sub-LLMs
    (:mod:`rlmq.producer.hosted_tools`): a top's own, a child's handed down by its parent."""
    nodes: tuple[str, ...] = ()
    """Its tree chain, top .. itself, carried by its calls (empty for a top rollout: its calls
    carry none; see :class:`~rlmq.common.tree.TreePosition`)."""
    frozen: bool = False
    """Its root model is served by a frozen fleet (:attr:`RolloutHost.frozen
    <rlmq.producer.engine.RolloutHost.frozen>`): its root turns are untrainable (``frozen_fleet``)."""
    token_api: TokenApi = field(default_factory=TokenApi)
    """How its root model server is asked for served tokens and read (its host's)."""
    token_fields_log: TokenFieldsLog = field(default_factory=TokenFieldsLog)
    """Its host's: says once that the root model server answers no token field rlmq reads."""
    kept_children: KeptChildren = field(default_factory=KeptChildren)
    """What is left of its allowance of child trajectories (:mod:`rlmq.producer.child_trajectory`)."""
    inflight: RolloutInFlight = field(init=False)
    """Its sub-calls queued or running at once over all its batches (``max_sub_llm_parallelism``)."""
    root_tokens: TurnEncoder = field(default_factory=TurnEncoder)
    """Writes its root turns' token records (prefix-shared, :mod:`rlmq.producer.root_tokens`)."""
    token_cap: TokenCap = field(init=False)
    """What is left of its byte cap on token payloads (``trajectory_token_max_bytes``), shared by
    its root turns and its sub-calls' turns (:mod:`rlmq.common.token_wire`)."""

    def __post_init__(self) -> None:
        self.ledger_id = self.ledger_id or self.id
        self.inflight = RolloutInFlight(self.options.max_sub_llm_parallelism)
        self.token_cap = TokenCap(self.options.trajectory_token_max_bytes)

    def admit_tokens(self, results: list[SubLLMResult]) -> None:
        """Put its sub-calls' token records under its byte cap (in place, in slot order)."""
        for r in results:
            if r.turn_tokens:
                r.turn_tokens = [self.token_cap.admit(t) for t in r.turn_tokens]

    @property
    def budget(self) -> int | None:
        """The sub-LLM completion-token budget (``None``: no budget)."""
        return self.options.sub_llm_max_completion_tokens

    def start_batch(self, size: int) -> str:
        """Record a batch of ``size`` prompts; returns its id, ``b1``, ``b2``, ... (batch ids hold
        no ``-``: see :mod:`rlmq.producer.dispatch`)."""
        self.stats.batches.append(size)
        return f"b{len(self.stats.batches)}"

    def start_rlm_batch(self) -> str:
        """Record an ``rlm_batch`` that starts child rollouts; returns its id, ``r1``, ``r2``, ..."""
        self.stats.rlm_batches += 1
        return f"r{self.stats.rlm_batches}"
