"""A long-context needle dataset for recursive rollouts, answered by the scripted model.

``python -m bench.needle --rows R --lines L --out data.jsonl [--split K] [--seed S] [--leaf spend-all|tokens:A-B]``

Each row is ``{"id", "question", "context", "answer", "info"}`` (the JSONL shape ``rlmq run``
reads): ``context`` is ``L`` lines of filler, one of which, at a seeded position, reads
``... the secret code is <code> ...``; ``question`` asks for that code and carries the
``[[mock:rlm-split:K]]`` directive (:mod:`rlmq.scripted.recursion`), so the scripted model splits
the context into ``K`` parts at every level of the tree (``K ** max_depth`` leaf calls per
row). ``--leaf`` adds ``[[mock:spend-all]]`` or ``[[mock:tokens:A-B]]`` to the question, which
reaches every leaf (budget tests). The same ``--seed`` gives the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

SUBJECTS = ["The harbour", "A clerk", "The north gate", "Our courier", "The archive", "A ferry", "The mill"]
VERBS = ["logged", "counted", "moved", "checked", "sorted", "stamped", "weighed"]
OBJECTS = ["crates", "letters", "barrels", "ledgers", "lanterns", "sacks", "keys"]
CODE_WORDS = ["amber", "cobalt", "garnet", "hazel", "indigo", "juniper", "saffron", "thistle", "umber", "walnut"]


def question_for(parts: int, leaf: str | None = None) -> str:
    """The question of every row: asks for the secret code, with ``[[mock:rlm-split:<parts>]]``
    and, with ``leaf`` (``spend-all`` or ``tokens:A-B``), that leaf directive."""
    extra = f" [[mock:{leaf}]]" if leaf else ""
    return f"Find the needle: what is the secret code hidden in the context? [[mock:rlm-split:{parts}]]{extra}"


def filler_line(rng: random.Random, index: int) -> str:
    """One line of haystack (never mentions a secret code)."""
    return (
        f"Line {index}: {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randrange(2, 999)} "
        f"{rng.choice(OBJECTS)} on day {rng.randrange(1, 365)}."
    )


def needle_rows(
    rows: int, lines: int, *, parts: int = 4, seed: int = 0, leaf: str | None = None
) -> list[dict[str, Any]]:
    """``rows`` dataset rows of ``lines`` context lines each (``lines`` >= 1), the needle on one line.

    Raises:
        ValueError: ``rows`` < 0, ``lines`` < 1 or ``parts`` < 1.
    """
    if rows < 0 or lines < 1 or parts < 1:
        raise ValueError(f"rows >= 0, lines >= 1 and parts >= 1, not {rows}, {lines}, {parts}")
    rng = random.Random(seed)
    question = question_for(parts, leaf)
    out: list[dict[str, Any]] = []
    for i in range(rows):
        code = f"{rng.choice(CODE_WORDS)}-{rng.randrange(1000, 9999)}"
        where = rng.randrange(lines)
        text = [filler_line(rng, n) for n in range(lines)]
        text[where] = f"Line {where}: the secret code is {code} and nobody else knows it."
        out.append(
            {
                "id": f"needle-{i}",
                "question": question,
                "context": "\n".join(text),
                "answer": code,
                "info": {"needle_line": where, "lines": lines, "parts": parts},
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Write the dataset (see the module docstring); prints one summary line."""
    parser = argparse.ArgumentParser(description="a long-context needle dataset for recursive rollouts")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--lines", type=int, default=2000, help="context lines per row")
    parser.add_argument("--split", type=int, default=4, help="K of [[mock:rlm-split:K]]: parts per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--leaf", default=None, help="a leaf directive: spend-all or tokens:A-B")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    if args.leaf is not None and args.leaf != "spend-all" and not args.leaf.startswith("tokens:"):
        parser.error("--leaf is spend-all or tokens:A-B")
    try:
        rows = needle_rows(args.rows, args.lines, parts=args.split, seed=args.seed, leaf=args.leaf)
    except ValueError as exc:
        parser.error(str(exc))
    with open(args.out, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows of {args.lines} lines (split {args.split}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
