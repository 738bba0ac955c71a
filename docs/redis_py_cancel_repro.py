"""A cancellation that lands inside a blocking ``XREAD`` of redis-py's asyncio client is now and
then swallowed: the read returns (``[]``, as at the end of its block) and the task runs on with
``Task.cancelling() == 1``. A ``while True`` loop around the read then never ends.

Standalone: ``python docs/redis_py_cancel_repro.py [PORT]`` against a Redis on 127.0.0.1:PORT
(default 6379; it writes nothing, it reads keys ``repro:cancel:<i>`` that do not exist).
Each reader blocks 10 ms at a time; its cancellation is timed to land from the start of a read
to two blocks later, so some land as a block ends. Prints how many readers ran on after their
cancellation (``swallowed``) and how many of those returned from ``xread`` while cancelling.
"""

from __future__ import annotations

import asyncio
import sys

import redis
import redis.asyncio as aioredis

BLOCK_MS = 10
READERS = 1000


async def reader(r: aioredis.Redis, key: str, seen: list[int]) -> None:
    task = asyncio.current_task()
    assert task is not None
    while True:
        await r.xread({key: "$"}, block=BLOCK_MS)
        if task.cancelling():  # cancel() was called, yet xread returned: it swallowed the CancelledError
            seen[0] += 1
            raise asyncio.CancelledError  # what a loop must do itself to end


async def one(r: aioredis.Redis, i: int, seen: list[int]) -> None:
    task = asyncio.create_task(reader(r, f"repro:cancel:{i}", seen))
    await asyncio.sleep(BLOCK_MS / 1000 * (i % 50) / 25)
    task.cancel()
    await asyncio.wait({task})


async def main(port: int) -> None:
    r = aioredis.Redis(port=port)
    seen = [0]
    for start in range(0, READERS, 50):
        await asyncio.gather(*(one(r, i, seen) for i in range(start, start + 50)))
    print(f"redis-py {redis.__version__}: {seen[0]} of {READERS} cancellations swallowed by xread")
    await r.aclose()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6379))
