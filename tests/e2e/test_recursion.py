"""Recursive sub-RLMs end to end, as a user runs them: ``python -m bench.needle`` writes a
needle-in-a-haystack dataset, ``rlmq run data.jsonl --max-depth D`` answers it with the scripted
model (which splits ``context`` into ``K`` parts at every level and recurses with ``rlm_batch``),
child rollouts run as jobs on real ``rlmq worker --repl-slots`` processes over a real Redis.

Each run is checked against the tree it must have built: every row correct and ``answer_ready``,
the scripted server's counters (root requests per depth = the tree's rollouts per depth, leaf
calls = ``rows * K**D`` distinct conversations exactly, and at most a quarter as many sent again,
such as an idle worker's early lane call that lost its race to a busy worker), the rows' per-depth
metrics and the nesting of ``trajectories.jsonl``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.cli.status import render
from rlmq.common import keys as K
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0
"""Seconds one ``rlmq run`` may take on a loaded 2-core machine (they take a few)."""


def needle_data(tmp: Path, *, rows: int, split: int, lines: int = 64, seed: int = 7) -> tuple[Path, dict[str, str]]:
    """``python -m bench.needle`` writes the dataset; returns its path and the answers by row id."""
    path = tmp / f"needle-{rows}x{split}-{seed}.jsonl"
    made = subprocess.run(
        [sys.executable, "-m", "bench.needle", "--rows", str(rows), "--lines", str(lines),
         "--split", str(split), "--seed", str(seed), "--out", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    answers = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        answers[row["id"]] = row["answer"]
    return path, answers


def stats(base_url: str) -> dict[str, Any]:
    """``GET /stats`` of the scripted model server."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=30) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def reset_stats(base_url: str) -> None:
    """``DELETE /stats``: zero the scripted model server's counters."""
    with urllib.request.urlopen(urllib.request.Request(base_url.removesuffix("/v1") + "/stats", method="DELETE")):
        pass


def run_argv(data: Path, run_dir: Path, base_url: str, model: str, depth: int, *extra: str) -> list[str]:
    """``rlmq run`` of ``data`` at ``--max-depth depth`` into ``run_dir``."""
    return rlmq_command(
        "run", str(data), "--base-url", base_url, "--model", model, "--max-depth", str(depth),
        "--run-dir", str(run_dir), "--quiet", "--max-startup-wait-seconds", "60", *extra,
    )  # fmt: skip


def run_rlmq(argv: list[str], env: dict[str, str] | None = None, timeout: float = RUN_DEADLINE) -> None:
    """Run ``argv`` to its end (at most ``timeout`` seconds); it must exit 0."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env(env), check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rlm_events(trajectory: list[Any]) -> list[dict[str, Any]]:
    """The ``rlm_batch`` events of one trajectory (its own level only)."""
    return [e for e in trajectory if isinstance(e, dict) and e.get("type") == "rlm_batch"]


def check_level(trajectory: list[Any], depth: int, max_depth: int, split: int) -> int:
    """Walk one rollout's trajectory at ``depth``: below ``max_depth`` exactly one ``rlm_batch`` call
    of ``split`` tasks, each answered by a child of ``depth + 1`` whose trajectory nests the same way;
    at ``max_depth`` none (its needle search uses ``llm_batch``). Returns the subtree's leaf count."""
    events = rlm_events(trajectory)
    if depth == max_depth:
        assert events == []
        calls = [e for e in trajectory if isinstance(e, dict) and e.get("type") == "llm_batch"]
        assert len(calls) == 1, [e.get("type") for e in trajectory if isinstance(e, dict)]
        return split
    assert len(events) == 1, [e.get("type") for e in trajectory if isinstance(e, dict)]
    results = events[0]["results"]
    assert len(results) == split
    leaves = 0
    for result in results:
        assert result["status"] == "ok", result
        child = result["child"]
        assert child["depth"] == depth + 1 and child["stop_reason"] == "answer_ready", child
        leaves += check_level(child["trajectory"], depth + 1, max_depth, split)
    return leaves


def check_run(run_dir: Path, answers: dict[str, str], seen: dict[str, Any], *, depth: int, split: int) -> None:
    """The whole tree of every row of a finished run (see the module docstring)."""
    rows = read_jsonl(run_dir / "rows.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(answers)
    for row in rows:
        assert row.get("error") in (None, ""), row.get("error")
        assert row["final_answer"].strip() == answers[row["id"]], (row["id"], row["final_answer"])
        assert row["stop_reason"] == "answer_ready", row["stop_reason"]
        m = row["metrics"]
        assert m["tree_depth"] == depth and m["tree_rollout_count"] == sum(split**k for k in range(depth))
        for d in range(1, depth + 1):
            assert m[f"depth{d}_rollouts"] == split ** (d - 1), (d, m)
        # tasks issued: every rollout above max_depth issues `split`
        assert m["rlm_call_count"] == sum(split**k for k in range(1, depth)), m
        assert m["rlm_call_failed_count"] == 0
    n = len(answers)
    # the server saw each rollout's one root turn at its depth, and each leaf once
    want = {str(d): n * split ** (d - 1) for d in range(1, depth + 1)}
    assert seen["root_requests_by_depth"] == want, seen["root_requests_by_depth"]
    # each leaf's call reached the server; a call sent again (an idle worker's early lane call
    # that lost its START race to a busy worker: a wasted call the producer drops) is the same
    # conversation, never a new leaf
    sub = seen["per_role"]["sub"]
    assert sub["requests"] - sub["repeats"] == n * split**depth, seen["per_role"]
    assert sub["completions"] - sub["repeats"] == n * split**depth, seen["per_role"]
    assert sub["repeats"] <= n * split**depth // 4, seen["per_role"]
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajectories) == n
    for t in trajectories:
        assert check_level(t["trajectory"], 1, depth, split) == split**depth


