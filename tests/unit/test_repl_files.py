"""The context as files in the REPL's working directory (producer/repl/files.py), as verifiers'
RLMEnv (0.1.14) wrote it: ``info["context"]`` as ``context.txt`` (a str) or ``context.json``,
``info["context_dir"]`` copied with its symlink and size checks; the row's own ``context``
otherwise. Real child interpreters, with namespaces (this machine runs the tests as root) and
without.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlmq.common.errors import ReplStartupError
from rlmq.common.schemas import DatasetRow
from rlmq.producer.repl import Repl
from rlmq.producer.repl.files import CONTEXT_DIR_MAX_BYTES, context_files, file_name, repl_context

MiB = 1024**2
ROOT = os.geteuid() == 0


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    if request.param and not ROOT:
        pytest.fail("the namespace mode of these tests runs as root (CI's normal machine)")
    return bool(request.param)


def row(own: Any = "", /, **info: Any) -> DatasetRow:
    """A row whose ``context`` is ``own`` and whose ``info`` is the keywords."""
    return DatasetRow(id="r", question="q", context=own, info=info)


def make(r: DatasetRow, namespaces: bool, **kw: Any) -> Repl:
    return Repl(
        context=repl_context(r),
        files=context_files(r),
        endpoint_url="http://127.0.0.1:9/unused",
        token="t",
        namespaces=namespaces,
        scratch_bytes=kw.pop("scratch_bytes", 64 * MiB),
        **kw,
    )


def test_which_source_a_row_uses(tmp_path: Path) -> None:
    assert context_files(row("plain")).name == "context.txt"
    assert context_files(row("plain")).source == "row.context"
    assert context_files(row(["a"])).name == "context.json"
    assert context_files(row("x", context={"k": 1})).source == "info.context"
    assert context_files(row("x", context={"k": 1})).text == '{"k": 1}'
    assert context_files(row("x", context="ü")).text == "ü"  # a str is written as it is (UTF-8)
    assert context_files(row("x", context=["ü"])).text == '["\\u00fc"]'  # JSON: ASCII escapes, as the reference
    assert context_files(row("x", context_dir=str(tmp_path), context="y")).directory == str(tmp_path)
    assert file_name(row("x", context=[1])) == "context.json" and file_name(row("x", context_dir="/d")) is None
    # the `context` variable: the row's; info's when the row left it empty (the reference's place)
    assert repl_context(row("x", context="y")) == "x"
    assert repl_context(row("", context=[1, 2])) == [1, 2]
    with pytest.raises(ValueError, match="JSON"):
        context_files(row("x", context={"n": float("nan")}))


async def test_context_txt_and_the_variable_are_the_same_input(namespaces: bool) -> None:
    text = "line one\nü needle 4711\n" * 20_000  # ~480 KB
    async with make(row(text), namespaces) as repl:
        out = await repl.execute(
            "import os\nprint(sorted(os.listdir('.')))\n"
            "print(open('context.txt', encoding='utf-8').read() == context, os.path.getsize('context.txt'))"
        )
    assert out.output == f"['context.txt']\nTrue {len(text.encode())}\n"


async def test_context_json_from_info(namespaces: bool) -> None:
    data = {"docs": [{"id": i, "text": f"doc {i}"} for i in range(500)]}
    async with make(row("", context=data), namespaces) as repl:
        out = await repl.execute("import json\njson.load(open('context.json')) == context, len(context['docs'])")
    assert out.output == "(True, 500)\n"


async def test_context_dir_is_copied_and_the_copy_is_the_repls_own(namespaces: bool, tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.json").write_text(json.dumps({"b": 2}))
    (src / "sub" / "deeper" / "c.bin").write_bytes(os.urandom(300_000))
    (src / "secret.txt").write_text("only root reads this")
    (src / "secret.txt").chmod(0o600)
    async with make(row("ignored", context_dir=str(src), context="also ignored"), namespaces) as repl:
        out = await repl.execute(
            "import os, json\n"
            "print(sorted(os.path.relpath(os.path.join(r, n)) for r, _, ns in os.walk('.') for n in ns))\n"
            "print(open('a.txt').read(), json.load(open('sub/b.json')), os.path.getsize('sub/deeper/c.bin'))\n"
            "open('a.txt', 'a').write('+edited')\nprint(open('a.txt').read())"
        )
    assert out.output == (
        "['a.txt', 'secret.txt', 'sub/b.json', 'sub/deeper/c.bin']\nalpha {'b': 2} 300000\nalpha+edited\n"
    )
    assert (src / "a.txt").read_text() == "alpha"  # the host's folder is untouched


async def test_the_prepared_files_cannot_be_written_from_the_repl(namespaces: bool) -> None:
    async with make(row("orig"), namespaces) as repl:
        assert repl.workdir is not None
        prepared = os.path.join(repl.workdir, "files", "context.txt")
        await repl.execute(
            f"try:\n    open({prepared!r}, 'w').write('forged')\nexcept OSError as e:\n    print(type(e).__name__)"
        )
        assert Path(prepared).read_text() == "orig"


async def test_a_restarted_repl_finds_the_files_again(namespaces: bool) -> None:
    async with make(row("the input"), namespaces, code_execution_timeout=1) as repl:
        await repl.execute("import os\nos.remove('context.txt')")
        died = await repl.execute("import time\ntime.sleep(30)")
        assert died.restarted
        out = await repl.execute("print(open('context.txt').read())")
    assert out.output == "the input\n"


@pytest.mark.parametrize("where", ["top", "inside"])
async def test_a_context_dir_with_a_symlink_is_refused(tmp_path: Path, where: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.txt").write_text("a")
    if where == "top":
        src = tmp_path / "link"
        src.symlink_to(real)
        why = "context_dir cannot be a symlink"
    else:
        src = real
        (real / "passwd").symlink_to("/etc/passwd")
        why = "contains a symlink"
    with pytest.raises(ReplStartupError, match=why):
        async with make(row("", context_dir=str(src)), True):
            pass


async def test_a_context_dir_that_is_no_folder_or_too_large_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ReplStartupError, match="must be a directory"):
        async with make(row("", context_dir=str(tmp_path / "missing")), True):
            pass
    (tmp_path / "big").write_bytes(b"x" * (3 * MiB))
    with pytest.raises(ReplStartupError, match="exceeds the size limit: 3145728 bytes"):
        async with make(row("", context_dir=str(tmp_path)), True, scratch_bytes=2 * MiB):
            pass
    with pytest.raises(ReplStartupError, match="context.txt is 3145728 bytes"):
        async with make(row("x" * 3 * MiB), True, scratch_bytes=2 * MiB):
            pass
    many = tmp_path / "many"
    many.mkdir()
    for i in range(1000):
        (many / str(i)).touch()
    with pytest.raises(ReplStartupError, match="more than 960 files and folders"):
        async with make(row("", context_dir=str(many)), True, scratch_bytes=2 * MiB):
            pass
    assert CONTEXT_DIR_MAX_BYTES == 1_000_000_000  # the reference's bound, under the scratch space's


async def test_a_working_directory_swapped_for_a_link_is_not_followed_when_kept() -> None:
    async with make(row("input"), True) as repl:
        kept = await repl.retain_files()
        assert kept is not None and sorted(os.listdir(kept)) == ["context.txt"]
        await repl.execute(
            "import os, shutil\nos.chdir('/tmp')\nshutil.rmtree('/tmp/home')\nos.symlink('/etc', '/tmp/home')"
        )
        swapped = await repl.retain_files()
    assert swapped is not None and os.listdir(swapped) == []  # not the host's /etc
    for folder in (kept, swapped):
        shutil.rmtree(folder)
