"""``rlmq status`` on fakeredis, over records written the way the producer and workers write them."""

from __future__ import annotations

import io
import json
import time
from datetime import UTC, datetime

import fakeredis
import pytest
from rq import Queue
from rq import Worker as RQWorker
from rq.serializers import JSONSerializer

from rlmq.cli import main as cli
from rlmq.cli.status import collect, fmt_age, parse_rq_time, render, run_status
from rlmq.common import keys as K
from rlmq.common.connection import mask_url
from rlmq.common.jobs.record import job_hash, utcformat

NOW = 1_800_000_000.0


def stamp(t: float) -> str:
    return utcformat(datetime.fromtimestamp(t, UTC))


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def enqueue(r: fakeredis.FakeRedis, queue: str, job_id: str, enqueued: float) -> None:
    r.hset(
        K.rq_job(job_id),
        mapping=job_hash(
            queue=queue, args=[{"prompt": "p"}], description=f"sub-LLM {job_id}", timeout=60, result_ttl=60,
            failure_ttl=60, ttl=60, reply_key="rlmq:{x}:reply:b1", meta={}, now=stamp(enqueued),
        ),
    )  # fmt: skip
    r.rpush(K.rq_queue(queue), job_id)
    r.sadd(K.RQ_QUEUES, K.rq_queue(queue))


def add_worker(r: fakeredis.FakeRedis, queue: str, name: str, inflight: int, beat: float, state: str) -> None:
    q = Queue(queue, connection=r, serializer=JSONSerializer)
    w = RQWorker([q], name=name, connection=r, serializer=JSONSerializer)
    w.register_birth()  # RQ's own record, as the rlmq worker writes it
    r.hset(w.key, mapping={"state": state, "rlmq_concurrency": 256, "last_heartbeat": stamp(beat)})
    sec, usec = r.time()  # the heartbeat's serving entry, by Redis's clock (a 10 s lease)
    r.zadd(K.serving(queue), {name: sec + usec / 1e6 - (NOW - beat) + 10})
    for i in range(inflight):
        member = f"r1-b1-{i}:e{i}"
        r.sadd(K.rq_worker_executions(name), member)
        r.zadd(K.rq_started(queue), {member: beat + 10})


def add_rollout(r: fakeredis.FakeRedis, rid: str, started: float, budget: dict[str, int] | None) -> None:
    keys = K.RolloutKeys(rid)
    r.hset(
        keys.info,
        mapping={"model": "root-m", "sub_model": "sub-m", "queue": "q", "started": started, "row": "row-" + rid},
    )
    if budget is not None:
        r.hset(keys.budget, mapping=budget)
    r.zadd(K.LIVE_ROLLOUTS, {rid: started + 3600})


def populate(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "rlmq.sub.sub-m", "r1-b1-10", NOW - 42.0)
    enqueue(r, "rlmq.sub.sub-m", "r1-b1-11", NOW - 1.0)
    enqueue(r, "rlmq.sub.other", "r2-b1-0", NOW - 0.25)
    r.sadd(K.RQ_QUEUES, K.rq_queue("rlmq.sub.empty"))
    add_worker(r, "rlmq.sub.sub-m", "hostA.101.ab12", inflight=3, beat=NOW - 0.5, state="busy")
    add_worker(r, "rlmq.sub.sub-m", "hostB.202.cd34", inflight=0, beat=NOW - 75.0, state="idle")
    add_rollout(r, "r1", NOW - 12.0, {"limit": 1000, "charged": 300, "used": 120, "grants": 3, "rejections": 0})
    add_rollout(r, "r2", NOW - 2.0, None)


