"""Redis ACL users for a shared fleet: what producers, workers and dashboards may do.

rlmq's trust model (see ``docs/fleet.md``): whoever can write rlmq's keys (``rq:*`` and
``rlmq:*``) with the plain producer or worker user is trusted with the fleet: it can enqueue
sub-calls, write into any rollout's reply stream and change any rollout's budget ledger. The
users keep each role to the commands and keys it needs, so that

* a dashboard (``rlmq status``) reads and cannot write; ``rq info`` runs RQ's maintenance
  (it prunes registries and re-queues abandoned jobs before it prints), so it needs the
  worker user;
* a producer or a worker cannot reach keys outside rlmq's and RQ's prefixes (other
  applications sharing the Redis), nor run administrative commands (``FLUSHALL``,
  ``CONFIG``, ``DEBUG``, ``SHUTDOWN``, ``KEYS``, ...);
* a leaked dashboard password cannot forge a result or a budget;
* producers of different teams can share a fleet when each has a *tenant* producer user
  (``acl_rules("producer", tenant="teamA")``): it may only touch rollouts whose ids start with
  ``teamA_`` and the tenant queues ``<queue>@teamA``, and workers deliver a job's result to
  the reply stream its job id names, so one team cannot raise another's budget, read or
  redirect its results, or forge its jobs. Workers are trusted with every rollout; a
  REPL-hosting worker, which acts as a producer for the child rollouts it runs, needs no more
  than the worker user, and runs a child-rollout job only when its parent (the rollout its
  job id names) is a live node of the tree the job names, so one team cannot make it join
  (open a node in, reserve from) another team's tree.

Every key and channel family is declared once, with the roles that use it, in
:data:`rlmq.common.keys.KEY_USES`; the rules are derived from it.
:func:`acl_rules` gives each role's rules (what ``ACL SETUSER <user> <rules...>`` takes);
``python -m rlmq.common.acl`` prints ``ACL SETUSER`` lines to paste into ``redis-cli`` or an
ACL file (passwords as ``<password>`` placeholders; ``--tenant T`` for tenant producers).
``tests/e2e/test_acl_users.py`` and ``tests/fleet/`` run fleets with these users on a real Redis.
"""

from __future__ import annotations

import argparse
import sys

from rlmq.common.keys import KEY_USES, check_tenant

ROLES = ("producer", "worker", "dashboard")
"""The roles a fleet needs one Redis user each for (or one per trainer node / worker host)."""

_CONNECTION = ["+@connection", "+client|setname", "+client|getname", "+client|id", "+info", "+time"]
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


def key_rules(role: str, tenant: str | None = None) -> list[str]:
    """The key and channel rules of ``role``, derived from :data:`rlmq.common.keys.KEY_USES`:
    ``~glob`` (read and write), ``%R~glob`` (read only), ``&glob`` (a channel, which is also a
    key pattern: the settle script takes its channel in ``KEYS``). With ``tenant``
    (producers only) every family that has a tenant pattern is confined to it.

    Raises:
        ValueError: an unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    rules: list[str] = []
    for use in KEY_USES:
        access = use.access(role)
        if not access:
            continue
        pattern = use.pattern
        if tenant is not None and use.tenant_pattern is not None:
            pattern = use.tenant_pattern.format(t=tenant)
        if use.channel:
            # also as a key: a script names the channel it publishes on in KEYS (one slot)
            rules += ["&" + pattern, "~" + pattern]
        else:
            rules.append(("~" if access == "rw" else "%R~") + pattern)
    return list(dict.fromkeys(rules))


def acl_rules(role: str, tenant: str | None = None) -> list[str]:
    """The ACL rules of ``role`` (``producer``, ``worker`` or ``dashboard``), without user
    name, password or ``on``. Key and channel rules come from :func:`key_rules`, so every key
    and channel of :mod:`rlmq.common.keys` is covered for the role that uses it. Needs Redis >= 7
    (read-only key rules ``%R~``).

    * producer: enqueues (job hashes, queue lists, ``rq:queues``, the lane, wake-ups), reads
      reply streams and who serves a queue, opens and reads budget ledgers, keeps its rollouts'
      keys alive; RQ's registries and worker records are not its keys. With ``tenant``
      (1-32 letters or digits) it is confined to rollouts whose ids start with ``<tenant>_``
      and to the tenant queues ``<queue>@<tenant>``: it cannot touch another tenant's ledger,
      jobs or results (the lane, wake-ups and ``rlmq:rollouts`` stay shared hints);
    * worker: every key and channel, as the budget's settle script publishes releases;
    * dashboard: reads only: ``rlmq status`` works with it. ``rq info`` (RQ 3) is not read-only:
      it runs RQ's maintenance (``clean_registries``, ``clean_worker_registry``) before it
      prints, so it needs the worker user.

    Raises:
        ValueError: an unknown role, or a tenant for another role than producer.
        ConfigError: an invalid tenant.
    """
    if tenant is not None:
        if role != "producer":
            raise ValueError("only a producer user is confined to a tenant")
        check_tenant(tenant)
    keys = key_rules(role, tenant)
    if role == "dashboard":
        return ["resetkeys", "resetchannels", "-@all", *keys, *_CONNECTION, "+@read", "-keys", "-@dangerous", "+info"]
    return ["resetkeys", "resetchannels", "-@all", *keys, *_CONNECTION, *_WRITE_SIDE]


def setuser_line(user: str, role: str, password: str = "<password>", tenant: str | None = None) -> str:
    """One ``ACL SETUSER`` command line for ``user`` in ``role`` (a producer confined to ``tenant``)."""
    return " ".join(["ACL", "SETUSER", user, "reset", "on", f">{password}", *acl_rules(role, tenant)])


def main(argv: list[str] | None = None) -> None:
    """Print ``ACL SETUSER`` lines: one per role, or with ``--tenant T`` (repeatable) one
    producer user per tenant besides the worker and dashboard users."""
    parser = argparse.ArgumentParser(prog="python -m rlmq.common.acl", description=main.__doc__)
    parser.add_argument("--tenant", action="append", default=[], help="a tenant's producer user (repeatable)")
    args = parser.parse_args(argv)
    lines = []
    if args.tenant:
        lines += [setuser_line(f"rlmq-producer-{t}", "producer", tenant=t) for t in args.tenant]
        lines += [setuser_line(f"rlmq-{r}", r) for r in ("worker", "dashboard")]
    else:
        lines += [setuser_line(f"rlmq-{r}", r) for r in ROLES]
    sys.stdout.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":  # pragma: no cover - a printing helper
    main()
