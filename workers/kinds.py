"""The job kinds a worker runs: one registration each (arq's ``Function`` / ``func()`` is the model).

A job's kind is named by the function path in its RQ data (``rlmq.workers.job.run_sub_llm`` for
a sub-LLM call, :data:`rlmq.common.jobs.record.SUB_LLM_FUNC`). A :class:`JobKind` says how to
validate its one argument (its payload model), how to run it, how many executions it may get
(``max_attempts``, for the reaper), how long it may run on a worker (``timeout``), which
capacity pool it takes (:mod:`rlmq.workers.capacity`) and what result it ends with when it
fails without running (an invalid payload, a timeout, its worker gone: ``failure``). The
sub-LLM call (:mod:`rlmq.workers.subllm_kind`) is registered on every worker; a child rollout
(:mod:`rlmq.workers.child_kind`) on a worker started with ``--repl-slots``. A kind's
``pool`` names a pool family; the queue a job came from picks the pool (one per depth for child
rollouts, :func:`rlmq.workers.capacity.pool_of_queue`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlmq.common import keys as K
from rlmq.common.budget.calls import Settle
from rlmq.common.errors import PayloadError
from rlmq.common.jobs.record import decode_job_data
from rlmq.common.jobs.store import StartedJob
from rlmq.common.schemas import ChildRolloutRequest, SubLLMRequest
from rlmq.workers.capacity import pool_family


@dataclass(slots=True)
class Outcome:
    """What a finished job delivers.

    Attributes:
        ok: recorded by RQ as finished (else failed).
        result_json: the result added to the job's reply stream.
        rq_payload: RQ's result record (see :func:`rlmq.common.jobs.record.rq_return_value`).
        settles: budget settlements sent in the same round trip (:class:`~rlmq.common.budget.calls.Settle`).
        spill_key: where its token payload was spilled (deleted when ``FINISH`` does not record it).
    """

    ok: bool
    result_json: str
    rq_payload: str
    settles: list[Settle] = field(default_factory=list)
    spill_key: str | None = None


Failure = Callable[[str, "bytes | None", str, str, int], Outcome]
"""``(job id, its rlmq_meta or None, error kind, message, attempt) -> Outcome``: a kind's failure result."""


@dataclass(frozen=True)
class JobKind:
    """One kind of job.

    Attributes:
        name: a short name for logs (``sub_llm``).
        func: the function path its RQ job data names (the producer enqueues by it).
        load: validates the job's one argument into its payload model.
            Raises :class:`~rlmq.common.errors.PayloadError`.
        run: runs one job, ``(payload, job) -> Outcome``; never raises but for cancellation.
        failure: its failure result (see :data:`Failure`).
        pool: the capacity pool a job of this kind takes a slot of while it runs.
        max_attempts: executions a job may get before the reaper fails it (>= 1).
        timeout: seconds a job may run on a worker before it ends with ``failure`` (kind
            ``timeout``); ``None``: its payload's own deadline bounds it.
        abandoned: ``(job id, its rlmq_meta or None) -> result JSON`` the reaper delivers for a
            job whose attempts are used up; ``None``: the job store's (a sub-LLM error result).
        check_pool: ``(payload, pool, queue)`` raises :class:`~rlmq.common.errors.PayloadError`
            when a job of this kind taken from ``queue`` may not take a slot of ``pool`` (a child
            of another depth); ``None``: any.
        dead_attempts: awaited with the executions a reaper took back from a queue of this kind
            (``(job id, attempt)`` each), to end what they left running (a child's subtree).
    """

    name: str
    func: str
    load: Callable[[Any], Any]
    run: Callable[[Any, StartedJob], Awaitable[Outcome]]
    failure: Failure
    pool: str
    max_attempts: int = 2
    timeout: float | None = None
    abandoned: Callable[[str, bytes | None], str] | None = None
    check_pool: Callable[[Any, str, str], None] | None = None
    dead_attempts: Callable[[list[tuple[str, int]]], Awaitable[Any]] | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"job kind {self.name}: max_attempts must be >= 1")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"job kind {self.name}: timeout must be > 0 seconds")


class KindRegistry:
    """The job kinds of one worker, by function path; the first registered is the default (the
    kind whose failure result a job of no known kind gets)."""

    def __init__(self) -> None:
        self._kinds: dict[str, JobKind] = {}

    def register(self, kind: JobKind) -> JobKind:
        """Add ``kind``.

        Raises:
            ValueError: a kind with the same function path is registered already.
        """
        if kind.func in self._kinds:
            raise ValueError(f"job kind for {kind.func} registered twice")
        self._kinds[kind.func] = kind
        return kind

    @property
    def default(self) -> JobKind:
        """The first kind registered.

        Raises:
            LookupError: none is.
        """
        for kind in self._kinds.values():
            return kind
        raise LookupError("no job kind registered")

    def by_func(self, func: str) -> JobKind:
        """The kind registered for function path ``func``.

        Raises:
            KeyError: none is.
        """
        return self._kinds[func]

    def for_pool(self, pool: str | None) -> JobKind:
        """The kind whose jobs take slots of ``pool`` (a pool or its family: ``repl@2`` is a
        ``repl`` slot, :func:`~rlmq.workers.capacity.pool_family`); the default kind for ``None``
        or a pool no kind takes."""
        if pool is not None:
            family = pool_family(pool)
            for kind in self._kinds.values():
                if kind.pool == family:
                    return kind
        return self.default

    def __iter__(self) -> Iterator[JobKind]:
        return iter(self._kinds.values())

    def decode(self, data: bytes) -> tuple[JobKind, Any]:
        """The kind and validated payload of RQ job ``data``.

        Raises:
            PayloadError: the data is not an rlmq job of a registered kind, or its payload is
                invalid (``RecursionError`` of a JSON nested 100,000 deep included).
        """
        try:
            func, args, kwargs = decode_job_data(data)
        except ValueError as exc:
            raise PayloadError(str(exc)) from exc
        except RecursionError as exc:
            raise PayloadError("job data nested too deep") from exc
        kind = self._kinds.get(func)
        if kind is None or len(args) != 1 or kwargs:
            raise PayloadError(f"not an rlmq job of a kind this worker runs: {func}")
        try:
            return kind, kind.load(args[0])
        except RecursionError as exc:
            raise PayloadError(f"invalid {kind.name} payload: nested too deep") from exc


def check_slot(job_id: str, payload: object) -> None:
    """A sub-LLM or child-rollout payload must name the slot its job id names: a tenant's producer
    may write only its own rollouts' job ids, so the payload must not name (and charge) another rollout.

    Raises:
        PayloadError: it names another slot.
    """
    if isinstance(payload, (SubLLMRequest, ChildRolloutRequest)) and K.parse_job_id(job_id) != (
        payload.rollout_id, payload.batch_id, payload.index,
    ):  # fmt: skip
        raise PayloadError(f"job {job_id} names another slot ({payload.rollout_id}, {payload.batch_id})")
