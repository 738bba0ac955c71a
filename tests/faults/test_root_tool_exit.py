"""A sync root tool that never returns must not keep the producer's process from exiting; a
thread that cannot start fails its call and locks no rollout out of its tools."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, time
    from rlmq.producer.root_tools import RootToolbox, ToolFailure

    def hang():
        time.sleep(3600)

    async def main():
        box = RootToolbox([hang], timeout=0.3, max_result_bytes=1024)
        try:
            await box.call("hang", [], {})
        except ToolFailure as exc:
            print(exc, flush=True)
        box.close()

    asyncio.run(main())
    """
)


def test_a_hung_sync_tool_does_not_block_the_process_exit() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert "hang did not return within its timeout of 0.3 s" in proc.stdout


NO_THREAD = textwrap.dedent(
    """
    import asyncio, resource, threading
    from rlmq.producer.root_tools import RootToolbox, ToolFailure

    def fine():
        return 1

    async def main():
        box = RootToolbox([fine], timeout=5, max_result_bytes=1024)
        threading.stack_size(1 << 30)  # 1 GiB stacks: no new thread fits under the limit below
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, hard))
        try:
            await box.call("fine", [], {}, owner="r1")
        except ToolFailure as exc:
            print("REFUSED", exc, flush=True)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        threading.stack_size(0)
        print("AFTER", await box.call("fine", [], {}, owner="r1"), flush=True)

    asyncio.run(main())
    """
)


def test_a_thread_that_cannot_start_fails_the_call_and_holds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-c", NO_THREAD], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED fine: the producer could not start a thread for it (can't start new thread)" in proc.stdout
    assert "AFTER 1" in proc.stdout  # the rollout is not locked out of its tools
