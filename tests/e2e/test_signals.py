"""Stopping ``rlmq run`` and ``rlmq worker`` as users do: real commands, real signals.

Each test runs the real command as a subprocess (in a session of its own, so only the signal
the test sends reaches it), sends real signals, and counts the command's children with psutil
after the stated deadline. Sub-calls are in flight when the signal comes: the scripted model
answers every call after ``LATENCY`` seconds, and the test waits until a worker holds one.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.common import keys as K
from rlmq.common.aio import STOP_DEADLINE_SECONDS
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher

pytestmark = pytest.mark.e2e

LATENCY = 2.0
"""Seconds the scripted model takes per call: long enough that sub-calls are in flight."""

ONE_SIGNAL_SECONDS = 10.0
"""What the README states for one Ctrl-C / SIGTERM / SIGHUP of `rlmq run` with sub-calls in
flight (measured 2-4 s on 2 busy cores); the hard limit is STOP_DEADLINE_SECONDS."""


@pytest.fixture(scope="module")
def slow_model() -> Iterator[str]:
    group = ProcessGroup()
    try:
        yield start_mock_llm(group, latency=LATENCY)
    finally:
        group.stop()


def write_dataset(path: Path, n: int, *, slow_first: float = 0.0) -> list[str]:
    rows = needle_rows(n, min_chars=30_000, seed=7)
    if slow_first:
        rows[0]["question"] = f"{rows[0]['question']} [[mock:sleep:{slow_first:g}]]"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(r["id"]) for r in rows]


def as_from_a_terminal(ignore: tuple[signal.Signals, ...] = ()) -> Callable[[], None]:
    """A ``preexec_fn``: the stop signals at their defaults, as a command typed in a terminal
    gets them (pytest itself may run with some ignored: a background job in a script ignores
    SIGINT, ``nohup`` SIGHUP); those in ``ignore`` ignored, as ``nohup`` does."""

    def preexec() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)

    return preexec


class Command:
    """A running ``rlmq ...`` subprocess whose stdout+stderr is read by a thread."""

    def __init__(self, *args: str, cwd: Path, ignore: tuple[signal.Signals, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            rlmq_command(*args), cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, preexec_fn=as_from_a_terminal(ignore),
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 60.0) -> str:
        """The first line of output holding ``needle``, waiting for it up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            self._reader.join(0.05)  # bounded wait for more output
        pytest.fail(f"no line with {needle!r} within {timeout:g} s; output: {self.text[-3000:]}")

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running {timeout:g} s after the signal; output: {self.text[-3000:]}")
        self._reader.join(5)
        return rc


def wait_for_sub_calls_in_flight(redis_url: str, timeout: float = 60.0) -> int:
    """Block until some worker on ``redis_url`` holds at least one sub-call; returns how many."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            held = 0
            for wkey in client.smembers(K.RQ_WORKERS):
                held += int(client.scard(K.rq_worker_executions(wkey.decode().split(":", 2)[2])))
            if held:
                return held
            time.sleep(0.05)  # polling another process's state, bounded by the deadline
    finally:
        client.close()
    pytest.fail(f"no sub-call in flight within {timeout:g} s")


def wait_for_lines(path: Path, n: int, timeout: float = 90.0) -> None:
    """Block until the file at ``path`` has ``n`` lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)  # polling another process's file, bounded by the deadline
    pytest.fail(f"{path} did not reach {n} line(s) within {timeout:g} s")


def describe(p: psutil.Process) -> str:
    """The start of ``p``'s command line, or ``(ended)`` when it has just ended."""
    try:
        return " ".join(p.cmdline()[:4])
    except psutil.Error:
        return "(ended)"


def assert_all_gone(children: list[psutil.Process], timeout: float, output: str) -> None:
    described = {p.pid: describe(p) for p in children}
    _, alive = psutil.wait_procs(children, timeout=timeout)
    assert not alive, f"left running: {[described.get(p.pid) for p in alive]}; output: {output[-2000:]}"