@pytest.fixture(scope="module")
def hosts(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """The scripted model and two separately started ``rlmq worker --repl-slots 2`` processes on
    the session's Redis."""
    with LocalFleet(
        redis_url=redis_url, model=f"rec-{uuid.uuid4().hex[:6]}", workers=2, worker_concurrency=16,
        repl_slots=2, log_dir=str(tmp_path_factory.mktemp("rec-logs")),
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(2)
        yield fleet


def child_queues(r: redis.Redis, queue: str, depth: int) -> list[str]:
    """The queues of RQ's queue set (``rq info`` lists them) that are ``queue``'s child queue of
    ``depth``, for any tenant (``rlmq run`` enqueues on its tenant's queues: ``...+rlm2@<tenant>``)."""
    name = K.child_queue(queue, depth)
    found = [K.queue_of_key(key) for key in r.smembers(K.RQ_QUEUES)]
    return [q for q in found if q == name or q.startswith(name + "@")]


def registries_with_jobs(r: redis.Redis, queue: str, depth: int) -> list[str]:
    """RQ's non-empty job lists and registries (waiting, started, finished, failed) of ``queue``'s
    child queues of ``depth``, any tenant."""
    name = K.child_queue(queue, depth)
    found = []
    for pattern in (K.rq_queue(name), K.rq_started(name), K.rq_finished(name), K.rq_failed(name)):
        for key in r.keys(pattern + "*"):
            kind = r.type(key)
            if (kind == b"list" and r.llen(key)) or (kind == b"zset" and r.zcard(key)):
                found.append(key.decode())
    return found


def status_json(redis_url: str) -> dict[str, Any]:
    """``rlmq status --json`` as a user runs it."""
    out = subprocess.run(
        rlmq_command("status", "--json", "--redis-url", redis_url),
        capture_output=True, text=True, timeout=60, env=child_env(), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_depth2_needle_on_separate_repl_hosts_visible_in_status_and_rq(
    hosts: LocalFleet, redis_url: str, tmp_path: Path
) -> None:
    split = 3
    data, answers = needle_data(tmp_path, rows=2, split=split)
    # a slow first line of every prompt of the tree keeps it running while we look at it
    slow = tmp_path / "slow.jsonl"
    slow.write_text(
        "".join(json.dumps({**r, "question": r["question"] + " [[mock:sleep:1.5]]"}) + "\n" for r in read_jsonl(data))
    )
    base = str(hosts.base_url)
    reset_stats(base)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        run_argv(slow, run_dir, base, hosts.model, 2, "--concurrency", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env({"RLMQ_REDIS_URL": redis_url}),
    )  # fmt: skip
    r = redis.Redis.from_url(redis_url)
    base_queue = K.queue_name_for_model(hosts.model)
    try:
        deadline = time.monotonic() + RUN_DEADLINE
        child_rows: list[dict[str, Any]] = []
        descriptions: list[str] = []
        snaps: list[dict[str, Any]] = []
        while proc.poll() is None and not (child_rows and descriptions):
            assert time.monotonic() < deadline, "the run did not end in time"
            if not child_rows:
                snap = status_json(redis_url)
                snaps.append(snap["rollouts"])
                tops = {x["id"] for x in snap["rollouts"] if x["depth"] == 1}
                child_rows = [x for x in snap["rollouts"] if x["depth"] == 2 and x["parent"] in tops]
                seen = snap  # the snapshot that listed children: its text is what `rlmq status` printed then
            if not descriptions:
                for cq in child_queues(r, base_queue, 2):
                    for job_id in [m.decode().split(":")[0] for m in r.zrange(K.rq_started(cq), 0, -1)]:
                        desc = r.hget(K.rq_job(job_id), "description")
                        if desc:
                            descriptions.append(desc.decode())
            time.sleep(0.1)  # polling other processes' state, bounded by the deadline
        assert child_rows, snaps
        assert descriptions, "no child job seen in the started registry of a depth-2 queue"
        assert all("depth=2" in d and "parent=" in d for d in descriptions), descriptions
        # the command prints (the children may have ended by now: a second snapshot would race them)...
        cli = subprocess.run(
            rlmq_command("status", "--redis-url", redis_url),
            capture_output=True, text=True, timeout=60, env=child_env(), check=False,
        )  # fmt: skip
        assert cli.returncode == 0 and "LIVE ROLLOUTS" in cli.stdout, cli.stdout + cli.stderr
        # ...and the snapshot that listed the children renders them with their depth and parent
        text = render(seen)
        assert "DEPTH" in text and "PARENT" in text
        assert all(row["parent"] in text and row["id"] in text for row in child_rows), text
        out, err = proc.communicate(timeout=RUN_DEADLINE)
        assert proc.returncode == 0, out.decode()[-3000:] + err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        r.close()
    check_run(run_dir, answers, stats(base), depth=2, split=split)


def test_depth3_needle_on_the_embedded_fleet(tmp_path: Path) -> None:
    split = 2
    data, answers = needle_data(tmp_path, rows=3, split=split)
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        run_dir = tmp_path / "run"
        run_rlmq(run_argv(data, run_dir, base, "scripted", 3, "--workers", "2", "--concurrency", "3"))
        check_run(run_dir, answers, stats(base), depth=3, split=split)
    finally:
        group.stop()


def test_depth3_on_the_smallest_fleet_finishes(redis_url: str, tmp_path: Path) -> None:
    """ONE worker, one model call at a time, one REPL slot per depth, two trees at once (fan-out 2
    at each level): parents waiting for children never hold what the children need."""
    split = 2
    data, answers = needle_data(tmp_path, rows=1, split=split, seed=11)
    with LocalFleet(
        redis_url=redis_url, model=f"tiny-{uuid.uuid4().hex[:6]}", workers=1, worker_concurrency=1, repl_slots=1,
        log_dir=str(tmp_path / "logs"),
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(1)
        run_dir = tmp_path / "run"
        base = str(fleet.base_url)
        run_rlmq(
            run_argv(data, run_dir, base, fleet.model, 3),
            env={"RLMQ_REDIS_URL": redis_url}, timeout=90.0,
        )  # fmt: skip
        check_run(run_dir, answers, stats(base), depth=3, split=split)


def test_many_rows_on_a_wide_fleet(redis_url: str, tmp_path: Path) -> None:
    split = 3
    data, answers = needle_data(tmp_path, rows=10, split=split, seed=5)
    with LocalFleet(
        redis_url=redis_url, model=f"wide-{uuid.uuid4().hex[:6]}", workers=3, worker_concurrency=32, repl_slots=6,
        log_dir=str(tmp_path / "logs"),
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(3)
        run_dir = tmp_path / "run"
        base = str(fleet.base_url)
        argv = run_argv(data, run_dir, base, fleet.model, 2, "--concurrency", "10")
        run_rlmq(argv, env={"RLMQ_REDIS_URL": redis_url})
        check_run(run_dir, answers, stats(base), depth=2, split=split)


def test_at_max_depth_rlm_batch_runs_plain_sub_llm_calls(hosts: LocalFleet, redis_url: str, tmp_path: Path) -> None:
    """A child at depth 2 of 2 calls ``rlm_batch``: its tasks run as plain sub-LLM calls (with the
    task's context rendered into the prompt), no job goes to the depth-3 queue."""
    inner = "got = rlm_batch([{'prompt': 'Find it. [[mock:needle]]', 'context': 'the secret code is deep-42.'}])\n"
    inner += "answer['content'] = got[0]\nanswer['ready'] = True"
    child_task = "child " + root_code_directive(inner)
    top = f"got = rlm_batch([{child_task!r}])\nanswer['content'] = got[0]\nanswer['ready'] = True"
    data = tmp_path / "limit.jsonl"
    data.write_text(json.dumps({"id": "limit", "question": "top " + root_code_directive(top), "context": "c"}) + "\n")
    base = str(hosts.base_url)
    reset_stats(base)
    r = redis.Redis.from_url(redis_url)
    queue = K.queue_name_for_model(hosts.model)
    run_dir = tmp_path / "run"
    try:
        run_rlmq(run_argv(data, run_dir, base, hosts.model, 2), env={"RLMQ_REDIS_URL": redis_url})
        # RQ's registries: the depth-2 child's job finished on a depth-2 queue; no depth-3 queue
        # (the workers list those they serve in RQ's queue set) ever had a job
        assert registries_with_jobs(r, queue, 2), "the depth-2 child ran as a job of a depth-2 queue"
        assert registries_with_jobs(r, queue, 3) == []
    finally:
        r.close()
    (row,) = read_jsonl(run_dir / "rows.jsonl")
    assert row["final_answer"] == "deep-42" and row["stop_reason"] == "answer_ready", row
    seen = stats(base)
    assert seen["root_requests_by_depth"] == {"1": 1, "2": 1}, seen["root_requests_by_depth"]
    assert seen["per_role"]["sub"]["completions"] - seen["per_role"]["sub"]["repeats"] == 1
    (t,) = read_jsonl(run_dir / "trajectories.jsonl")
    (top_call,) = rlm_events(t["trajectory"])
    child = top_call["results"][0]["child"]
    assert child["depth"] == 2
    (deep_call,) = rlm_events(child["trajectory"])
    (plain,) = deep_call["results"]
    assert plain["status"] == "ok" and plain["content"] == "deep-42" and "child" not in plain, plain
    assert row["metrics"]["rlm_call_count"] == 2 and row["metrics"]["tree_depth"] == 2
