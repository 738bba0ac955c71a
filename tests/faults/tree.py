"""A real rollout tree for the recursion fault tests: a top rollout (``RLMEnv``, in a
process of its own so it can be killed) whose REPL calls ``rlm_batch`` on one child (depth 2), whose
REPL calls ``rlm_batch`` on ``grandchildren`` children (depth 3 of 3), each of which calls
``llm_batch`` in a loop for ``leaf_seconds`` (or until a call is refused) and answers
``"<calls> <why it stopped>"``. Every root turn's code comes from the scripted model
(``root_code_directive``); workers are real ``rlmq worker --repl-slots`` processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import redis

from rlmq.cli.local import LocalFleet, child_env
from rlmq.common import keys as K
from rlmq.scripted.server import root_code_directive

LEAF = """
import time
n, why, end = 0, 'done', time.time() + {seconds}
while time.time() < end:
    r = llm_batch(['leaf [[mock:sleep:0.1]]'])
    n += 1
    if r[0].startswith('[rejected]') or r[0].startswith('[error]'):
        why = r[0][:120]
        break
answer['content'] = f'{{n}} {{why}}'
answer['ready'] = True
"""

MIDDLE = """
r = rlm_batch([{{'prompt': 'grandchild ' + str(i) + ' ' + {leaf!r}}} for i in range({n})])
answer['content'] = ' | '.join(r)
answer['ready'] = True
"""

TOP = """
r = rlm_batch(['child ' + {middle!r}])
answer['content'] = r[0]
answer['ready'] = True
"""

PRODUCER = """
import asyncio, json, sys
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv

redis_url, base_url, model, rid, question, budget, key_ttl = sys.argv[1:8]

async def main():
    settings = load_settings(redis_url=redis_url, base_url=base_url, model=model, max_depth=3,
                             sub_call_timeout=120, rollout_timeout=120, rollout_key_ttl=int(key_ttl),
                             sub_llm_max_completion_tokens=int(budget) if budget != '0' else None)
    row = DatasetRow(id="tree", question=question, context="x")
    async with RLMEnv(settings=settings) as env:
        res = await env.rollout(row, model=model, rollout_id=rid)
    print(json.dumps({"row": res.row.model_dump(mode="json"), "trajectory": res.trajectory}), flush=True)

asyncio.run(main())
"""


def tree_question(grandchildren: int, leaf_seconds: float) -> str:
    """The top rollout's question (see the module docstring)."""
    leaf = root_code_directive(LEAF.format(seconds=leaf_seconds))
    middle = root_code_directive(MIDDLE.format(leaf=leaf, n=grandchildren))
    return "tree " + root_code_directive(TOP.format(middle=middle))


def start_top(
    fleet: LocalFleet, rid: str, question: str, *, budget: int = 0, key_ttl: int = 60
) -> subprocess.Popen[bytes]:
    """Start the top rollout ``rid`` in a process (a session) of its own; its stdout is the result JSON."""
    argv = [sys.executable, "-c", PRODUCER, str(fleet.redis_url), str(fleet.base_url), fleet.model, rid, question,
            str(budget), str(key_ttl)]  # fmt: skip
    return subprocess.Popen(
        argv, env=child_env(), cwd=os.getcwd(), start_new_session=True, stdout=subprocess.PIPE
    )  # fmt: skip


def started_jobs(r: redis.Redis, queue: str, depth: int) -> list[tuple[str, str]]:
    """``(job id, worker name)`` of the jobs started on the child queue of ``depth``."""
    out = []
    for member in r.zrange(K.rq_started(K.child_queue(queue, depth)), 0, -1):
        jid = member.decode().rsplit(":", 1)[0]
        worker = r.hget(K.rq_job(jid), "worker_name")
        out.append((jid, (worker or b"").decode()))
    return out


def jobs_of(r: redis.Redis, rollout_id: str) -> dict[str, str]:
    """Job id -> status of the jobs rollout ``rollout_id`` enqueued (its batches' slots)."""
    out = {}
    for key in r.scan_iter(match=f"rq:job:{rollout_id}-*", count=1000):
        status = r.hget(key, "status")
        if status is not None:
            out[key.decode().removeprefix("rq:job:")] = status.decode()
    return out


def meta_of(r: redis.Redis, jid: str) -> dict[str, Any]:
    """A job's ``rlmq_meta`` (the slot, depth, parent, child id)."""
    import json

    raw = r.hget(K.rq_job(jid), "rlmq_meta")
    return dict(json.loads(raw)) if raw else {}