def test_collect_reads_queues_workers_and_live_rollouts(r: fakeredis.FakeRedis) -> None:
    populate(r)
    snap = collect(r, now=NOW)
    queues = {q["name"]: q for q in snap["queues"]}
    assert set(queues) == {"rlmq.sub.sub-m", "rlmq.sub.other", "rlmq.sub.empty"}
    assert queues["rlmq.sub.sub-m"]["depth"] == 2
    assert queues["rlmq.sub.sub-m"]["oldest_age"] == pytest.approx(42.0, abs=1e-3)
    # hostB's heartbeat lapsed 65 s ago: RQ's worker set still names it, the count does not
    assert queues["rlmq.sub.sub-m"]["started"] == 3 and queues["rlmq.sub.sub-m"]["workers"] == 1
    assert queues["rlmq.sub.other"]["oldest_age"] == pytest.approx(0.25, abs=1e-3)
    assert queues["rlmq.sub.empty"] == {
        "name": "rlmq.sub.empty", "depth": 0, "oldest_age": None, "started": 0, "failed": 0, "workers": 0,
    }  # fmt: skip
    workers = {w["name"]: w for w in snap["workers"]}
    a, b = workers["hostA.101.ab12"], workers["hostB.202.cd34"]
    assert (a["state"], a["inflight"], a["concurrency"]) == ("busy", 3, 256)
    assert a["heartbeat_age"] == pytest.approx(0.5, abs=1e-3) and a["queues"] == ["rlmq.sub.sub-m"]
    assert (b["state"], b["inflight"], b["live"]) == ("lapsed", 0, False)
    assert b["heartbeat_age"] == pytest.approx(75.0, abs=1e-3)
    assert snap["rollouts_total"] == 2
    r1, r2 = snap["rollouts"]  # oldest first
    assert r1["id"] == "r1" and r1["model"] == "root-m" and r1["row"] == "row-r1"
    assert (r1["budget_used"], r1["budget_charged"], r1["budget_limit"]) == (120, 300, 1000)
    assert r1["age"] == pytest.approx(12.0)
    assert r2["id"] == "r2" and r2["budget_limit"] is None
    json.dumps(snap)  # what --json prints


def test_render_is_a_plain_text_table(r: fakeredis.FakeRedis) -> None:
    populate(r)
    text = render(collect(r, now=NOW), redis_label="redis://127.0.0.1:6379/2")
    lines = text.splitlines()
    assert lines[0].startswith("rlmq status  redis://127.0.0.1:6379/2")
    assert "QUEUES (3)" in text and "WORKERS (1 live, 3 sub-calls in flight)" in text and "LIVE ROLLOUTS (2)" in text
    row = next(ln for ln in lines if ln.startswith("rlmq.sub.sub-m "))
    assert row.split()[:6] == ["rlmq.sub.sub-m", "2", "42.0s", "3", "0", "1"]
    wa = next(ln for ln in lines if ln.startswith("hostA.101.ab12"))
    assert wa.split()[:5] == ["hostA.101.ab12", "busy", "3", "256", "500ms"]
    wb = next(ln for ln in lines if ln.startswith("hostB.202.cd34"))
    assert "1m15s" in wb
    r1 = next(ln for ln in lines if ln.startswith("r1 "))
    assert "120/1000 (300 charged)" in r1 and "root-m" in r1 and "sub-m" in r1
    assert "no budget" in next(ln for ln in lines if ln.startswith("r2 "))
    assert "\x1b" not in text


def test_empty_redis_and_expired_worker_records(r: fakeredis.FakeRedis) -> None:
    text = render(collect(r, now=NOW))
    assert "QUEUES (0)" in text and text.count("(none)") == 3
    r.sadd(K.RQ_WORKERS, K.rq_worker("ghost.1.0000"))  # its hash expired, the set entry remains
    snap = collect(r, now=NOW)
    assert snap["workers"][0]["state"] == "gone" and snap["workers"][0]["heartbeat_age"] is None


def test_helpers() -> None:
    assert parse_rq_time("2026-11-22T06:20:01.500000Z") == pytest.approx(
        datetime(2026, 11, 22, 6, 20, 1, 500000, tzinfo=UTC).timestamp()
    )
    assert parse_rq_time("2026-11-22T06:20:01Z") is not None
    assert parse_rq_time("") is None and parse_rq_time(b"garbage") is None
    assert [fmt_age(x) for x in (None, 0.25, 12.34, 245, 7625)] == ["-", "250ms", "12.3s", "4m05s", "2h07m"]
    assert mask_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"


def test_run_status_json_and_watch(r: fakeredis.FakeRedis) -> None:
    populate(r)
    buf = io.StringIO()
    assert run_status(r, as_json=True, out=buf) == 0
    data = json.loads(buf.getvalue())
    assert {q["name"] for q in data["queues"]} >= {"rlmq.sub.sub-m"} and data["rollouts_total"] == 2
    buf = io.StringIO()
    t0 = time.monotonic()
    assert run_status(r, watch=0.05, out=buf, iterations=3) == 0
    assert buf.getvalue().count("\x1b[H\x1b[2J") == 3 and time.monotonic() - t0 >= 0.1


