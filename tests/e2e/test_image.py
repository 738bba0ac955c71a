"""The image builds from the repository as it is, shown without a Docker engine: the files the
Dockerfile's ``COPY`` lines name, and only those, installed into a fresh venv, give a working
``rlmq``. And compose's documented commands set what ``compose.yaml`` requires."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlmq.cli.local import child_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def copied_paths() -> list[str]:
    """The repository paths of the Dockerfile's ``COPY`` lines (sources only, not the destination)."""
    paths: list[str] = []
    for line in (REPO / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if line.startswith("COPY "):
            words = line.split()[1:]
            assert not any(w.startswith("--") for w in words), f"a COPY flag this test does not read: {line}"
            paths += words[:-1]
    return paths


def test_the_dockerfiles_files_install_a_working_rlmq(tmp_path: Path) -> None:
    context = tmp_path / "app"
    context.mkdir()
    for rel in copied_paths():
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, context / rel, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, context / rel)
    venv = tmp_path / "venv"
    # the test venv's packages stand in for the image's pip downloads: only rlmq itself is built here
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(context)],
        capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    rlmq = venv / "bin" / "rlmq"
    done = subprocess.run([str(rlmq), "--help"], capture_output=True, text=True, timeout=120, env=child_env(),
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "usage: rlmq" in done.stdout, done.stderr[-3000:]
    where = subprocess.run([str(python), "-c", "import rlmq.producer.repl_child as c; print(c.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, check=True)  # fmt: skip
    assert where.stdout.startswith(str(site)), where.stdout  # the installed copy, not the checkout


COMPOSE_UP = re.compile(r"^\s*#?\s*(docker compose up[^\n]*)$", re.MULTILINE)


def test_compose_commands_set_what_compose_yaml_requires() -> None:
    compose = (REPO / "compose.yaml").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    required = sorted(set(re.findall(r"\$\{([A-Z_]+):\?", compose)))
    assert required, "compose.yaml requires no variable any more: update this test"
    header = compose.split("\nx-rlmq-image", 1)[0]
    ups = {m.strip() for m in COMPOSE_UP.findall(header)} | {m.strip() for m in COMPOSE_UP.findall(readme)}
    assert len({u for u in ups if "--profile" not in u}) == 1, f"README and compose.yaml differ: {sorted(ups)}"
    for text in (header, readme):
        start = text.index("docker compose up")
        before = text[max(0, start - 400) : start]
        for var in required:
            assert f"export {var}=" in before or f" {var}=" in before, f"{var} is not set before: {text[start:][:80]}"


def test_what_runs_leave_in_the_checkout_is_ignored_by_git() -> None:
    """vf-eval's ``outputs/``, a Redis snapshot started in the checkout, run folders and rows."""
    paths = ["outputs/evals/x.jsonl", "dump.rdb", "runs/20261122T072512Z-demo/rows.jsonl", "rows.jsonl"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert sorted(done.stdout.split()) == sorted(paths), done.stdout + done.stderr