def start_run(
    tmp_path: Path, base_url: str, n: int = 8, *extra: str, ignore: tuple[signal.Signals, ...] = ()
) -> tuple[Command, str, list[str]]:
    ids = write_dataset(tmp_path / "ds.jsonl", n)
    cmd = Command(
        "run", "ds.jsonl", "--base-url", base_url, "--model", "scripted", "--output", "rows.jsonl",
        "--run-dir", "run", "--quiet", "--concurrency", "3", *extra, cwd=tmp_path, ignore=ignore,
    )  # fmt: skip
    line = cmd.wait_for_line("redis redis://")
    url = line.split()[1]
    return cmd, url, ids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_one_signal_stops_run_and_everything_it_started_keeping_what_finished(
    sig: signal.Signals, slow_model: str, tmp_path: Path
) -> None:
    (tmp_path / "rows.jsonl").write_text('{"id": "earlier"}\n')
    cmd, url, ids = start_run(tmp_path, slow_model)
    wait_for_lines(tmp_path / "rows.jsonl.partial", 1)  # a rollout has finished...
    wait_for_sub_calls_in_flight(url)  # ...and others have sub-calls in flight
    children = cmd.children()
    assert len(children) >= 3, [describe(c) for c in children]  # redis, 2 workers (+ REPLs)
    t0 = time.monotonic()
    cmd.proc.send_signal(sig)
    rc = cmd.wait(STOP_DEADLINE_SECONDS + 5)
    took = time.monotonic() - t0
    assert_all_gone(children, 1.0, cmd.text)
    assert rc == 128 + sig, cmd.text
    assert took < ONE_SIGNAL_SECONDS, f"{sig.name} took {took:.1f} s: {cmd.text}"
    assert f"rlmq: {sig.name}: stopping" in cmd.text  # it says what it does while it drains
    assert "cancelled" in cmd.text and "rlmq: stopping 2 local process(es)" in cmd.text
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    finished = meta["interrupted"]["finished"]
    assert meta["interrupted"] == {"signal": sig.name, "finished": finished, "rollouts": len(ids)}
    assert 1 <= finished < len(ids)
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Interrupted by " + sig.name in report
    kept = [json.loads(x)["id"] for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert kept == [i for i in ids if i in kept] and len(kept) == finished  # what finished, in dataset order
    assert len((tmp_path / "run" / "rows.jsonl").read_text().splitlines()) == finished
    assert not (tmp_path / "rows.jsonl.partial").exists()
    print(f"\n{sig.name}: everything stopped {took:.2f} s after the signal, {finished} of {len(ids)} kept")


def test_two_ctrl_c_stop_at_once_and_leave_nothing(slow_model: str, tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"id": "earlier"}\n')
    cmd, url, ids = start_run(tmp_path, slow_model)
    wait_for_sub_calls_in_flight(url)
    children = cmd.children()
    t0 = time.monotonic()
    cmd.proc.send_signal(signal.SIGINT)
    cmd.wait_for_line("rlmq: SIGINT: stopping", timeout=10)
    cmd.proc.send_signal(signal.SIGINT)
    rc = cmd.wait(STOP_DEADLINE_SECONDS + 5)
    took = time.monotonic() - t0
    assert_all_gone(children, 1.0, cmd.text)
    assert rc == 130, cmd.text
    assert "SIGINT again: stopping at once" in cmd.text
    assert took < ONE_SIGNAL_SECONDS, cmd.text
    stopped = json.loads((tmp_path / "run" / "meta.json").read_text())["interrupted"]
    assert stopped["signal"] == "SIGINT"
    if stopped["finished"] == 0:  # nothing to keep: an earlier --output is left as it was
        assert (tmp_path / "rows.jsonl").read_text() == '{"id": "earlier"}\n'
        assert "was left as it was" in cmd.text
    print(f"\ntwo Ctrl-Cs: everything stopped {took:.2f} s after the first")


def test_a_signal_ignored_by_whoever_started_it_stays_ignored(slow_model: str, tmp_path: Path) -> None:
    """`nohup rlmq run ...` survives the terminal closing (SIGHUP): rlmq keeps an inherited ignore."""
    cmd, url, ids = start_run(tmp_path, slow_model, ignore=(signal.SIGHUP,))
    wait_for_sub_calls_in_flight(url)
    cmd.proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        cmd.proc.wait(timeout=LATENCY)  # still running: a stop would have begun at once
    assert "SIGHUP" not in cmd.text
    cmd.proc.send_signal(signal.SIGTERM)
    assert cmd.wait(STOP_DEADLINE_SECONDS + 5) == 143, cmd.text


def test_sigkill_of_run_leaves_no_process_behind(slow_model: str, tmp_path: Path) -> None:
    """Children are tied to the command (PR_SET_PDEATHSIG): they go even when it is SIGKILLed."""
    cmd, url, ids = start_run(tmp_path, slow_model)
    wait_for_sub_calls_in_flight(url)
    children = cmd.children()
    assert any("redis-server" in " ".join(c.cmdline()) for c in children)
    cmd.proc.kill()
    cmd.wait(5)
    t0 = time.monotonic()
    assert_all_gone(children, STOP_DEADLINE_SECONDS, cmd.text)
    print(f"\nSIGKILL: every child gone {time.monotonic() - t0:.2f} s after the command died")


def test_interrupted_rollouts_are_not_shown_live(slow_model: str, redis_url: str, tmp_path: Path) -> None:
    """`rlmq status` must not list an interrupted run's rollouts as live (they used to stay an hour)."""
    model = f"sig-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=redis_url, model=model, base_url=slow_model, workers=1):
        write_dataset(tmp_path / "ds.jsonl", 4)
        cmd = Command("run", "ds.jsonl", "--base-url", slow_model, "--model", model, "--redis-url", redis_url,
                      "--run-dir", "run", "--quiet", cwd=tmp_path)  # fmt: skip
        wait_for_sub_calls_in_flight(redis_url)
        client = redis.Redis.from_url(redis_url)
        live = [m.decode() for m in client.zrange(K.LIVE_ROLLOUTS, 0, -1)]
        ours = [rid for rid in live if (client.hget(K.RolloutKeys(rid).info, "model") or b"").decode() == model]
        assert ours, "the run's rollouts are listed while they run"
        cmd.proc.send_signal(signal.SIGTERM)
        assert cmd.wait(STOP_DEADLINE_SECONDS + 5) == 143, cmd.text
        still = set(m.decode() for m in client.zrange(K.LIVE_ROLLOUTS, 0, -1)) & set(ours)
        client.close()
    assert not still, f"interrupted rollouts still listed as live: {still}"
    status = subprocess.run(
        rlmq_command("status", "--redis-url", redis_url, "--json"), env=child_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert not [r for r in json.loads(status.stdout)["rollouts"] if r["model"] == model]


def test_output_follows_dataset_order(tmp_path: Path) -> None:
    """The first row is made the slowest ([[mock:sleep]]), so it finishes last; --output still
    lists it first."""
    ids = write_dataset(tmp_path / "ds.jsonl", 4, slow_first=3.0)
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        cmd = Command("run", "ds.jsonl", "--base-url", base, "--model", "scripted", "--output", "rows.jsonl",
                      "--run-dir", "run", "--quiet", "--concurrency", "4", cwd=tmp_path)  # fmt: skip
        assert cmd.wait(180) == 0, cmd.text
    finally:
        group.stop()
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ids
    first_took = rows[0]["metrics"]["repl_total_time_seconds"]
    assert all(first_took > r["metrics"]["repl_total_time_seconds"] for r in rows[1:]), "row 0 was not the slowest"


# ---------------------------------------------------------------------------- rlmq worker


async def _batch_in_flight(redis_url: str, model: str, n: int) -> tuple[asyncio.Task[object], object]:
    client = async_client(redis_url)
    spec = BatchSpec(
        rollout_id=f"w-{uuid.uuid4().hex[:6]}",
        batch_id="b1",
        queue=K.queue_name_for_model(model),
        sub_call_timeout=120,
        parallelism=n,
        call=SubCallOptions(model=model),
    )
    task = asyncio.create_task(Dispatcher(client).run_batch(spec, [f"Prompt {i}." for i in range(n)]))
    return task, client


def start_worker(
    redis_url: str, base_url: str, model: str, tmp_path: Path, *extra: str, ignore: tuple[signal.Signals, ...] = ()
) -> Command:
    return Command(
        "worker", "--base-url", base_url, "--model", model, "--redis-url", redis_url, *extra, cwd=tmp_path,
        ignore=ignore,
    )  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
async def test_worker_drains_on_a_signal_then_exits_0(
    sig: signal.Signals, slow_model: str, redis_url: str, tmp_path: Path
) -> None:
    model = f"wsig-{uuid.uuid4().hex[:6]}"
    cmd = start_worker(redis_url, slow_model, model, tmp_path)
    LocalFleet(redis_url=redis_url, model=model, workers=0).wait_for_workers(1)
    task, client = await _batch_in_flight(redis_url, model, 5)
    await asyncio.to_thread(wait_for_sub_calls_in_flight, redis_url)
    t0 = time.monotonic()
    cmd.proc.send_signal(sig)
    rc = await asyncio.to_thread(cmd.wait, 40)
    took = time.monotonic() - t0
    results = await asyncio.wait_for(task, 60)
    await client.aclose()  # type: ignore[attr-defined]
    assert rc == 0, cmd.text
    assert "waiting up to 30 s for" in cmd.text
    assert all(r.status == "ok" for r in results), [r.content for r in results]  # drained, not dropped
    assert took < 30, f"the in-flight calls take {LATENCY} s; the worker took {took:.1f} s"


async def test_second_signal_hands_back_at_once(slow_model: str, redis_url: str, tmp_path: Path) -> None:
    model = f"wsig2-{uuid.uuid4().hex[:6]}"
    cmd = start_worker(redis_url, slow_model, model, tmp_path, "--grace", "60")
    LocalFleet(redis_url=redis_url, model=model, workers=0).wait_for_workers(1)
    task, client = await _batch_in_flight(redis_url, model, 5)
    await asyncio.to_thread(wait_for_sub_calls_in_flight, redis_url)
    t0 = time.monotonic()
    cmd.proc.send_signal(signal.SIGINT)
    await asyncio.to_thread(cmd.wait_for_line, "waiting up to 60 s for", 10)
    cmd.proc.send_signal(signal.SIGINT)
    rc = await asyncio.to_thread(cmd.wait, 30)
    took = time.monotonic() - t0
    task.cancel()
    await client.aclose()  # type: ignore[attr-defined]
    assert rc == 0, cmd.text
    assert "handing back in-flight sub-calls now" in cmd.text
    assert "handed back" in cmd.text
    assert took < LATENCY + 5, f"took {took:.1f} s with --grace 60"


def test_a_nohup_worker_ignores_sighup(slow_model: str, redis_url: str, tmp_path: Path) -> None:
    model = f"nohup-{uuid.uuid4().hex[:6]}"
    cmd = start_worker(redis_url, slow_model, model, tmp_path, ignore=(signal.SIGHUP,))
    LocalFleet(redis_url=redis_url, model=model, workers=0).wait_for_workers(1)
    cmd.proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        cmd.proc.wait(timeout=2)  # still serving
    cmd.proc.send_signal(signal.SIGTERM)
    assert cmd.wait(40) == 0, cmd.text


def test_worker_started_before_redis_waits_for_it(tmp_path: Path) -> None:
    from rlmq.common.redis_server import EmbeddedRedis, _free_port

    port = _free_port()
    model = f"early-{uuid.uuid4().hex[:6]}"
    cmd = start_worker(f"redis://127.0.0.1:{port}/0", "http://127.0.0.1:9/v1", model, tmp_path)
    line = cmd.wait_for_line("retrying in", timeout=30)
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in line
    with EmbeddedRedis(port=port) as server:
        LocalFleet(redis_url=server.url, model=model, workers=0).wait_for_workers(1, timeout=60)
        # registered is not yet serving: a SIGTERM in between is a stop during start-up (143);
        # the drain that exits 0 is the serving worker's
        cmd.wait_for_line("serving queue", timeout=60)
        cmd.proc.send_signal(signal.SIGTERM)
        assert cmd.wait(30) == 0, cmd.text


STUCK = """
import sys, time
from rlmq.cli.local import ProcessGroup
from rlmq.common.aio import signal_latch

with signal_latch(deadline=1.0):
    group = ProcessGroup()
    group.spawn(["sleep", "300"], "sleeper")
    try:
        print("ready", group.procs[0].pid, flush=True)
        time.sleep(300)
    except KeyboardInterrupt:
        while True:  # a stop that never finishes (a hung finalizer, a library that ignores the cancel)
            time.sleep(0.1)
"""


def test_the_watchdog_ends_a_stop_that_hangs(tmp_path: Path) -> None:
    """However the orderly stop goes, the deadline holds: the latch's watchdog kills the
    registered children and exits 128 + signal."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=as_from_a_terminal(),
    )  # fmt: skip
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready", proc.stderr.read() if proc.stderr else ""
    sleeper = psutil.Process(int(ready[1]))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 143, err
    assert 0.9 < took < 10, took
    assert "still stopping after 1 s; killing what is left" in err
    assert_all_gone([sleeper], 2.0, err)
