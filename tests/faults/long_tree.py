"""A long tree beside a stream of short ones, on one producer and the same REPL hosts.

One ``RLMEnv`` (a process of its own) runs a *long* tree whose rollout at depth ``D`` works for
``seconds`` (``llm_batch`` in a loop, then ``rlm_batch`` on one quick child below it), while
*short* trees of depth ``D`` start every ``every`` seconds on the same environment: each of their
rollouts enters (and leaves) a tree node on the producer (depth 1) or on the REPL hosts (depths 2
and 3), more often than the refresh tick of the long tree's node. The long rollout answers the
refusals and errors it met; the script prints it with the short trees' stop reasons as JSON.
Every root turn's code comes from the scripted model (``root_code_directive``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from rlmq.cli.local import LocalFleet, child_env
from rlmq.scripted.server import root_code_directive

WORK = """
import time
n, bad, end = 0, [], time.time() + {seconds}
def check(replies):
    bad.extend(x[:200] for x in replies if x.startswith('[rejected]') or x.startswith('[error]'))
while time.time() < end:
    check(llm_batch(['long [[mock:sleep:0.2]]']))
    n += 1
check(rlm_batch(['quick ' + {quick!r}]))
answer['content'] = f'{{n}} calls, bad: {{bad}}'
answer['ready'] = True
"""

QUICK = "answer['content'] = 'quick'\nanswer['ready'] = True\n"

PASS_DOWN = """
r = rlm_batch(['level ' + {inner!r}])
answer['content'] = r[0]
answer['ready'] = True
"""


def chain(depth: int, innermost: str) -> str:
    """A question whose rollout at ``depth`` (1 = the top) runs ``innermost`` (REPL code): the
    levels above it pass one task down with ``rlm_batch``."""
    question = root_code_directive(innermost)
    for _ in range(depth - 1):
        question = root_code_directive(PASS_DOWN.format(inner=question))
    return question


def long_question(depth: int, seconds: float) -> str:
    """The long tree: its rollout at ``depth`` works ``seconds``, then asks one quick child."""
    return "long " + chain(depth, WORK.format(seconds=seconds, quick=root_code_directive(QUICK)))


def short_question(depth: int) -> str:
    """A short tree: ``depth`` rollouts in a chain, the deepest answering at once."""
    return "short " + chain(depth, QUICK)


STREAM = """
import asyncio, json, sys
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv

redis_url, base_url, model, long_q, short_q, every, key_ttl = sys.argv[1:8]

async def main():
    settings = load_settings(redis_url=redis_url, base_url=base_url, model=model, max_depth=3,
                             sub_call_timeout=120, rollout_timeout=300, rollout_key_ttl=int(key_ttl))
    async with RLMEnv(settings=settings) as env:
        long = asyncio.create_task(env.rollout(DatasetRow(id="long", question=long_q, context="x"), model=model))
        shorts = []
        while not long.done():
            row = DatasetRow(id=f"short{len(shorts)}", question=short_q, context="x")
            shorts.append(asyncio.create_task(env.rollout(row, model=model)))
            await asyncio.wait([long], timeout=float(every))  # pacing of the stream of short trees
        done = [await s for s in shorts]
        res = long.result()
    print(json.dumps({"long": res.row.model_dump(mode="json"), "trajectory": res.trajectory,
                      "shorts": [s.row.stop_reason for s in done]}), flush=True)

asyncio.run(main())
"""


def start_stream(
    fleet: LocalFleet, depth: int, seconds: float, *, every: float, key_ttl: int
) -> subprocess.Popen[bytes]:
    """Start the producer process (see the module docstring); its last stdout line is the JSON."""
    argv = [sys.executable, "-c", STREAM, str(fleet.redis_url), str(fleet.base_url), fleet.model,
            long_question(depth, seconds), short_question(depth), str(every), str(key_ttl)]  # fmt: skip
    return subprocess.Popen(argv, env=child_env(), cwd=os.getcwd(), start_new_session=True, stdout=subprocess.PIPE)
