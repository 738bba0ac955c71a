"""Every Redis key name rlmq reads or writes, in one place.

Two families live here:

* rlmq's own keys, all under the prefix ``rlmq:``. Keys of one rollout carry the
  hash tag ``{<rollout_id>}`` so a Lua script touching several of them stays in one
  Redis Cluster slot. Every rollout key gets a TTL that the producer refreshes while
  the rollout lives (``Settings.rollout_key_ttl``), so an abandoned rollout leaves
  nothing behind.
* RQ's keys (``rq:...``), which rlmq's producer and worker write directly on the hot
  path so that ``rq info`` and rq-dashboard stay truthful. ``tests/unit/test_keys.py``
  checks them against RQ's own key builders, so an RQ release that renames them fails
  loudly instead of silently diverging.
"""

from __future__ import annotations

import re

from rlmq.common.errors import ConfigError

PREFIX = "rlmq"
RQ_PREFIX = "rq"

_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def namespace(*parts: str) -> str:
    """Join ``parts`` under the ``rlmq:`` prefix: ``namespace("a", "b") == "rlmq:a:b"``."""
    return ":".join((PREFIX, *parts))


def check_rollout_id(rollout_id: str) -> str:
    """Return ``rollout_id`` if it is 1-64 characters of ``[A-Za-z0-9_-]``.

    Raises:
        ConfigError: otherwise (rollout ids become part of RQ job ids, which RQ restricts).
    """
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        raise ConfigError(f"invalid rollout id {rollout_id!r}: use 1-64 characters of [A-Za-z0-9_-]")
    return rollout_id


def queue_name_for_model(model: str) -> str:
    """The RQ queue name that serves sub-LLM calls for ``model``.

    Producer (``rlmq run --sub-model m``) and worker (``rlmq worker --model m``) both
    derive it here, so they meet without configuration: ``"Qwen/Qwen3-8B"`` becomes
    ``"rlmq.sub.Qwen_Qwen3-8B"``.
    """
    slug = _SLUG.sub("_", model).strip("_") or "default"
    return f"{PREFIX}.sub.{slug}"


def tenant_queue(base: str, tenant: str | None) -> str:
    """The queue a producer of ``tenant`` uses for the model queue ``base``: ``base@tenant``.

    Workers serving ``base`` also serve every ``base@*`` queue, round-robin, so one trainer
    node's burst cannot starve another's small batch. ``None`` or ``""``: ``base`` itself.
    """
    if not tenant:
        return base
    return f"{base}@{_SLUG.sub('_', tenant).strip('_') or 'default'}"


def serves(base: str, queue: str) -> bool:
    """True when a worker of queue ``base`` serves ``queue`` (``base`` or one of its tenants)."""
    return queue == base or queue.startswith(base + "@")


CHILD_QUEUE_MARK = "+rlm"
"""Between a model queue's base name and a depth in the name of its child-rollout queue."""


def child_queue(queue: str, depth: int) -> str:
    """The queue of the child rollouts at ``depth`` (>= 2) whose root model serves ``queue``.

    ``rlmq.sub.m`` gives ``rlmq.sub.m+rlm2``; a tenant's ``rlmq.sub.m@t`` gives
    ``rlmq.sub.m+rlm2@t`` (the tenant stays last, so a tenant's ACL pattern covers it). One queue
    per depth, so a worker whose slots for one depth are full still takes the jobs of another
    (a parent waiting for its children never holds what they need: no deadlock).

    Raises:
        ValueError: ``depth`` < 2.
    """
    if depth < 2:
        raise ValueError(f"child rollouts have depth >= 2, not {depth}")
    base, at, tenant = queue.partition("@")
    return f"{base}{CHILD_QUEUE_MARK}{depth}{at}{tenant}"


def parse_child_queue(queue: str) -> tuple[str, int] | None:
    """Inverse of :func:`child_queue`: ``(the model queue, depth)``, or ``None`` when ``queue`` is
    not a child-rollout queue. ``rlmq.sub.m+rlm2@t`` gives ``("rlmq.sub.m@t", 2)``."""
    base, at, tenant = queue.partition("@")
    model, mark, depth = base.rpartition(CHILD_QUEUE_MARK)
    if not mark or not model or not depth.isdigit() or int(depth) < 2:
        return None
    return f"{model}{at}{tenant}", int(depth)


