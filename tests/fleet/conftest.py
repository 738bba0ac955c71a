"""Fleet-conditions fixtures: real Redis, real worker processes, the scripted model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis

from rlmq.common.acl import acl_rules
from rlmq.common.redis_server import EmbeddedRedis


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


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own: one whose configuration the test changes, or whose whole
    server it measures (``RLMQ_TEST_REDIS_URL`` may be shared with the suite's other processes)."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def evicting_redis(private_redis: EmbeddedRedis) -> Iterator[tuple[str, redis.Redis]]:
    """A private Redis with ``maxmemory`` 64 MiB and ``allkeys-lru`` (as managed services often
    ship): its URL and an admin client."""
    admin = redis.Redis.from_url(private_redis.url)
    admin.config_set("maxmemory", str(64 * 1024 * 1024))
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield private_redis.url, admin
    finally:
        admin.close()
