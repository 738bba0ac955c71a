"""The ACL rules cover every key and channel of :mod:`rlmq.common.keys` for the role that uses
it, checked by a real Redis (``ACL DRYRUN``), and confine a tenant's producer to its own rollouts."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator

import pytest
import redis

from rlmq.common import keys as K
from rlmq.common.acl import ROLES, acl_rules

pytestmark = pytest.mark.integration

NOT_NAMES = {
    "namespace", "check_rollout_id", "check_ledger_id", "check_tenant", "queue_name_for_model", "tenant_queue",
    "serves", "job_id", "parse_job_id", "wake_message", "parse_wake_message", "queue_of_key", "worker_of_key",
    "reply_of_job", "child_queue", "parse_child_queue", "CHILD_QUEUE_MARK",
    "KeyUse", "KEY_USES", "REPLY_FIELD", "PREFIX", "RQ_PREFIX", "SERVING_CLOCK_SKEW", "ConfigError",
}  # fmt: skip
"""Helpers of the key module that build no key or channel name."""


def templates() -> set[str]:
    """Every key or channel builder the key module defines (module level and per rollout)."""
    classes = ("RolloutKeys", "LedgerKeys", "ProviderKeys")
    names = {n for n in vars(K) if not n.startswith("_") and n not in NOT_NAMES and n not in classes}
    names = {n for n in names if not inspect.ismodule(getattr(K, n)) and n != "annotations" and n != "re"}
    not_names = {"all_static", "all", "rollout_id", "ledger_id", "tag", "upstream"}
    per_id = {f"{c}.{n}" for c in classes for n in vars(getattr(K, c)) if not n.startswith("_") and n not in not_names}
    return names | per_id


def sample(template: str, rollout: str = "teamA_r1") -> str:
    """A name the template builds (queues are tenant queues, rollouts a tenant's)."""
    if template.startswith(("RolloutKeys.", "LedgerKeys.", "ProviderKeys.")):
        cls, name = template.split(".", 1)
        attr = getattr(getattr(K, cls)(rollout), name)
        return str(attr("b7") if callable(attr) else attr)
    obj = getattr(K, template)
    if not callable(obj):
        return str(obj)
    arg = {
        "rq_job": K.job_id(rollout, "b7", 0), "rq_results": K.job_id(rollout, "b7", 0),
        "rq_job_executions": K.job_id(rollout, "b7", 0), "rq_worker": "w1", "rq_worker_executions": "w1",
    }.get(template, "rlmq.sub.m@teamA")  # fmt: skip
    if template == "rq_other_registry":
        return str(obj("ready", arg))
    if template == "rq_execution":
        return str(obj(K.job_id(rollout, "b7", 0), "e1"))
    return str(obj(arg))


def test_every_template_of_the_key_module_has_a_declared_use() -> None:
    declared = {u.template for u in K.KEY_USES}
    assert templates() == declared, (templates() - declared, declared - templates())


@pytest.fixture
def users(real_redis: redis.Redis) -> Iterator[dict[str, str]]:
    names = {role: f"rlmq-{role}-{uuid.uuid4().hex[:6]}" for role in ROLES}
    names["teamA"] = f"rlmq-teamA-{uuid.uuid4().hex[:6]}"
    for role in ROLES:
        real_redis.execute_command("ACL", "SETUSER", names[role], "reset", "on", "nopass", *acl_rules(role))
    real_redis.execute_command("ACL", "SETUSER", names["teamA"], "reset", "on", "nopass",
                               *acl_rules("producer", tenant="teamA"))  # fmt: skip
    try:
        yield names
    finally:
        for name in names.values():
            real_redis.execute_command("ACL", "DELUSER", name)


def allowed(r: redis.Redis, user: str, *command: str) -> bool:
    try:
        return bool(r.execute_command("ACL", "DRYRUN", user, *command) == b"OK")
    except redis.ResponseError as exc:  # unknown command shape: the test's own mistake
        raise AssertionError(exc) from exc


def test_each_role_may_use_what_it_uses_and_nothing_more(real_redis: redis.Redis, users: dict[str, str]) -> None:
    for use in K.KEY_USES:
        name = sample(use.template)
        if use.template == "rq_other_registry":
            name = K.rq_other_registry(use.pattern.split(":")[1], "rlmq.sub.m@teamA")
        for role in ROLES:
            access, user = use.access(role), users[role]
            if use.channel:
                assert allowed(real_redis, user, "PUBLISH", name, "x") == (access == "rw"), (role, name)
                continue
            assert allowed(real_redis, user, "EXISTS", name) == bool(access), (role, name)
            write = allowed(real_redis, user, "DEL", name)
            assert write == (access == "rw"), (role, name)


def test_the_released_channel_is_open_to_the_settle_script_of_a_worker(
    real_redis: redis.Redis, users: dict[str, str]
) -> None:
    channel = K.RolloutKeys("r1").released
    assert allowed(real_redis, users["worker"], "PUBLISH", channel, "5 0")
    assert allowed(real_redis, users["worker"], "SUBSCRIBE", channel)


def test_a_tenant_producer_is_confined_to_its_own_rollouts(real_redis: redis.Redis, users: dict[str, str]) -> None:
    a = users["teamA"]
    for use in K.KEY_USES:
        if not use.producer or use.channel:
            continue
        own, other = sample(use.template, "teamA_r1"), sample(use.template, "teamB_r1")
        own, other = own.replace("@teamB", "@teamA"), other.replace("@teamA", "@teamB")
        assert allowed(real_redis, a, "EXISTS", own), own
        if use.tenant_pattern is not None:
            assert not allowed(real_redis, a, "EXISTS", other), other
            assert not allowed(real_redis, a, "HSET", other, "limit", "999999"), other
    # a tenant whose name is another's prefix gets nothing of it
    assert not allowed(real_redis, a, "HSET", K.RolloutKeys("teamAB_r1").budget, "limit", "1")
    assert not allowed(real_redis, a, "HSET", K.rq_job("teamAB_r1-b1-0"), "data", "x")


def test_producers_and_workers_may_wait_for_replicas(real_redis: redis.Redis, users: dict[str, str]) -> None:
    # a grant's round trip ends with the mark's SET and WAIT (rlmq.common.budget.replica_acks)
    for user in (users["producer"], users["worker"], users["teamA"]):
        assert allowed(real_redis, user, "SET", K.REPLICA_ACK_MARK, "1", "EX", "60"), user
        assert allowed(real_redis, user, "WAIT", "1", "500"), user
    assert not allowed(real_redis, users["dashboard"], "SET", K.REPLICA_ACK_MARK, "1")
