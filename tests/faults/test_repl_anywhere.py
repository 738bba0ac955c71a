"""The REPL works wherever rlmq and its Python are installed, ``/tmp`` included, and a bash REPL
whose commands cannot start never lets its rollout end as if they had run.

The sandbox covers ``/tmp``, ``/run``, ``/var/tmp`` and ``/dev/shm`` with a tmpfs of its own; a
checkout, a venv or a Python installed there vanished inside it, and every ``llm_batch`` of a bash
cell failed with "can't open file" while the rollout still ended ``answer_ready``. Here, for real:
the child's programs copied under ``/tmp``, a Python whose prefix is under ``/tmp``, a whole
checkout and venv under ``/tmp`` running ``rlmq run --repl-language bash``; and commands made
unable to start, at the REPL's start and inside a cell.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.local import ProcessGroup, child_env, start_mock_llm
from rlmq.common.errors import ReplStartupError
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl
from rlmq.producer.repl import session as repl_session
from rlmq.producer.repl.launch import child_interpreter
from rlmq.scripted.server import root_code_directive

ROOT = os.geteuid() == 0
MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]
PROGRAMS = "repl_child"


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if not ROOT:
        pytest.fail("these tests contain the REPL in namespaces of its own: they run as root (CI's normal machine)")


@pytest.fixture
async def icpt() -> AsyncIterator[InterceptionServer]:
    server = InterceptionServer(max_batch_bytes=4 * MiB)
    await server.start()
    yield server
    await server.stop()


def make_repl(icpt: InterceptionServer, language: str, **kw: Any) -> Repl:
    """A REPL whose ``llm_batch`` answers each prompt upper-cased."""
    holder: list[Repl] = []

    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        async with holder[0].serving():
            return [p.upper() for p in prompts], f"[{len(prompts)} ok]"

    token = icpt.register(handle)
    repl = Repl(context="hay", endpoint_url=icpt.url, unix_socket=icpt.unix_path_of(token), token=token,
                language=language, code_execution_timeout=60, max_startup_wait_seconds=120, memory_bytes=512 * MiB,
                max_processes=32, scratch_bytes=64 * MiB, **kw)  # fmt: skip
    holder.append(repl)
    return repl


PY_CELL = 'import fractions, decimal\nanswer["content"] = str(llm_batch(["a", "b"])) + str(fractions.Fraction(1, 2))'
BASH_CELL = 'export ANSWER_CONTENT="$(llm_batch a b 2>/dev/null)"'
EXPECTED = {"python": "['A', 'B']1/2", "bash": '["A", "B"]'}


def programs_under(folder: Path) -> str:
    """The child's programs (its package) copied into ``folder`` (under ``/tmp``); the path of its ``__main__.py``."""
    folder.mkdir(parents=True)
    shutil.copytree(REPO / "producer" / PROGRAMS, folder / PROGRAMS, ignore=shutil.ignore_patterns("__pycache__"))
    return str(folder / PROGRAMS / "__main__.py")


