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
import uuid
from collections.abc import Iterator

import pytest

from rlmq.cli.local import LocalFleet
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


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_long_tree_is_never_cut_off_while_short_trees_keep_starting(hosts: LocalFleet, depth: int) -> None:
    proc = start_stream(hosts, depth, WORK_SECONDS, every=EVERY, key_ttl=KEY_TTL)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
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
