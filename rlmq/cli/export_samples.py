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
     "token_ids": [...], "loss_mask": [0 | 1, ...], "logprobs": [...], "reward", "sampling",
     "sampled_with", "weight_versions"}

``loss_mask`` is 1 on sampled (completion) tokens only; ``logprobs`` holds the served logprob on
those positions and 0.0 on prompt positions; ``reward`` is 1.0 / 0.0 from the row's ``correct``
(``None`` without an answer). This is the plain form trainers outside verifiers (verl,
OpenRLHF, TRL) read. Only slots that answered (``status == "ok"``) give samples: a rejected,
failed or abandoned slot carries no tokens.

``sampled_with`` is the ``temperature`` and ``top_p`` its tokens were sampled at, with their source
(:func:`rlmq.common.token_servers.sampled_with`); a turn sampled at others starts another part, so
one sample is sampled at one temperature. ``weight_versions`` (runs made with ``--weight-versions``
against a server that answers them) are the spans ``{"version", "start", "end"}`` over the sample's
positions, each completion token under the weights that sampled it; ``None`` when a turn of it has
none. The staleness filters (:class:`Staleness`) keep only samples of one weight version, or at
most ``k`` versions older than the newest; a sample whose versions are unknown is dropped by them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmq.common.errors import ConfigError

__all__ = ["Staleness", "branch_samples", "export_samples", "version_number"]


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
        if part and (prompt[: len(seen)] != seen or t.get("sampled_with") != part[0].get("sampled_with")):
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
    versions: list[dict[str, Any]] | None = []
    for t in part:
        new = t["prompt_token_ids"][len(ids) :]
        ids += new
        spans = t.get("weight_versions")
        if versions is not None and isinstance(spans, list):  # a turn's spans, moved to the sample's positions
            versions += [{**sp, "start": sp["start"] + len(ids), "end": sp["end"] + len(ids)} for sp in spans]
        else:
            versions = None
        ids += t["completion_token_ids"]
        mask += [0] * len(new) + [1] * len(t["completion_token_ids"])
        logprobs += [0.0] * len(new) + t["completion_logprobs"]
    return {
        "turns": len(part),
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "sampling": part[0]["sampling"],
        "sampled_with": part[0].get("sampled_with"),
        "weight_versions": versions,
    }


def version_number(label: str) -> int | None:
    """The order of a weight-version label: its trailing number (``step-42`` -> 42, ``7`` -> 7), as
    labels a trainer gives per step are written; ``None`` when it ends in no number."""
    match = re.search(r"(\d+)$", label)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Staleness:
    """Which samples :func:`export_samples` keeps by the weights that sampled them.

    Attributes:
        version: keep only samples whose every completion token was sampled by this label.
        max_lag: keep only samples whose oldest version is at most this many versions older than
            ``current`` (by :func:`version_number`; a label without a number is not kept).
        current: the newest version (default: the newest label of the run's samples).
    """

    version: str | None = None
    max_lag: int | None = None
    current: str | None = None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, count: Callable[[str], int]) -> None:
        """The flags of ``rlmq export-samples`` that build one (``count``: the parser of ``--max-version-lag``)."""
        parser.add_argument(
            "--weight-version", metavar="LABEL", help="keep only samples sampled wholly by this weight version"
        )
        parser.add_argument(
            "--max-version-lag", type=count, metavar="K",
            help="keep only samples at most K weight versions older than the current one (labels ordered by their "
            "trailing number); a sample without versions is dropped",
        )  # fmt: skip
        parser.add_argument(
            "--current-version", metavar="LABEL", help="the current weight version (default: the newest in the run)"
        )

    @property
    def active(self) -> bool:
        """Whether any filter is set."""
        return self.version is not None or self.max_lag is not None

    def keeps(self, sample: dict[str, Any], newest: int | None) -> bool:
        """Whether ``sample`` passes; ``newest``: the number of the current version."""
        spans = sample.get("weight_versions")
        if not self.active:
            return True
        if not isinstance(spans, list):
            return False  # no versions recorded: its staleness is unknown
        labels = {sp["version"] for sp in spans}
        if self.version is not None and labels - {self.version}:
            return False
        if self.max_lag is not None:
            numbers = [version_number(label) for label in labels]
            if newest is None or any(n is None or newest - n > self.max_lag for n in numbers):
                return False
        return True


def _newest(samples: list[dict[str, Any]], staleness: Staleness) -> int | None:
    if staleness.current is not None:
        return version_number(staleness.current)
    numbers = [version_number(sp["version"]) for s in samples for sp in s.get("weight_versions") or []]
    known = [n for n in numbers if n is not None]
    return max(known) if known else None


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


def _no_sample(folder: Path, turns: int) -> ConfigError:
    """Why a run folder gave no sample at all (``turns``: its turns that carry token ids)."""
    if turns == 0:
        return ConfigError(
            f"{folder}: no sample: its trajectories carry no token ids (the run was made without "
            "--include-sub-llm-in-trajectory); run it again with that flag"
        )
    return ConfigError(
        f"{folder}: no sample: none of the {turns} turn(s) with token ids was trainable (see "
        "untrainable_turns_<reason> in rows.jsonl: a server that returns no token ids, or a frozen fleet)"
    )


def export_samples(
    run_dir: str | Path, output: str | Path | None = None, staleness: Staleness | None = None
) -> tuple[Path, int, int]:
    """Write ``samples.jsonl`` (or ``output``) from the run folder ``run_dir``, the samples that
    ``staleness`` keeps (default: all); returns (path, samples written, samples it dropped).

    Raises:
        ConfigError: the folder has no ``trajectories.jsonl`` or ``rows.jsonl``, a line is not JSON,
            or ``staleness.current`` is a label without a number; or the run gave no sample at all
            (made without ``--include-sub-llm-in-trajectory``, or no turn was trainable): the line
            says which, and no file is written.
    """
    staleness = staleness or Staleness()
    if staleness.max_lag is not None and staleness.current is not None and version_number(staleness.current) is None:
        raise ConfigError(f"--current-version {staleness.current!r}: a weight-version label ending in a number")
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
    samples: list[dict[str, Any]] = []
    turns = 0
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
            samples.append({"id": key[0], "rollout": key[1], "reward": rewards.get(key), **sample})
    if not samples:
        raise _no_sample(folder, turns)
    newest = _newest(samples, staleness)
    kept = [s for s in samples if staleness.keeps(s, newest)]
    with open(out, "w", encoding="utf-8") as fh:
        for sample in kept:
            fh.write(json.dumps(sample) + "\n")
    return out, len(kept), len(samples) - len(kept)