def check_ledger_id(ledger_id: str) -> str:
    """Return ``ledger_id`` if it is 1-64 characters of ``[A-Za-z0-9_-]`` (a rollout id's alphabet).

    Raises:
        ConfigError: otherwise.
    """
    if not _ROLLOUT_ID.fullmatch(ledger_id):
        raise ConfigError(f"invalid ledger id {ledger_id!r}: use 1-64 characters of [A-Za-z0-9_-]")
    return ledger_id


class LedgerKeys:
    """Key names of one budget ledger (all share the hash tag ``{ledger_id}``).

    A ledger is addressed by its own id, not by a rollout's: every rollout of one tree charges
    the one ledger its top rollout opened. A depth-1 rollout opens a ledger whose id
    is its own rollout id, so its ledger keys then share its rollout keys' hash tag (and names).
    The ledger's owner refreshes these keys' TTL; the TTL itself is stored in the ledger.

    Args:
        ledger_id: the ledger's id, ``[A-Za-z0-9_-]{1,64}``.
    """

    __slots__ = ("ledger_id", "tag")

    def __init__(self, ledger_id: str) -> None:
        self.ledger_id = check_ledger_id(ledger_id)
        self.tag = "{" + ledger_id + "}"

    @property
    def budget(self) -> str:
        """Hash: the ledger (``limit``, ``charged``, ``grants``, ``ttl``, ``cap``, ``cap:<kind>``, ...)."""
        return namespace(self.tag, "budget")

    @property
    def reservations(self) -> str:
        """Hash: reservation id -> ``open:<grant>`` or ``settled:<used>``."""
        return namespace(self.tag, "resv")

    @property
    def live_reservations(self) -> str:
        """Sorted set: open reservation id -> its call's deadline (Unix seconds); the reservations
        that may still give tokens back (a call finding the budget held waits for them)."""
        return namespace(self.tag, "live")

    @property
    def released(self) -> str:
        """Pub/sub channel (no TTL: channels hold nothing): the ledger's settle script publishes
        here after a settlement, once the ledger has had a waiting call; waiters wake on it."""
        return namespace(self.tag, "released")

    @property
    def grant_leases(self) -> str:
        """Sorted set: leased reservation id -> when its lease ends (Unix seconds). A leased grant not
        begun by then (its call never reached the model) is reclaimed by the next reservation."""
        return namespace(self.tag, "leases")

    @property
    def answers(self) -> str:
        """Hash: answer id (its first segment's reservation id) -> ``<deadline> <spent> <reach> <whole>
        <kind>``: the answers granted in segments that are running (``docs/budget.md``); a new answer
        starts only while the free budget also covers what they are estimated to need."""
        return namespace(self.tag, "answers")

    def node(self, node_id: str) -> str:
        """String with a short TTL: present while the tree node ``node_id`` (a rollout of the tree,
        by the id it runs under) is alive; its host refreshes it, and deletes it when the rollout
        ends. A reservation naming a node whose key is gone is refused (:mod:`rlmq.common.budget.ledger`).

        Raises:
            ConfigError: ``node_id`` is not 1-64 characters of ``[A-Za-z0-9_-]``.
        """
        return namespace(self.tag, "node", check_rollout_id(node_id))

    def all(self) -> list[str]:
        """The ledger's keys (for TTL refresh and cleanup; the channel and the node keys, which
        have TTLs of their own, are not listed)."""
        return [self.budget, self.reservations, self.live_reservations]