def python_under(folder: Path) -> str:
    """A Python whose prefix is ``folder`` (under ``/tmp``): the interpreter the REPL child would
    run, copied to ``folder/bin``, its stdlib linked in as ``folder/lib/pythonX.Y``."""
    interpreter = child_interpreter("auto")
    probe = "import sys, sysconfig; print(sys.base_prefix); print(sysconfig.get_paths()['stdlib'])"
    out = subprocess.run([interpreter, "-I", "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    _prefix, stdlib = out.stdout.split()
    (folder / "bin").mkdir(parents=True)
    (folder / "lib").mkdir()
    copy = folder / "bin" / os.path.basename(os.path.realpath(interpreter))
    shutil.copy2(os.path.realpath(interpreter), copy)
    (folder / "lib" / os.path.basename(stdlib)).symlink_to(stdlib)
    out = subprocess.run([str(copy), "-I", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                         text=True, check=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == str(folder), out.stdout  # the copy's prefix really is under /tmp
    return str(copy)


@pytest.mark.parametrize("language", ["python", "bash"])
async def test_programs_and_python_under_tmp_reach_the_sandbox(
    icpt: InterceptionServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, language: str
) -> None:
    assert str(tmp_path).startswith("/tmp/")  # noqa: S108 - the folder the sandbox covers
    monkeypatch.setattr(repl_session, "_CHILD", programs_under(tmp_path / "checkout" / "producer"))
    python = python_under(tmp_path / "python")
    monkeypatch.setattr(repl_session, "child_interpreter", lambda run_as: python)
    repl = make_repl(icpt, language)
    try:
        await repl.start()
        assert repl.containment is not None and repl.containment.private_fs and repl.containment.own_uid
        cell = await repl.execute(PY_CELL if language == "python" else BASH_CELL)
        assert cell.answer_content == EXPECTED[language], cell.output
        assert cell.helper_error is None
        # what was carried in stays read-only to the REPL's uid
        probe = (
            f"import os; answer['content'] = str(os.access({python!r}, os.W_OK))"
            if language == "python"
            else f'touch {repl_session._CHILD} 2>/dev/null; export ANSWER_CONTENT="$?$(test -w {python}; echo $?)"'
        )
        cell = await repl.execute(probe)
        assert cell.answer_content in ("False", "11"), cell.output
    finally:
        await repl.close()


async def test_a_bash_repl_whose_commands_cannot_start_refuses_to_start(
    icpt: InterceptionServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without namespaces the REPL's own uid reads the host's files: programs in a folder only
    root may enter are run by the child (as root, before it drops) but not by its commands."""
    private = tmp_path / "private"
    monkeypatch.setattr(repl_session, "_CHILD", programs_under(private / "producer"))
    private.chmod(0o700)
    repl = make_repl(icpt, "bash", namespaces=False)
    try:
        with pytest.raises(ReplStartupError) as info:
            await repl.start()
    finally:
        await repl.close()
    line = str(info.value).splitlines()[0]
    assert "the bash REPL's commands (llm_batch, ...) cannot start" in line and "repl_child/__main__.py" in line, line


@pytest.mark.parametrize("broken", ["RLMQ_HELPER=/nonexistent/repl_child.py", "RLMQ_PYTHON=/nonexistent/python"])
async def test_a_command_that_cannot_start_in_a_cell_is_reported(icpt: InterceptionServer, broken: str) -> None:
    repl = make_repl(icpt, "bash")
    try:
        cell = await repl.execute(f"{broken} llm_batch a; export ANSWER_CONTENT=x ANSWER_READY=1")
        assert cell.helper_error is not None and "llm_batch could not start" in cell.helper_error, cell
        assert "llm_batch could not start" in cell.output
        ok = await repl.execute('export ANSWER_CONTENT="$(llm_batch a 2>/dev/null)"')
        assert ok.helper_error is None and ok.answer_content == '["A"]', ok.output
        failing = await repl.execute("llm_batch --json '{' ; echo $?")  # a failure of its own: exit 1
        assert failing.helper_error is None and "Error:" in failing.output, failing.output
    finally:
        await repl.close()


# --------------------------------------------------------------------------- a whole install under /tmp

NEEDLE_ROW = {
    "id": "needle",
    "question": "What is the secret password?",
    "context": " ".join(f"Line {i} is filler." for i in range(300)) + " The secret password is TANGERINE. ",
    "answer": "TANGERINE",
}
BROKEN = 'RLMQ_PYTHON=/nonexistent/python llm_batch "What is here?"; export ANSWER_CONTENT=guess ANSWER_READY=1'
BROKEN_ROW = {"id": "broken", "question": "Q " + root_code_directive(BROKEN), "context": "x", "answer": "guess"}


def install_under(root: Path) -> Path:
    """A copy of the checkout's packages and a venv under ``root``; the venv finds the copy first,
    then the test venv's dependencies (no network, no build). Returns the venv's python."""
    clone = root / "checkout"
    for name in ("rlmq", "common", "producer", "workers"):
        shutil.copytree(REPO / name, clone / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    # path lines only: the test venv's own .pth files (its editable rlmq) are not read from there
    (site / "rlmq-deps.pth").write_text(f"{clone}\n{sysconfig.get_paths()['purelib']}\n")
    return venv / "bin" / "python"


def test_rlmq_run_in_bash_from_a_checkout_and_venv_under_tmp(tmp_path: Path) -> None:
    """``rlmq run --repl-language bash`` from an install under /tmp: the needle row's sub-LLM calls
    happen and it is right; the row whose command cannot start ends ``error`` and the run exits 1."""
    python = install_under(tmp_path)
    code = "import rlmq.producer.repl_child as c; print(c.__file__)"
    where = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60, env=child_env(),
                           check=True, cwd=tmp_path)  # fmt: skip
    assert where.stdout.startswith(str(tmp_path)), where.stdout
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (NEEDLE_ROW, BROKEN_ROW)))
    run_dir = tmp_path / "run"
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        argv = [str(python), "-m", "rlmq", "run", str(data), "--base-url", base, "--model", "scripted",
                "--repl-language", "bash", "--run-dir", str(run_dir), "--quiet", "--workers", "1",
                "--max-startup-wait-seconds", "120"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=child_env(), check=False,
                              cwd=tmp_path)  # fmt: skip
    finally:
        group.stop()
    rows = {r["id"]: r for r in map(json.loads, (run_dir / "rows.jsonl").read_text().splitlines())}
    needle, broken = rows["needle"], rows["broken"]
    assert needle["stop_reason"] == "answer_ready" and needle["correct"] is True, needle
    assert needle["metrics"]["sub_llm_call_count"] >= 1, needle["metrics"]
    assert broken["stop_reason"] == "error" and broken["final_answer"] in (None, ""), broken
    assert "llm_batch could not start" in broken["error"], broken["error"]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "accuracy: 1/2" in done.stdout, done.stdout[-2000:]
