"""rlmq's names for RQ's keys must match RQ's own, and rollout keys share a hash tag."""

from __future__ import annotations

import fakeredis
import pytest
from rq import Queue, Worker
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result

from rlmq.common import keys as K
from rlmq.common.errors import ConfigError
from rlmq.common.settings import load_settings


def test_rq_keys_match_rq() -> None:
    r = fakeredis.FakeRedis()
    q = Queue("rlmq.sub.m", connection=r)
    job = Job.create("x.y", connection=r, id="j1")
    w = Worker([q], name="w1", connection=r)
    assert K.rq_queue("rlmq.sub.m") == q.key
    assert K.RQ_QUEUES == Queue.redis_queues_keys
    assert K.RQ_WORKERS == Worker.redis_workers_keys
    assert K.rq_job("j1") == job.key
    assert K.rq_results("j1") == Result.get_key("j1")
    assert K.rq_started("rlmq.sub.m") == StartedJobRegistry(queue=q).key
    assert K.rq_finished("rlmq.sub.m") == FinishedJobRegistry(queue=q).key
    assert K.rq_failed("rlmq.sub.m") == FailedJobRegistry(queue=q).key
    assert K.rq_worker("w1") == w.key
    assert K.rq_worker_executions("w1") == w.executions_key
    ex = Execution("e1", "j1", connection=r, worker_name="w1")
    assert K.rq_execution("j1", "e1") == ex.key
    assert K.rq_job_executions("j1") == ExecutionRegistry("j1", connection=r).key


def test_rollout_keys_share_hash_tag() -> None:
    keys = K.RolloutKeys("abc-1")
    for key in [*keys.all_static(), keys.reply("b1")]:
        assert key.startswith("rlmq:{abc-1}:")


def test_ledger_keys_share_the_ledger_ids_hash_tag_and_a_rollouts_own_ledger_keeps_its_names() -> None:
    tree = K.LedgerKeys("tree-7")
    for key in [*tree.all(), tree.released]:
        assert key.startswith("rlmq:{tree-7}:")
    own, rollout = K.LedgerKeys("abc-1"), K.RolloutKeys("abc-1")  # depth 1: the names of before
    assert (own.budget, own.reservations, own.live_reservations, own.released) == (
        "rlmq:{abc-1}:budget", "rlmq:{abc-1}:resv", "rlmq:{abc-1}:live", "rlmq:{abc-1}:released",
    )  # fmt: skip
    assert (rollout.budget, rollout.reservations, rollout.released) == (own.budget, own.reservations, own.released)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "a:b", "{x}"])
def test_rollout_id_is_checked(bad: str) -> None:
    with pytest.raises(ConfigError):
        K.RolloutKeys(bad)
    with pytest.raises(ConfigError):
        K.LedgerKeys(bad)


def test_queue_named_from_model_the_same_on_both_sides() -> None:
    producer = load_settings(model="root", sub_model="Qwen/Qwen3-8B")
    worker = load_settings(model="Qwen/Qwen3-8B")
    assert producer.sub_queue() == worker.worker_queue() == "rlmq.sub.Qwen_Qwen3-8B"
    assert load_settings(model="m", queue="q1").worker_queue() == "q1"
    with pytest.raises(ConfigError):
        load_settings().worker_queue()


def test_namespace() -> None:
    assert K.namespace("a", "b") == "rlmq:a:b"


@pytest.mark.parametrize(("ids", "announce_only"), [(None, False), (["r-b-0", "r-b-1"], False), (None, True)])
def test_wake_message_round_trip(ids: list[str] | None, announce_only: bool) -> None:
    text = K.wake_message("rlmq.sub.m@host-1", ids, announce_only=announce_only)
    assert K.parse_wake_message(text) == ("rlmq.sub.m@host-1", ids or [], announce_only)


def test_lane_and_wake_channel_are_per_model_queue() -> None:
    assert K.lane("rlmq.sub.m@host-1") == K.lane("rlmq.sub.m") == "rlmq:lane:rlmq.sub.m"
    assert K.wake_channel("rlmq.sub.m@host-1") == "rlmq:wake:rlmq.sub.m"