class RolloutKeys:
    """Key names of one rollout (all share the hash tag ``{rollout_id}``).

    ``budget``, ``reservations``, ``live_reservations`` and ``released`` are the keys of the
    ledger a rollout opens *for itself* (``LedgerKeys(rollout_id)``: a depth-1 rollout, or the top
    of a tree); code that charges a ledger uses :class:`LedgerKeys` of the ledger id its job carries.

    Args:
        rollout_id: the rollout's id, ``[A-Za-z0-9_-]{1,64}``.
    """

    __slots__ = ("rollout_id", "tag")

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = check_rollout_id(rollout_id)
        self.tag = "{" + rollout_id + "}"

    @property
    def budget(self) -> str:
        """Hash: the budget ledger this rollout opened for itself (see :class:`LedgerKeys`)."""
        return LedgerKeys(self.rollout_id).budget

    @property
    def reservations(self) -> str:
        """Hash: the reservations of the ledger this rollout opened for itself."""
        return LedgerKeys(self.rollout_id).reservations

    @property
    def live_reservations(self) -> str:
        """Sorted set: the live reservations of the ledger this rollout opened for itself."""
        return LedgerKeys(self.rollout_id).live_reservations

    @property
    def released(self) -> str:
        """Pub/sub channel of the ledger this rollout opened for itself."""
        return LedgerKeys(self.rollout_id).released

    @property
    def info(self) -> str:
        """Hash: what ``rlmq status`` shows of a live rollout (model, queue, started)."""
        return namespace(self.tag, "info")

    def reply(self, batch_id: str) -> str:
        """Stream: the reply channel of one ``llm_batch`` call; workers ``XADD`` each result
        (field :data:`REPLY_FIELD`), the producer reads it with ``XREAD`` from the last id it
        saw, so a read whose reply is lost is read again, never lost (a destructive pop would be)."""
        return namespace(self.tag, "reply", batch_id)

    def spill(self, job_id: str, attempt: int = 1) -> str:
        """String: the token payload of one job attempt's result, moved off the reply stream when
        large (:mod:`rlmq.common.jobs.spill`); written by the worker with a TTL, read and deleted by
        the producer once the result is taken."""
        return namespace(self.tag, "spill", job_id, str(attempt))

    @property
    def tool_requests(self) -> str:
        """Stream: sub-LLM calls of the rollout's hosted tools (callables that live in the rollout's
        process); workers ``XADD`` each request (:mod:`rlmq.common.tool_wire`), the rollout reads
        them with ``XREAD`` from the last id it saw."""
        return namespace(self.tag, "toolreq")

    def tool_answer(self, request_id: str) -> str:
        """Stream: the answer of one hosted-tool request (one entry, TTL'd); the worker reads it with
        ``XREAD`` from the start, so a read whose reply was lost is simply read again."""
        return namespace(self.tag, "toolans", request_id)

    def all_static(self) -> list[str]:
        """The rollout's keys that do not depend on a batch (for TTL refresh and cleanup)."""
        own = LedgerKeys(self.rollout_id)
        return [self.budget, self.reservations, self.live_reservations, own.grant_leases, own.answers, self.info]


REPLY_FIELD = "r"
"""The field of a reply-stream entry that holds the :class:`~rlmq.common.schemas.SubLLMResult` JSON."""

ORPHAN_REPLIES = namespace("orphan-replies")
"""Stream where the reaper writes the error result of a job whose hash names no reply channel."""


def job_id(rollout_id: str, batch_id: str, index: int) -> str:
    """RQ job id of slot ``index`` of a batch: ``<rollout>-<batch>-<index>`` (batch ids have no ``-``)."""
    return f"{rollout_id}-{batch_id}-{index}"


def parse_job_id(jid: str) -> tuple[str, str, int] | None:
    """Inverse of :func:`job_id`: ``(rollout id, batch id, index)``, or ``None`` for another shape."""
    parts = jid.split("-")
    if len(parts) < 3 or not parts[-1].isdigit() or not parts[-2]:
        return None
    return "-".join(parts[:-2]), parts[-2], int(parts[-1])


def serving(queue: str) -> str:
    """Sorted set: names of the live workers of ``queue``'s model queue -> heartbeat expiry
    (Unix s, Redis's clock: ``TIME``).

    Workers add themselves with every heartbeat; the producer counts the members whose expiry
    is later than ``now - SERVING_CLOCK_SKEW`` to tell, within seconds, that nobody serves a
    queue (tenants included); ``rlmq status`` counts those whose expiry is later than Redis's now."""
    return namespace("serving", queue.split("@", 1)[0])


SERVING_CLOCK_SKEW = 30.0
"""Seconds of clock difference between Redis and a producer's host that :func:`serving`
tolerates (expiries are Redis's clock, compared with the producer's): a queue whose workers
all died is reported ``no_worker`` up to this much later."""


LIVE_ROLLOUTS = namespace("rollouts")
"""Sorted set: rollout id -> expiry timestamp (seconds); what ``rlmq status`` lists."""

REPLICA_ACK_MARK = namespace("replica-ack")
"""String (a few bytes, short TTL): written right before a ``WAIT`` for replicas' acknowledgement
(:mod:`rlmq.common.budget.replica_acks`), so that the ``WAIT`` covers every write the master made before it.
Its value means nothing."""


def wake_channel(queue: str) -> str:
    """Pub/sub channel producers publish on after enqueueing on ``queue`` or its tenants."""
    return namespace("wake", queue.split("@", 1)[0])


