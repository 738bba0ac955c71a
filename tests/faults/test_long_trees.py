"""A tree that works for several node TTLs beside a stream of short trees starting faster than
the refresh tick, on the same producer and the same REPL hosts (:mod:`tests.faults.long_tree`).

Keys live ``KEY_TTL`` seconds here (nodes and ``rlmq status`` leases too), so the hosts refresh
them every ``KEY_TTL / 3`` s; a short tree starts every ``EVERY`` s. A host whose refresh loop
restarted its wait whenever a rollout entered let the long tree's node expire: its calls came back
``[rejected] ... parent_gone`` or ``this rollout's tree has ended``. Here the long rollout, at
depth 1, 2 and 3, must meet no refusal and no error, and every short tree must answer.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.cli.status import collect
from tests.faults.long_tree import start_stream

pytestmark = pytest.mark.e2e

KEY_TTL = 10
"""Seconds a key, node or status lease lives unrefreshed (the shortest ``rollout_key_ttl``; the
hosts refresh them every 3.3 s)."""
EVERY = 1.0
"""Seconds between two short trees' starts (faster than the refresh tick)."""
WORK_SECONDS = 3 * KEY_TTL
"""How long the long rollout works: three node TTLs."""


@pytest.fixture
def hosts(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """The scripted model and one REPL host with room for the long tree and the stream."""
    fleet = LocalFleet(
        redis_url=redis_url, model=f"long-{uuid.uuid4().hex[:8]}", workers=1, worker_concurrency=64,
        worker_args=["--heartbeat-ttl", "5", "--repl-slots", "6"], worker_grace=1.0,
        log_dir=str(tmp_path_factory.mktemp("long-tree-logs")),
    )  # fmt: skip
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


class Watch(threading.Thread):
    """Samples ``rlmq status`` every 0.1 s until stopped: when the long tree's top (row ``long``)
    was first listed as live, and when it first was not any more (its lease lapsed, or it ended).
    A lease the refresh loop starved would drop it, and bring it back at the next refresh."""

    def __init__(self, fleet: LocalFleet) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(str(fleet.redis_url))
        self.stop = threading.Event()
        self.samples = 0
        self.listed_at: float | None = None  # seconds from the start
        self.unlisted_at: float | None = None
        self.relisted = 0  # samples that listed it again after it was gone

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(0.1):  # sampling period
            listed = any(x["row"] == "long" and x["depth"] == 1 for x in collect(self.r)["rollouts"])
            t = time.monotonic() - start
            if listed and self.listed_at is None:
                self.listed_at = t
            elif not listed and self.listed_at is not None and self.unlisted_at is None:
                self.unlisted_at = t
            elif listed and self.unlisted_at is not None:
                self.relisted += 1
            self.samples += 1


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_long_tree_is_never_cut_off_while_short_trees_keep_starting(hosts: LocalFleet, depth: int) -> None:
    proc = start_stream(hosts, depth, WORK_SECONDS, every=EVERY, key_ttl=KEY_TTL)
    watch = Watch(hosts)
    watch.start()
    try:
        out, _ = proc.communicate(timeout=240)
        deadline = time.monotonic() + 5  # the driver exits as the long tree ends: let the watch see it go
        while watch.unlisted_at is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the watch, bounded by the deadline
    finally:
        watch.stop.set()
        watch.join(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # `rlmq status` listed the long top for the whole time it worked (its lease never lapsed while
    # rollouts kept entering), and dropped it once, when it ended
    assert watch.samples > 100 and watch.listed_at is not None and watch.unlisted_at is not None
    assert watch.unlisted_at - watch.listed_at > WORK_SECONDS and watch.relisted == 0, vars(watch)
    assert proc.returncode == 0, out[-2000:]
    doc = json.loads(out.decode().strip().splitlines()[-1])
    row = doc["long"]
    assert row["stop_reason"] == "answer_ready", row
    answer = str(row["final_answer"])
    calls = int(answer.split(" ", 1)[0])
    assert answer.endswith("bad: []"), answer[:2000]
    assert calls >= 10, answer  # it really worked, for several TTLs
    shorts = doc["shorts"]
    assert len(shorts) >= WORK_SECONDS / EVERY / 2, f"only {len(shorts)} short trees started"
    assert set(shorts) == {"answer_ready"}, shorts
    print(f"depth {depth}: long tree made {calls} calls over {WORK_SECONDS} s beside {len(shorts)} short trees")