def test_cli_parses_status_flags() -> None:
    p = cli.build_parser()
    a = p.parse_args(["status"])
    assert a.command == "status" and a.watch is None and not a.json
    a = p.parse_args(["status", "--watch", "--redis-url", "redis://x:6379/0"])
    assert a.watch == 2.0 and a.redis_url == "redis://x:6379/0"
    assert p.parse_args(["status", "--watch", "0.5", "--json"]).watch == 0.5


def test_cli_status_without_redis_fails_clearly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("RLMQ_REDIS_URL", raising=False)
    assert cli.main(["status"]) == 2
    assert "--redis-url" in capsys.readouterr().err


def test_child_rollouts_are_listed_with_their_depth_and_parent(r: fakeredis.FakeRedis) -> None:
    add_rollout(r, "top", NOW - 9.0, None)
    add_rollout(r, "c7-1", NOW - 3.0, None)  # a child hosted by a worker: the engine announces depth and parent
    r.hset(K.RolloutKeys("c7-1").info, mapping={"depth": 2, "parent": "top", "ledger": "top"})
    snap = collect(r, now=NOW)
    by_id = {x["id"]: x for x in snap["rollouts"]}
    assert (by_id["top"]["depth"], by_id["top"]["parent"]) == (1, None)
    assert (by_id["c7-1"]["depth"], by_id["c7-1"]["parent"]) == (2, "top")
    lines = render(snap).splitlines()
    assert "DEPTH" in next(ln for ln in lines if ln.startswith("ROLLOUT"))
    assert next(ln for ln in lines if ln.startswith("c7-1 ")).split()[1:3] == ["2", "top"]
    assert next(ln for ln in lines if ln.startswith("top ")).split()[1:3] == ["1", "-"]


def test_a_top_rollout_shows_its_trees_figures(r: fakeredis.FakeRedis) -> None:
    """Children (depth >= 2, written with their tree's ledger) count under their top rollout, whose
    row shows the tree ledger's model calls, charged tokens and refusals."""
    add_rollout(r, "top", NOW - 9.0, {"limit": 5000, "charged": 1601, "used": 1500, "grants": 21, "rejections": 2})
    for i, parent in enumerate(("top", "top", "c0")):
        add_rollout(r, f"c{i}", NOW - 5.0 + i, None)
        r.hset(K.RolloutKeys(f"c{i}").info, mapping={"depth": 2 if parent == "top" else 3, "parent": parent,
                                                     "ledger": "top"})  # fmt: skip
    add_rollout(r, "flat", NOW - 1.0, None)
    snap = collect(r, now=NOW)
    rows = {x["id"]: x for x in snap["rollouts"]}
    assert rows["top"]["tree"] == {"live_children": 3, "model_calls": 21, "charged": 1601, "limit": 5000,
                                   "rejections": 2}  # fmt: skip
    assert "tree" not in rows["flat"] and "tree" not in rows["c2"]
    text = render(snap)
    top_line = next(line for line in text.splitlines() if line.startswith("top "))
    assert "3 live children, 21 model calls, 1601 charged, 2 refused by the budget" in top_line
    assert "in top's tree" in next(line for line in text.splitlines() if line.startswith("c2 "))
    child_line = next(line for line in text.splitlines() if line.startswith("c0 "))
    assert "the tree's: 1500/5000" in child_line and "no budget" not in child_line, child_line  # not its own
    r.delete(K.RolloutKeys("top").budget)  # a tree without a budget: its ledger counts nothing
    r.hset(K.RolloutKeys("top").budget, mapping={"unlimited": 1, "ttl": 60})
    text = render(collect(r, now=NOW))
    top_line = next(line for line in text.splitlines() if line.startswith("top "))
    assert "3 live children (no budget: nothing charged)" in top_line and "model calls" not in top_line


def test_status_help_says_what_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for table in ("QUEUES", "WORKERS", "LIVE ROLLOUTS"):
        assert table in out, out
    assert "budget used/limit" in out and "--json prints the same snapshot" in out, out