def wake_message(queue: str, ids: list[str] | None = None, *, announce_only: bool = False) -> str:
    """The text published on :func:`wake_channel` after enqueueing on ``queue``.

    ``<queue>``: wake up and look at the queues; ``<queue>`` newline ``<id> <id> ...``:
    wake up, these jobs are waiting; ``<queue>`` newline: serve this queue from now on,
    nothing to wake up for (its jobs went to the :func:`lane`).
    """
    if announce_only:
        return queue + "\n"
    return queue + ("\n" + " ".join(ids) if ids else "")


def parse_wake_message(text: str) -> tuple[str, list[str], bool]:
    """Inverse of :func:`wake_message`: ``(queue, job ids, announce_only)``."""
    queue, sep, rest = text.partition("\n")
    return queue, rest.split(), bool(sep) and not rest


def lane(queue: str) -> str:
    """List of small batches announced to the idle workers of ``queue`` and its tenants.

    Each entry is a :class:`rlmq.common.schemas.LaneEntry`; one ``BLPOP`` hands it to exactly
    one idle worker. The list is a hint, never the record: the jobs are also on their RQ
    queue, so an entry that is lost or popped late costs latency, never a job."""
    return namespace("lane", queue.split("@", 1)[0])


class ProviderKeys:
    """Key names of one upstream's fleet-wide provider limits (all share the hash tag ``{upstream}``).

    An upstream is what a provider counts a quota against: a model queue, or one API key that
    several queues share (:mod:`rlmq.common.provider_limits`). Every key has a TTL of a few
    windows, renewed by each grant, so an upstream nobody calls leaves nothing behind.

    Args:
        upstream: the upstream's name, 1-64 characters of ``[A-Za-z0-9._@+-]``.

    Raises:
        ConfigError: another name.
    """

    __slots__ = ("tag", "upstream")

    def __init__(self, upstream: str) -> None:
        if not _UPSTREAM.fullmatch(upstream):
            raise ConfigError(f"invalid provider upstream {upstream!r}: use 1-64 characters of [A-Za-z0-9._@+-]")
        self.upstream = upstream
        self.tag = "{" + upstream + "}"

    @property
    def requests(self) -> str:
        """Sorted set: request id -> when it was granted (Unix seconds, Redis's clock): the window's log."""
        return namespace("plimit", self.tag, "req")

    @property
    def tokens(self) -> str:
        """Hash: request id -> tokens it counts in the window; field ``_sum``: their sum."""
        return namespace("plimit", self.tag, "tok")

    @property
    def running(self) -> str:
        """Sorted set: request id -> when its lease ends (Unix seconds): the requests in flight."""
        return namespace("plimit", self.tag, "run")

    @property
    def paused(self) -> str:
        """String: until when (Unix seconds, Redis's clock) the upstream is paused after a 429."""
        return namespace("plimit", self.tag, "pause")

    def all(self) -> list[str]:
        """The upstream's keys, in the order the limiter's scripts take them."""
        return [self.requests, self.tokens, self.running, self.paused]


_UPSTREAM = re.compile(r"[A-Za-z0-9._@+-]{1,64}")

PROVIDER_LIMITS = namespace("plimits")
"""Hash: upstream name -> the limits its workers declared (JSON), for ``rlmq status``."""


# ---------------------------------------------------------------------------
# RQ's keys (RQ 2.x / 3.x layout)


def rq_queue(queue: str) -> str:
    """List of job ids waiting on ``queue`` (``Queue.key``)."""
    return f"{RQ_PREFIX}:queue:{queue}"


RQ_QUEUES = f"{RQ_PREFIX}:queues"
"""Set of all queue keys (``Queue.redis_queues_keys``)."""


def _name_after(key: str | bytes, prefix: str) -> str:
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    return text[len(prefix) :] if text.startswith(prefix) else text


def queue_of_key(key: str | bytes) -> str:
    """The queue name of a queue key (a member of :data:`RQ_QUEUES`): inverse of :func:`rq_queue`."""
    return _name_after(key, rq_queue(""))


def worker_of_key(key: str | bytes) -> str:
    """The worker name of a worker key (a member of :data:`RQ_WORKERS`): inverse of :func:`rq_worker`."""
    return _name_after(key, rq_worker(""))


RQ_WORKERS = f"{RQ_PREFIX}:workers"
"""Set of all worker keys (``Worker.redis_workers_keys``)."""


def rq_job(job_id: str) -> str:
    """Hash of one job (``Job.key``)."""
    return f"{RQ_PREFIX}:job:{job_id}"


def rq_results(job_id: str) -> str:
    """Stream of one job's results (``Result.get_key``)."""
    return f"{RQ_PREFIX}:results:{job_id}"


