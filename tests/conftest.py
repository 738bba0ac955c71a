"""Shared fixtures.

Unit tests run on fakeredis. Integration and end-to-end tests need a real Redis: a private,
embedded ``redis-server`` on a free port, started for the session (the same default
``rlmq demo`` uses), or the one named by ``RLMQ_TEST_REDIS_URL`` (each pytest-xdist process on a
database of its own: the URL's, plus the process index). No other Redis is ever
touched: a Redis on 127.0.0.1:6379 may be someone's own, and the tests flush their database.
When none can be had the tests fail loudly; they never skip.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis

from rlmq.common.redis_server import EmbeddedRedis, redis_answers


def _database_of_this_process(url: str) -> str:
    """``url`` with its database number raised by this pytest-xdist process's index (``gw2``:
    +2), so the suite's processes, which flush their database per test, never share one."""
    from urllib.parse import urlsplit, urlunsplit

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{base + int(worker[2:])}"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for this test session (its database is flushed per test)."""
    url = os.environ.get("RLMQ_TEST_REDIS_URL")
    if url:
        url = _database_of_this_process(url)
        if not redis_answers(url):
            pytest.fail(f"RLMQ_TEST_REDIS_URL={url} does not answer")
        yield url
        return
    server = EmbeddedRedis().start()  # raises EmbeddedRedisError: the test fails, never skips
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def real_redis(redis_url: str) -> Iterator[redis.Redis]:
    """A sync client on the session's real Redis, with its database flushed before and after."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def sigint_delivered() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` during the test, as in a command typed at a terminal,
    whatever the suite inherited: a script's ``cmd &``, ``nohup`` and some CI launchers start it
    with SIGINT ignored, and a test that waits for its own Ctrl-C then waits forever. The
    inherited disposition comes back after the test."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
