"""``bench/real_vllm.py`` without a GPU, and its comparison of trajectories with a proxy's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.real_vllm import compare

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi on it
    out = subprocess.run([sys.executable, "-m", "bench.real_vllm"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    line = "bench.real_vllm: no GPU on this machine (nvidia-smi absent or lists none): nothing run"
    assert out.stdout.splitlines() == [line]
    assert not (tmp_path / "real_vllm.json").exists()


def reply(prompt: list[int], completion: list[int], logprobs: list[float], status: int = 200) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "token_ids": completion,
              "logprobs": {"content": [{"token": "t", "logprob": v} for v in logprobs]}}  # fmt: skip
    return {"request": {}, "status": status, "reply": {"prompt_token_ids": prompt, "choices": [choice]}}


def turn(prompt: list[int], completion: list[int], logprobs: list[float]) -> dict[str, Any]:
    return {"turn": 1, "trainable": True, "prompt_token_ids": prompt, "completion_token_ids": completion,
            "completion_logprobs": logprobs, "sampling": {}}  # fmt: skip


def write(tmp_path: Path, served: list[dict[str, Any]], trajectory: list[dict[str, Any]]) -> tuple[Path, Path]:
    log, traj = tmp_path / "proxy.jsonl", tmp_path / "trajectories.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in served))
    traj.write_text(json.dumps({"id": "q", "trajectory": trajectory}) + "\n")
    return traj, log


def tree(root: dict[str, Any], sub: dict[str, Any], child_root: dict[str, Any]) -> list[dict[str, Any]]:
    child = {"trajectory": [{"type": "root", **child_root}]}
    return [
        {"type": "root", **root},
        {"type": "llm_batch", "results": [{"status": "ok", "steps": [sub]}]},
        {"type": "rlm_batch", "results": [{"status": "ok", "child": child}]},
    ]


def test_every_turn_is_compared_with_what_was_served_element_by_element(tmp_path: Path) -> None:
    a, b, c = ([1, 2], [3, 4], [-0.5, -0.25]), ([5], [6], [-1.5]), ([7, 8, 9], [10], [-0.125])
    served = [reply(*a), reply(*b), reply(*c), {"request": {}, "status": 503, "reply": "busy"}]
    good = compare(*write(tmp_path, served, tree(turn(*a), turn(*b), turn(*c))))
    assert good.ok and (good.served, good.turns, good.matched) == (3, 3, 3)
    assert good.roles == {"root@1": 1, "sub@1": 1, "root@2": 1} and good.elements == (2 + 1 + 3) + 2 * (2 + 1 + 1)

    off = compare(*write(tmp_path, served, tree(turn(*a), turn(*b), turn(c[0], c[1], [-0.12500001]))))
    assert not off.ok and off.logprob_mismatches == 1 and "root@2" in off.problems[0]
    lost = compare(*write(tmp_path, served, tree(turn(*a), turn(*b), {"trainable": False, "untrainable_reason": "x"})))
    assert not lost.ok and lost.not_kept == 1 and lost.untrainable == {"x": 1}
    forged = compare(*write(tmp_path, served, tree(turn(*a), turn(*b), turn([7, 8], c[1], c[2]))))
    assert not forged.ok and forged.not_served == 1
    twice = compare(*write(tmp_path, served, [*tree(turn(*a), turn(*b), turn(*c)), {"type": "root", **turn(*a)}]))
    assert not twice.ok and twice.twice == 1