def rq_started(queue: str) -> str:
    """Sorted set ``job_id:execution_id`` -> heartbeat expiry (``StartedJobRegistry.key``)."""
    return f"{RQ_PREFIX}:wip:{queue}"


def rq_finished(queue: str) -> str:
    """Sorted set job id -> expiry (``FinishedJobRegistry.key``)."""
    return f"{RQ_PREFIX}:finished:{queue}"


def rq_failed(queue: str) -> str:
    """Sorted set job id -> expiry (``FailedJobRegistry.key``)."""
    return f"{RQ_PREFIX}:failed:{queue}"


def rq_other_registry(kind: str, queue: str) -> str:
    """Sorted set of one of RQ's registries rlmq never writes (``deferred``, ``ready``,
    ``scheduled``, ``canceled``): RQ's maintenance (``rq info``) reads and prunes them."""
    return f"{RQ_PREFIX}:{kind}:{queue}"


RQ_RATE_LIMIT_KEYS = f"{RQ_PREFIX}:rl-keys"
"""Set of RQ's rate-limit registries (rlmq has none); RQ's maintenance (``rq info``) reads it."""


def rq_worker(worker_name: str) -> str:
    """Hash of one worker (``Worker.key``)."""
    return f"{RQ_PREFIX}:worker:{worker_name}"


def rq_workers_of_queue(queue: str) -> str:
    """Set of the worker keys serving ``queue``."""
    return f"{RQ_PREFIX}:workers:{queue}"


def rq_worker_executions(worker_name: str) -> str:
    """Set of ``job_id:execution_id`` a worker runs now (``Execution.worker_executions_key``)."""
    return f"{RQ_PREFIX}:worker:{worker_name}:executions"


def rq_execution(job_id: str, execution_id: str) -> str:
    """Hash of one execution of a job (``Execution.key``)."""
    return f"{RQ_PREFIX}:execution:{job_id}:{execution_id}"


def rq_job_executions(job_id: str) -> str:
    """Sorted set of a job's executions (``ExecutionRegistry.key``)."""
    return f"{RQ_PREFIX}:executions:{job_id}"


# ---------------------------------------------------------------------------
# Who uses which key: the source of the ACL rules (:mod:`rlmq.common.acl`)


class KeyUse:
    """How the roles of a fleet use one family of names declared above.

    Args:
        template: the name of its builder in this module (``"rq_job"``, ``"RolloutKeys.budget"``).
        pattern: a Redis glob matching every name of the family (``"rq:job:*"``).
        producer / worker / dashboard: ``""`` none, ``"r"`` read, ``"rw"`` read and write
            (for a channel: ``"rw"`` publish and subscribe).
        channel: a pub/sub channel, not a key.
        tenant_pattern: the glob confining a tenant's producer (``{t}`` is the tenant), or
            ``None`` when every tenant's producer needs the whole family (shared hints).
    """

    __slots__ = ("channel", "dashboard", "pattern", "producer", "template", "tenant_pattern", "worker")

    def __init__(
        self,
        template: str,
        pattern: str,
        producer: str,
        worker: str,
        dashboard: str,
        *,
        channel: bool = False,
        tenant_pattern: str | None = None,
    ) -> None:
        self.template, self.pattern, self.channel = template, pattern, channel
        self.producer, self.worker, self.dashboard = producer, worker, dashboard
        self.tenant_pattern = tenant_pattern

    def access(self, role: str) -> str:
        """``""``, ``"r"`` or ``"rw"``: what ``role`` (``producer``, ``worker``, ``dashboard``) does."""
        return str(getattr(self, role))


