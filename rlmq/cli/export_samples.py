"""``rlmq export-samples RUN_DIR``: one training sample per branch of every rollout tree of a run.

A run made with ``include_sub_llm_in_trajectory`` holds every model turn's served ids and
logprobs in ``trajectories.jsonl`` (:func:`rlmq.common.token_wire.expand_trajectory`). A
*branch* is one conversation of the tree: the root turns of one rollout (the top rollout or a
child at any depth), or the turns of one sub-call. Its turns become one sample while each turn's
prompt continues the previous turn's prompt and completion; a turn that does not (a chat
template that re-renders the history), or an untrainable turn, ends the sample and the next
trainable turn starts another (``part``).

A sample (one JSON line of ``samples.jsonl``)::

    {"id", "rollout", "branch", "part", "depth", "kind": "root" | "sub", "turns",
     "token_ids": [...], "loss_mask": [0 | 1, ...], "logprobs": [...], "reward", "sampling"}

``loss_mask`` is 1 on sampled (completion) tokens only; ``logprobs`` holds the served logprob on
those positions and 0.0 on prompt positions; ``reward`` is 1.0 / 0.0 from the row's ``correct``
(``None`` without an answer). This is the plain form trainers outside verifiers (verl,
OpenRLHF, TRL) read. Only slots that answered (``status == "ok"``) give samples: a rejected,
failed or abandoned slot carries no tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlmq.common.errors import ConfigError

__all__ = ["branch_samples", "export_samples"]


def _dicts(items: Any) -> Iterator[dict[str, Any]]:
    if isinstance(items, list):
        yield from (i for i in items if isinstance(i, dict))


def _chain(turns: list[dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """The turns of one branch cut into parts whose prompts continue each other (untrainable turns dropped)."""
    part: list[dict[str, Any]] = []
    seen: list[int] = []
    n = 0
    for t in turns:
        if not t.get("trainable"):
            if part:
                yield n, part
                n += 1
            part, seen = [], []
            continue
        prompt = t["prompt_token_ids"]
        if part and prompt[: len(seen)] != seen:
            yield n, part
            n += 1
            part = []
        part.append(t)
        seen = prompt + t["completion_token_ids"]
    if part:
        yield n, part


def _sample(part: list[dict[str, Any]]) -> dict[str, Any]:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for t in part:
        new = t["prompt_token_ids"][len(ids) :]
        ids += new + t["completion_token_ids"]
        mask += [0] * len(new) + [1] * len(t["completion_token_ids"])
        logprobs += [0.0] * len(new) + t["completion_logprobs"]
    return {
        "turns": len(part),
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "sampling": part[0]["sampling"],
    }


def branch_samples(trajectory: list[dict[str, Any]], *, depth: int = 1, path: str = "") -> Iterator[dict[str, Any]]:
    """The samples of one rollout's trajectory (an expanded one) and of its children's, with
    ``branch`` (``root``, ``b1/0``, ``r1/2/root``, ...), ``part``, ``depth`` and ``kind``."""
    roots = [e for e in _dicts(trajectory) if e.get("type") == "root" and "trainable" in e]
    for n, part in _chain(roots):
        yield {"branch": f"{path}root", "part": n, "depth": depth, "kind": "root", **_sample(part)}
    for ev in _dicts(trajectory):
        if ev.get("type") not in ("llm_batch", "rlm_batch"):
            continue
        for i, res in enumerate(_dicts(ev.get("results"))):
            if res.get("status") != "ok":
                continue
            where = f"{path}{ev.get('batch_id', '?')}/{res.get('index', i)}"
            for n, part in _chain(list(_dicts(res.get("steps")))):
                yield {"branch": where, "part": n, "depth": depth, "kind": "sub", **_sample(part)}
            child = res.get("child")
            if isinstance(child, dict):
                yield from branch_samples(list(_dicts(child.get("trajectory"))), depth=depth + 1, path=f"{where}/")


def _token_turns(trajectory: list[dict[str, Any]]) -> int:
    """Turns of a trajectory (children's included) that carry served tokens, trainable or not."""
    count = sum(1 for e in trajectory if e.get("type") == "root" and "trainable" in e)
    for ev in trajectory:
        for res in _dicts(ev.get("results")) if ev.get("type") in ("llm_batch", "rlm_batch") else ():
            count += sum(1 for step in _dicts(res.get("steps")) if "trainable" in step)
            child = res.get("child")
            if isinstance(child, dict):
                count += _token_turns(list(_dicts(child.get("trajectory"))))
    return count


def export_samples(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, int]:
    """Write ``samples.jsonl`` (or ``output``) from the run folder ``run_dir``; returns (path, samples).

    Raises:
        ConfigError: the folder has no ``trajectories.jsonl`` or ``rows.jsonl``, or a line is not
            JSON; or no sample came out (the run was made without ``--include-sub-llm-in-trajectory``,
            or no turn was trainable): the line says which, and no file is left.
    """
    folder = Path(run_dir)
    rewards: dict[tuple[str, int], float | None] = {}
    try:
        for line in (folder / "rows.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                correct = row.get("correct")
                rewards[(row["id"], row.get("rollout") or 0)] = None if correct is None else float(bool(correct))
        lines = (folder / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{folder} is not a run folder: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{folder}/rows.jsonl: not result rows ({exc})") from exc
    out = Path(output) if output is not None else folder / "samples.jsonl"
    count = turns = 0
    part = out.with_name(out.name + ".part")  # renamed to ``out`` once there is a sample: never an empty file
    try:
        with open(part, "w", encoding="utf-8") as fh:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{folder}/trajectories.jsonl:{lineno}: not JSON ({exc})") from exc
                key = (record.get("id"), record.get("rollout") or 0)
                turns += _token_turns(list(_dicts(record.get("trajectory"))))
                for sample in branch_samples(list(_dicts(record.get("trajectory")))):
                    meta = {"id": key[0], "rollout": key[1], "reward": rewards.get(key)}
                    fh.write(json.dumps({**meta, **sample}) + "\n")
                    count += 1
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if count == 0:
        part.unlink()
        if turns == 0:
            raise ConfigError(
                f"{folder}: no sample: its trajectories carry no token ids (the run was made without "
                "--include-sub-llm-in-trajectory); run it again with that flag"
            )
        raise ConfigError(
            f"{folder}: no sample: none of the {turns} turn(s) with token ids was trainable (see "
            "untrainable_turns_<reason> in rows.jsonl: a server that returns no token ids, or a frozen fleet)"
        )
    part.replace(out)
    return out, count
