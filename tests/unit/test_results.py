"""What a run keeps: result rows in dataset order, written by rename, never a destroyed file;
the exit code of each failure; the one URL masker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from rlmq.cli.exits import EXIT_INTERNAL, EXIT_REDIS, EXIT_USAGE, explain
from rlmq.cli.results import ResultSink, check_output, load_rows, summarize
from rlmq.common.connection import check_redis, mask_url
from rlmq.common.errors import ConfigError, EmbeddedRedisError, PayloadError, RedisUnavailableError
from rlmq.common.schemas import DatasetRow, ResultRow
from rlmq.producer.env import RolloutResult


def _rows(n: int) -> list[DatasetRow]:
    return [DatasetRow(id=f"r{i}", question="?", context="c") for i in range(n)]


def _done(rid: str) -> RolloutResult:
    return RolloutResult(row=ResultRow(id=rid, final_answer="a", answer=None, correct=None,
                                       stop_reason="answer_ready", metrics={}, error=None))  # fmt: skip


def test_rows_finishing_out_of_order_are_written_in_dataset_order(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    out.write_text('{"id": "earlier"}\n')
    sink = ResultSink(_rows(4), str(out))
    for rid in ("r2", "r0", "r3"):
        sink.add(_done(rid))
    partial = Path(f"{out}.partial")
    assert [json.loads(x)["id"] for x in partial.read_text().splitlines()] == ["r2", "r0", "r3"]  # as they finish
    assert out.read_text() == '{"id": "earlier"}\n'  # untouched while the run goes on
    assert sink.commit()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["r0", "r2", "r3"]
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]  # no temporary file left


def test_nothing_finished_leaves_an_earlier_output_alone(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    out.write_text('{"id": "earlier"}\n')
    assert not ResultSink(_rows(2), str(out)).commit()
    assert out.read_text() == '{"id": "earlier"}\n'


def test_output_checks(tmp_path: Path) -> None:
    check_output(str(tmp_path / "rows.jsonl"))
    check_output(None)
    with pytest.raises(ConfigError, match="does not exist"):
        check_output(str(tmp_path / "nope" / "rows.jsonl"))
    with pytest.raises(ConfigError, match="is a folder"):
        check_output(str(tmp_path))
    ds = tmp_path / "ds.jsonl"
    ds.write_text("{}\n")
    with pytest.raises(ConfigError, match="is the dataset itself"):
        check_output(str(tmp_path / "." / "ds.jsonl"), str(ds))
    with pytest.raises(ConfigError, match="--run-dir .* is not a folder"):
        check_output(None, run_dir=str(ds))


def test_a_url_that_is_not_redis_is_a_usage_error() -> None:
    with pytest.raises(ConfigError, match=r"not a Redis URL: foo://:\*\*\*@x"):
        check_redis("foo://:pw@x")


def test_dataset_checks(tmp_path: Path) -> None:
    ds = tmp_path / "ds.jsonl"
    with pytest.raises(ConfigError, match="cannot read"):
        load_rows(str(ds))
    ds.write_text("\n")
    with pytest.raises(ConfigError, match="no rows"):
        load_rows(str(ds))
    row = json.dumps({"id": "a", "question": "?", "context": "c"})
    ds.write_text(f"{row}\n{row}\n")
    with pytest.raises(ConfigError, match="'a' twice"):
        load_rows(str(ds))
    ds.write_text(f"{row}\n" + '{"id": "b"}\n')
    with pytest.raises(PayloadError, match=r"ds.jsonl:2: not a dataset row \(question: Field required; context"):
        load_rows(str(ds))


def test_a_dataset_that_is_not_utf8_is_a_payload_error(tmp_path: Path) -> None:
    ds = tmp_path / "ds.jsonl"
    row = json.dumps({"id": "a", "question": "?", "context": "c"})
    ds.write_bytes(f"{row}\r\n".encode() + b'\xff\xfe{"id": "b"}\n')
    with pytest.raises(PayloadError, match=r"ds.jsonl:2: not UTF-8"):
        load_rows(str(ds))
    ds.write_bytes(f"{row}\r\n\r\n".encode())
    assert [r.id for r in load_rows(str(ds))] == ["a"]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("x"), EXIT_USAGE),
        (PayloadError("x"), EXIT_USAGE),
        (RedisUnavailableError("x"), EXIT_REDIS),
        (EmbeddedRedisError("x"), EXIT_REDIS),
        (redis.ConnectionError("Error 111 connecting to r:6379"), EXIT_REDIS),
        (RuntimeError("boom"), EXIT_INTERNAL),
    ],
)
def test_exit_codes(exc: Exception, code: int) -> None:
    assert explain(exc)[0] == code


def test_one_url_masker() -> None:
    assert mask_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("redis://user:p@ss@h:1/0") == "redis://user:***@h:1/0"  # an @ in the password
    assert mask_url("rediss://127.0.0.1:6379/2") == "rediss://127.0.0.1:6379/2"
    assert (
        mask_url("failed: redis://:pw@h:1/0 and http://u:v@m/v1") == "failed: redis://:***@h:1/0 and http://u:***@m/v1"
    )
    assert explain(RuntimeError("cannot use redis://:pw@h:1/0"))[1].endswith("redis://:***@h:1/0")


def test_a_redis_that_wants_a_password_we_did_not_give_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: redis.Redis) -> bool:
        raise redis.AuthenticationError("HELLO must be called with the client already authenticated, otherwise ...")

    monkeypatch.setattr(redis.Redis, "ping", refuse)
    with pytest.raises(RedisUnavailableError, match=r"1/0 refused the connection: it needs a password") as info:
        check_redis("redis://127.0.0.1:1/0")
    assert info.value.auth
    with pytest.raises(RedisUnavailableError, match=r"refused the credentials") as info:
        check_redis("redis://:wrong@127.0.0.1:1/0")
    assert "wrong" not in str(info.value)


def test_output_through_a_symlink_or_into_a_fifo_keeps_the_link_and_the_fifo(tmp_path: Path) -> None:
    import os
    import stat
    import threading

    real = tmp_path / "real.jsonl"
    real.write_text("earlier\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    sink = ResultSink(_rows(1), str(link))
    sink.add(_done("r0"))
    assert sink.commit()
    assert link.is_symlink() and json.loads(real.read_text())["id"] == "r0"
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(real.stat().st_mode) == 0o666 & ~umask  # readable like any file it writes

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    sink = ResultSink(_rows(1), str(fifo))
    sink.add(_done("r0"))
    assert sink.commit()
    reader.join(5)
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # not replaced by a regular file
    assert [json.loads(x)["id"] for x in got[0].splitlines()] == ["r0"]
    assert not Path(f"{fifo}.partial").exists()


def test_the_summary_counts_sub_calls_that_failed_in_all() -> None:
    row = {"id": "a", "correct": None, "stop_reason": "answer_ready", "error": None}
    rows = [
        {**row, "metrics": {"sub_llm_call_count": 3, "sub_llm_error_count": 3, "sub_llm_rejected_count": 0}},
        {**row, "id": "b", "metrics": {"sub_llm_call_count": 1, "sub_llm_error_count": 2, "sub_llm_rejected_count": 1}},
    ]
    text = summarize(rows)
    assert "sub-LLM calls: 5 in all, 5 ended in error, 1 rejected by the budget  <- see the errors" in text
    healthy = summarize([{**row, "metrics": {"sub_llm_call_count": 4, "sub_llm_error_count": 0}}])
    assert "sub-LLM calls: 4 in all, 0 ended in error, 0 rejected by the budget" in healthy
    assert "<-" not in healthy


def test_the_summary_shows_tree_figures_only_for_runs_that_started_children() -> None:
    row = {"id": "a", "correct": None, "stop_reason": "answer_ready", "error": None}
    flat = {"sub_llm_call_count": 1, "rlm_call_count": 0, "tree_rollout_count": 1, "depth1_root_turns": 2}
    text = summarize([{**row, "metrics": flat}])
    assert "rlm_batch" not in text and "depth1_root_turns" not in text and "tree_rollout_count" not in text
    assert "sub_llm_call_count" in text
    tree = {**flat, "rlm_call_count": 4, "tree_rollout_count": 4, "tree_charged_completion_tokens": 90}
    text = summarize([{**row, "metrics": tree}, {**row, "id": "b", "metrics": flat}])
    assert "rlm_batch: 4 task(s) in all, 3 child rollout(s) reported, 90 completion tokens charged" in text
    assert "depth1_root_turns" in text and "tree_rollout_count" in text


def test_whole_tree_figures_and_a_starved_tree_in_the_summary_and_exit_code() -> None:
    """A depth-3 row whose own sub_llm_call_count is 0 (its children made the calls) still counts
    them all; a child ended by the budget (budget_spent) is said and gives exit code 7."""
    from rlmq.cli.exits import EXIT_BUDGET_STARVED, EXIT_OK
    from rlmq.cli.results import exit_code

    row = {"id": "a", "correct": False, "stop_reason": "answer_ready", "error": None}
    tree = {"sub_llm_call_count": 0, "sub_llm_error_count": 0, "rlm_call_count": 6, "tree_rollout_count": 7,
            "tree_depth": 3, "tree_sub_llm_call_count": 6, "tree_sub_llm_error_count": 1,
            "tree_sub_llm_rejected_count": 2, "tree_charged_completion_tokens": 1601}  # fmt: skip
    healthy = [{**row, "metrics": tree}]
    text = summarize(healthy)
    assert "sub-LLM calls: 8 in all, 1 ended in error, 2 rejected by the budget" in text
    assert "6 child rollout(s) reported, 1601 completion tokens charged" in text and "depth 3" in text
    assert "budget_spent" not in text and exit_code(healthy, 0.5) == EXIT_OK
    starved = [*healthy, {**row, "id": "b", "metrics": {**tree, "tree_budget_spent_count": 3}}]
    text = summarize(starved)
    assert "budget: 3 child rollout(s) ended by the tree budget (budget_spent) in 1 of 2 rollout(s)" in text
    assert exit_code(starved, 0.5) == EXIT_BUDGET_STARVED


def test_a_first_connection_retries_a_drop_but_not_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """reach_redis: a connection the network closed is retried (and said); a refused one is not."""
    from rlmq.common.connection import reach_redis

    said: list[str] = []
    with pytest.raises(RedisUnavailableError, match="cannot reach Redis"):
        reach_redis("redis://127.0.0.1:1/0", say=said.append, max_wait=5)  # nothing listens on port 1
    assert said == []
    calls: list[int] = []

    def drop_twice(self: redis.Redis) -> bool:
        calls.append(1)
        if len(calls) <= 2:
            raise redis.ConnectionError("Connection closed by server.")
        return True

    monkeypatch.setattr(redis.Redis, "ping", drop_twice)
    reach_redis("redis://127.0.0.1:1/0", say=said.append, max_wait=30)
    assert len(calls) == 3 and len(said) == 2 and all("retrying in" in line for line in said), said