_ROLLOUT_T = "rlmq:{{{t}_*"
KEY_USES: tuple[KeyUse, ...] = (
    # a ledger's keys: its id is its top rollout's id, so a tenant's ledgers are its own
    KeyUse("LedgerKeys.budget", "rlmq:{*}:budget", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.reservations", "rlmq:{*}:resv", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.live_reservations", "rlmq:{*}:live", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.grant_leases", "rlmq:{*}:leases", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.answers", "rlmq:{*}:answers", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.node", "rlmq:{*}:node:*", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("LedgerKeys.released", "rlmq:{*}:released", "rw", "rw", "", channel=True, tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.budget", "rlmq:{*}:budget", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.reservations", "rlmq:{*}:resv", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.live_reservations", "rlmq:{*}:live", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    # workers write it too: a REPL host announces the child rollouts it runs (rlmq status)
    KeyUse("RolloutKeys.info", "rlmq:{*}:info", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.reply", "rlmq:{*}:reply:*", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.spill", "rlmq:{*}:spill:*", "rw", "rw", "", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.tool_requests", "rlmq:{*}:toolreq", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.tool_answer", "rlmq:{*}:toolans:*", "rw", "rw", "r", tenant_pattern=_ROLLOUT_T),
    KeyUse("RolloutKeys.released", "rlmq:{*}:released", "rw", "rw", "", channel=True, tenant_pattern=_ROLLOUT_T),
    KeyUse("ORPHAN_REPLIES", "rlmq:orphan-replies", "", "rw", "r"),
    KeyUse("serving", "rlmq:serving:*", "r", "rw", "r"),
    KeyUse("LIVE_ROLLOUTS", "rlmq:rollouts", "rw", "rw", "r"),
    KeyUse("REPLICA_ACK_MARK", "rlmq:replica-ack", "rw", "rw", ""),
    KeyUse("wake_channel", "rlmq:wake:*", "rw", "rw", "", channel=True),
    KeyUse("lane", "rlmq:lane:*", "rw", "rw", "r"),
    KeyUse("ProviderKeys.requests", "rlmq:plimit:{*}:req", "", "rw", "r"),
    KeyUse("ProviderKeys.tokens", "rlmq:plimit:{*}:tok", "", "rw", "r"),
    KeyUse("ProviderKeys.running", "rlmq:plimit:{*}:run", "", "rw", "r"),
    KeyUse("ProviderKeys.paused", "rlmq:plimit:{*}:pause", "", "rw", "r"),
    KeyUse("PROVIDER_LIMITS", "rlmq:plimits", "", "rw", "r"),
    KeyUse("rq_queue", "rq:queue:*", "rw", "rw", "r", tenant_pattern="rq:queue:*@{t}"),
    KeyUse("RQ_QUEUES", "rq:queues", "rw", "rw", "r"),
    KeyUse("RQ_WORKERS", "rq:workers", "", "rw", "r"),
    KeyUse("rq_job", "rq:job:*", "rw", "rw", "r", tenant_pattern="rq:job:{t}_*"),
    KeyUse("rq_results", "rq:results:*", "", "rw", "r"),
    KeyUse("rq_started", "rq:wip:*", "", "rw", "r"),
    KeyUse("rq_finished", "rq:finished:*", "", "rw", "r"),
    KeyUse("rq_failed", "rq:failed:*", "", "rw", "r"),
    *(
        KeyUse("rq_other_registry", f"rq:{kind}:*", "", "rw", "r")
        for kind in ("deferred", "ready", "scheduled", "canceled")
    ),
    KeyUse("RQ_RATE_LIMIT_KEYS", "rq:rl-keys", "", "rw", "r"),
    KeyUse("rq_worker", "rq:worker:*", "", "rw", "r"),
    KeyUse("rq_workers_of_queue", "rq:workers:*", "", "rw", "r"),
    KeyUse("rq_worker_executions", "rq:worker:*:executions", "", "rw", "r"),
    KeyUse("rq_execution", "rq:execution:*", "", "rw", "r"),
    KeyUse("rq_job_executions", "rq:executions:*", "", "rw", "r"),
)
"""Every key and channel family above, with what each role does with it (the source of
:mod:`rlmq.common.acl`; ``tests/integration/test_acl_rules.py`` checks that every builder of
this module is declared here and that a real Redis grants each role what it says)."""

_TENANT = re.compile(r"[A-Za-z0-9]{1,32}")


def check_tenant(tenant: str) -> str:
    """Return ``tenant`` if it is 1-32 letters or digits (it prefixes rollout ids: ``<tenant>_...``).

    Raises:
        ConfigError: otherwise (an ``_`` in a tenant would let one tenant's pattern match another's ids).
    """
    if not _TENANT.fullmatch(tenant):
        raise ConfigError(f"invalid tenant {tenant!r}: use 1-32 letters or digits")
    return tenant


def reply_of_job(jid: str) -> str | None:
    """The reply stream a job of id ``jid`` answers on (its rollout's, its batch's), or ``None``
    for an id of another shape. Workers deliver there whatever the job hash says, so a producer
    confined to its own rollouts' keys cannot make a worker write into another's."""
    parsed = parse_job_id(jid)
    if parsed is None:
        return None
    try:
        return RolloutKeys(parsed[0]).reply(parsed[1])
    except ConfigError:
        return None
