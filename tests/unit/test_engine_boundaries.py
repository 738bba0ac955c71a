"""The rollout engine's boundaries: a worker may import it, it never imports the worker side,
the environment (``RLMEnv``) or the CLI, and it reads no ``Settings`` and no environment variable."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import rlmq.producer

ENGINE_MODULES = (
    "engine", "root_loop", "root", "budget", "live", "llm_batch", "rollout", "scaffold", "dispatch", "root_tools",
)  # fmt: skip
"""The modules of the engine itself (the REPL sandbox under ``producer/repl`` is its own piece)."""


def test_importing_the_engine_loads_no_worker_environment_or_cli_module() -> None:
    code = "import sys, rlmq.producer.engine; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "rlmq.producer.engine" in loaded
    assert [m for m in loaded if m.startswith(("rlmq.workers", "rlmq.producer.env", "rlmq.cli"))] == []


def test_the_engine_modules_read_no_settings_and_no_environment() -> None:
    folder = Path(rlmq.producer.__file__).parent
    for name in ENGINE_MODULES:
        tree = ast.parse((folder / f"{name}.py").read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & {"Settings", "load_settings", "environ", "getenv", "WorkerOptions"}, name
