"""Fleet-conditions fixtures: real Redis, real worker processes, the scripted model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis

from rlmq.common.acl import acl_rules


@pytest.fixture
def acl_urls(real_redis: redis.Redis, redis_url: str) -> Iterator[dict[str, str]]:
    """Tenant producers (``producer``: tenant ``t``, ``producer_u``: tenant ``u``), a worker and a
    dashboard user; their URLs."""
    u = urlparse(redis_url)
    urls, names = {}, []
    for key, role, tenant in (
        ("producer", "producer", "t"), ("producer_u", "producer", "u"), ("worker", "worker", None),
        ("dashboard", "dashboard", None),
    ):  # fmt: skip
        name, password = f"fleet-{role}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        real_redis.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rules(role, tenant))
        names.append(name)
        urls[key] = f"redis://{name}:{password}@{u.hostname}:{u.port}{u.path or '/0'}"
    try:
        yield urls
    finally:
        for name in names:
            real_redis.execute_command("ACL", "DELUSER", name)
