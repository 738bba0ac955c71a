"""How many Redis replicas must acknowledge a budget grant before its model call runs.

Redis replicates asynchronously: a grant written on the master just before it dies may be missing
from the replica a Sentinel promotes, and a ledger that forgot a grant lets its tree overshoot its
budget. With ``redis_replica_acks`` = n > 0, every ledger round trip that can let a model call run
(:mod:`rlmq.common.budget.calls`) ends with ``WAIT n <timeout>`` on the same connection, after a
write of :data:`rlmq.common.keys.REPLICA_ACK_MARK` (so the ``WAIT`` covers every write the master
made before it, this connection's or another's: a grant found again by a retry included); a grant
or a begin acknowledged by fewer replicas is not used (:class:`~rlmq.common.errors.ReplicaAckMissing`)
and is asked for again. Settings: ``redis_replica_acks`` (default: 1 with a Sentinel URL, else 0) and
``redis_replica_ack_timeout`` (seconds). What it guarantees and costs: ``docs/fleet.md``.

The policy travels with the asyncio client that :func:`rlmq.common.connection.async_client` builds
(:func:`attach`), so every ledger made on that client (a worker's, a producer's child root turns)
follows the Redis it talks to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlmq.common import sentinel
from rlmq.common.settings import setting_default

_ATTR = "_rlmq_replica_acks"


@dataclass(frozen=True)
class ReplicaAcks:
    """Replicas that must acknowledge a grant (0: none) and how long to wait for them (seconds)."""

    replicas: int = 0
    timeout: float = setting_default("redis_replica_ack_timeout")

    @property
    def timeout_ms(self) -> int:
        """``timeout`` in whole milliseconds, at least 1 (``WAIT 0`` would block forever)."""
        return max(1, round(self.timeout * 1000))


NONE = ReplicaAcks()
"""No acknowledgement asked (a plain Redis URL by default, and any client not built by rlmq)."""


def resolve(url: str, replicas: int | None, timeout: float) -> ReplicaAcks:
    """The policy of a client of ``url``: ``replicas`` as set, or when ``None`` 1 for a Sentinel
    URL (a deployment that fails over) and 0 for a plain one."""
    if replicas is None:
        replicas = 1 if sentinel.parse(url) is not None else 0
    return ReplicaAcks(replicas, timeout)


def attach(client: Any, policy: ReplicaAcks) -> None:
    """Give ``client`` (an asyncio Redis client) the policy its ledgers follow."""
    setattr(client, _ATTR, policy)


def of(client: Any) -> ReplicaAcks:
    """The policy :func:`attach` gave ``client``, else :data:`NONE`."""
    policy = getattr(client, _ATTR, NONE)
    return policy if isinstance(policy, ReplicaAcks) else NONE
