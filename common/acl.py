"""Redis ACL users for a shared fleet: what producers, workers and dashboards may do.

rlmq's trust model (see the README, "Who must be trusted with Redis"): whoever can write
rlmq's keys (``rq:*`` and ``rlmq:*``) is trusted with the fleet: it can enqueue sub-calls,
write into any rollout's reply stream and change any rollout's budget ledger. ACL users do
not change that; they keep each role to the commands and keys it needs, so that

* a dashboard (rq-dashboard, ``rlmq status``, ``rq info``) can read and cannot write;
* a producer or a worker cannot reach keys outside rlmq's and RQ's prefixes (other
  applications sharing the Redis), nor run administrative commands (``FLUSHALL``,
  ``CONFIG``, ``DEBUG``, ``SHUTDOWN``, ``KEYS``, ...);
* a leaked dashboard password cannot forge a result or a budget.

:func:`acl_rules` gives each role's rules (what ``ACL SETUSER <user> <rules...>`` takes);
``python -m rlmq.common.acl`` prints ``ACL SETUSER`` lines to paste into ``redis-cli`` or an
ACL file (passwords as ``<password>`` placeholders). ``tests/e2e/test_acl_users.py`` runs a
fleet with these users on a real Redis.
"""

from __future__ import annotations

import sys

ROLES = ("producer", "worker", "dashboard")
"""The roles a fleet needs one Redis user each for (or one per trainer node / worker host)."""

_KEYS = ["~rq:*", "~rlmq:*"]
_PRODUCER_KEYS = ["~rq:job:*", "~rq:queue:*", "~rq:queues", "~rlmq:*"]
_CHANNELS = ["&rlmq:wake:*"]
_CONNECTION = ["+@connection", "+client|setname", "+client|getname", "+client|id", "+info"]
_WRITE_SIDE = [
    "+@read",
    "+@write",
    "+@keyspace",
    "+@list",
    "+@hash",
    "+@set",
    "+@sortedset",
    "+@stream",
    "+@string",
    "+@transaction",
    "+@scripting",
    "+@pubsub",
    "-@admin",
    "-@dangerous",
    "+info",
    "+script|load",
    "+script|exists",
    "-keys",
    "-script|flush",
    "-script|kill",
]


def acl_rules(role: str) -> list[str]:
    """The ACL rules of ``role`` (``producer``, ``worker`` or ``dashboard``), without user
    name, password or ``on``.

    * producer: enqueues (job hashes ``rq:job:*``, queue lists ``rq:queue:*``, ``rq:queues``,
      the lane, wake-ups), reads reply streams, opens and reads budget ledgers, keeps its
      rollouts' keys alive (``rlmq:*``); RQ's registries and worker records are not its keys;
    * worker: the same keys plus RQ's registries, worker and execution records, result
      streams; subscribes to wake-ups;
    * dashboard: reads ``rq:*`` and ``rlmq:*`` only.

    Raises:
        ValueError: an unknown role.
    """
    if role == "producer":
        return ["resetkeys", "resetchannels", "-@all", *_PRODUCER_KEYS, *_CHANNELS, *_CONNECTION, *_WRITE_SIDE]
    if role == "worker":
        return ["resetkeys", "resetchannels", "-@all", *_KEYS, *_CHANNELS, *_CONNECTION, *_WRITE_SIDE]
    if role == "dashboard":
        return ["resetkeys", "resetchannels", "-@all", *_KEYS, *_CONNECTION, "+@read", "-keys", "-@dangerous", "+info"]
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def setuser_line(user: str, role: str, password: str = "<password>") -> str:
    """One ``ACL SETUSER`` command line for ``user`` in ``role``."""
    return " ".join(["ACL", "SETUSER", user, "reset", "on", f">{password}", *acl_rules(role)])


if __name__ == "__main__":  # pragma: no cover - a printing helper
    for r in ROLES:
        sys.stdout.write(setuser_line(f"rlmq-{r}", r) + "\n")
