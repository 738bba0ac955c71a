"""Jobs whose payload is not a valid rlmq sub-LLM request, put straight into the queue.

Each fails with a clear error (RQ's failed registry and result stream, and an error result
on its reply stream), never reaches the model server, and pickled data is never unpickled.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import time
import zlib

import redis
from rq import Queue
from rq.registry import FailedJobRegistry

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.jobs.record import SUB_LLM_FUNC, encode_job_data, job_hash
from tests.faults.conftest import model_stats, wait_until
from tests.replies import reply_results


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_invalid_job_payloads_fail_clearly(fault_fleet: LocalFleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    marker = tmp_path / "unpickled"
    rid = f"badjobs-{time.time_ns()}"
    now = time.time()
    valid = {"rollout_id": rid, "batch_id": "b1", "index": 0, "prompt": "hi", "model": fleet.model,
             "enqueued_at": now, "deadline": now + 30}  # fmt: skip
    payloads = [
        pickle.dumps(_Evil(str(marker))),  # a pickled job
        zlib.compress(pickle.dumps(_Evil(str(marker)))),  # zlib of a pickle
        encode_job_data("os.system", [f"touch {marker}"]),  # another function
        encode_job_data(SUB_LLM_FUNC, [{**valid, "prompt": 5}]),  # fails validation
        encode_job_data(SUB_LLM_FUNC, [{**valid, "extra": "field"}]),  # unknown field
        encode_job_data(SUB_LLM_FUNC, [valid, valid]),  # wrong arity
        b"\x00\xff garbage",
    ]
    queue = K.queue_name_for_model(fleet.model)
    reply = K.RolloutKeys(rid).reply("b1")
    ids = []
    with sync.pipeline(transaction=False) as pipe:
        for i, data in enumerate(payloads):
            jid = f"{rid}-b1-{i}"
            ids.append(jid)
            h = job_hash(
                queue=queue, args=[], description="bad", timeout=60, result_ttl=60, failure_ttl=600, ttl=60,
                reply_key=reply, meta={"rollout_id": rid, "batch_id": "b1", "index": i},
            )  # fmt: skip
            h["data"] = data
            pipe.hset(K.rq_job(jid), mapping=h)
            pipe.expire(K.rq_job(jid), 60)
        pipe.rpush(K.rq_queue(queue), *ids)
        pipe.sadd(K.RQ_QUEUES, K.rq_queue(queue))
        pipe.execute()
    name = f"payload-{os.getpid()}"
    proc = fleet.start_worker("payload", ["--name", name])
    wait_until(lambda: sync.xlen(reply) >= len(payloads), 30, "an error result per bad job")
    results = sorted(reply_results(sync, reply), key=lambda r: r.index)
    assert [r.index for r in results] == list(range(len(payloads)))
    for r in results:
        assert r.status == "error" and r.error_kind == "payload", r
        assert r.content.startswith("[error] invalid sub-LLM job"), r.content
    assert "never runs pickled" in results[0].content or "not JSON" in results[0].content
    failed = FailedJobRegistry(queue=Queue(queue, connection=sync))
    assert sorted(failed.get_job_ids()) == sorted(ids)
    for jid in ids:
        assert sync.hget(K.rq_job(jid), "status") == b"failed"
        entries = sync.xrange(K.rq_results(jid))
        assert entries and entries[-1][1][b"type"] == b"2"
        exc = zlib.decompress(base64.b64decode(entries[-1][1][b"exc_string"])).decode()
        assert exc.startswith("payload: "), exc
    assert model_stats(str(fleet.base_url))["requests"] == 0
    assert not marker.exists()
    assert proc.poll() is None
    json.dumps([r.model_dump() for r in results])  # the results are plain JSON
    sync.close()
