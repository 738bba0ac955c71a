"""``bench.prime_rl_samples``'s loader, on a small git repository laid out as prime-rl is (no prime-rl
code: a stand-in builder written here), and its one line when no prime-rl source is given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import verifiers.v1 as vf

from bench.prime_rl_samples import api_check, load_builder, no_images

ROOT = Path(__file__).resolve().parents[2]

BUILDER = """
from prime_rl.transport import TrainingSample
from prime_rl.utils.logger import get_logger


def trace_to_samples(trace):
    get_logger().info("building")
    return [TrainingSample(token_ids=branch.token_ids, images=branch.multi_modal_data) for branch in trace.branches]
"""
TYPES = """
from dataclasses import dataclass


@dataclass
class TrainingSample:
    token_ids: list
    images: object = None
"""


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "prime-rl"
    (root / "src/prime_rl/orchestrator").mkdir(parents=True)
    (root / "src/prime_rl/transport").mkdir(parents=True)
    (root / "src/prime_rl/orchestrator/trajectories.py").write_text(BUILDER)
    (root / "src/prime_rl/transport/types.py").write_text(TYPES)
    (root / "src/prime_rl/transport/__init__.py").write_text("import a_heavy_module_the_loader_never_reads\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "stand-in builder")
    return root


def test_the_builder_is_imported_from_the_commit_with_stand_ins_for_what_it_does_not_need(repo: Path) -> None:
    module, source, info = load_builder(str(repo), "HEAD")
    assert info["commit"] == git(repo, "rev-parse", "HEAD") and info["subject"] == "stand-in builder"
    assert info["read"] == ["src/prime_rl/orchestrator/trajectories.py", "src/prime_rl/transport/types.py"]
    assert info["stubbed"] == ["prime_rl.transport", "prime_rl.utils.logger"]
    api = api_check(source)
    assert api["read"]["branch"] == ["multi_modal_data", "token_ids"] and api["read"]["trace"] == ["branches"]
    assert api["missing"] == {"branch": ["multi_modal_data"]}  # verifiers 0.4.0 has no such attribute
    with no_images(api["missing"]) as made:
        assert made == ["Branch.multi_modal_data = None"]
        branch = vf.Branch(index=0, nodes=[])

        class Trace:
            branches = [branch]

        (sample,) = module.trace_to_samples(Trace())
        assert sample.token_ids == [] and sample.images is None
    assert not hasattr(vf.Branch, "multi_modal_data")


def test_a_missing_commit_is_one_line(repo: Path) -> None:
    with pytest.raises(SystemExit, match="^git rev-parse"):
        load_builder(str(repo), "0" * 40)


def test_without_prime_rl_source_it_prints_one_line_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.prime_rl_samples"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr == ""
    assert done.stdout.splitlines() == [
        "prime-rl's source is not given: pass --prime-rl /path/to/prime-rl (a git clone or bare mirror)"
    ]


def test_without_msgspec_it_says_so_in_one_line_and_exits_2(repo: Path) -> None:
    code = ("import runpy, sys; sys.modules['msgspec'] = None; "
            f"sys.argv = ['prime_rl_samples', '--prime-rl', {str(repo)!r}]; "
            "runpy.run_module('bench.prime_rl_samples', run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == "", done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "prime-rl's TrainingSample needs msgspec, which is not installed here: pip install msgspec"
    ]


def test_it_never_writes_over_a_kept_file(repo: Path, tmp_path: Path) -> None:
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    code = ("import runpy, sys, types; sys.modules['msgspec'] = types.ModuleType('msgspec'); "
            f"sys.argv = ['prime_rl_samples', '--prime-rl', {str(repo)!r}, '--out', {str(tmp_path / 'kept')!r}]; "
            "runpy.run_module('bench.prime_rl_samples', run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exists: pass a new --out" in done.stdout, done.stdout + done.stderr[-2000:]
    assert kept.read_text() == "{}"
    source = (ROOT / "bench" / "prime_rl_samples.py").read_text()
    assert "prime_rl_samples_%Y%m%dT%H%M%SZ" in source  # the default: a new file per run
