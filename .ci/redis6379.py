"""Prove that the test run leaves a Redis on 127.0.0.1:6379 unchanged (it may be someone's own).

    python .ci/redis6379.py save FILE    # before the tests: DBSIZE of every database, to FILE
    python .ci/redis6379.py check FILE   # after: the same figures again, or exit 1

Read-only: CONFIG GET databases (16 when refused), then SELECT + DBSIZE per database, and from
INFO the writes since the last save and the FLUSHDB / FLUSHALL calls (a flush of an empty
database leaves every DBSIZE at 0, the call counts show it). With no Redis on 6379 both steps
say so and pass: there is nothing to leave unchanged.
"""

from __future__ import annotations

import json
import sys

import redis

URL = "redis://127.0.0.1:6379"


def snapshot() -> dict[str, object] | None:
    """``{db: DBSIZE, ..., writes, flushdb, flushall}`` of the Redis on 6379, or ``None`` when
    none answers."""
    probe = redis.Redis.from_url(URL, socket_connect_timeout=1, socket_timeout=5)
    try:
        probe.ping()
    except redis.AuthenticationError as exc:
        return {"error": str(exc)}
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return None
    sizes: dict[str, object] = {}
    try:
        n = int(probe.config_get("databases").get("databases", 16))
    except redis.ResponseError:
        n = 16
    try:
        sizes["writes"] = probe.info("persistence").get("rdb_changes_since_last_save")
        stats = probe.info("commandstats")
        for cmd in ("flushdb", "flushall"):
            sizes[cmd] = stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)
    except redis.ResponseError:
        pass
    finally:
        probe.close()
    for db in range(n):
        client = redis.Redis.from_url(f"{URL}/{db}", socket_connect_timeout=1, socket_timeout=5)
        try:
            sizes[str(db)] = int(client.dbsize())
        finally:
            client.close()
    return sizes


def main(argv: list[str]) -> int:
    what, path = argv[1], argv[2]
    now = snapshot()
    if what == "save":
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(now, fh)
        print(f"redis on 6379 before the tests: {now if now is not None else 'none answers'}")
        return 0
    with open(path, encoding="utf-8") as fh:
        before = json.load(fh)
    if before is None and now is None:
        print("redis on 6379: none answered before or after the tests")
        return 0
    if before != now:
        print(f"redis on 6379 CHANGED during the tests: DBSIZE before {before}, after {now}", file=sys.stderr)
        return 1
    print(f"redis on 6379 unchanged by the tests (DBSIZE per database, writes, flushes): {now}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
