"""The root model's system message, byte for byte: every combination of the options that change its
text, against the SHA-256 of each text as ``root_system_prompt`` wrote it (``scaffold_digests.json``).

A change of wording is a change of what the model sees (and of the trajectories a trainer compares):
it regenerates the digests on purpose (``python -m tests.unit.test_scaffold_text``), never by accident.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

from rlmq.producer.scaffold import root_system_prompt

DIGESTS = Path(__file__).with_name("scaffold_digests.json")

EXTRAS: dict[str, dict[str, Any]] = {
    "plain": {},
    "all": {
        "budget": 12_345,
        "root_budget": 50_000,
        "root_turn_tokens": 4_096,
        "tools": ["lookup(key: str) -> str: Find a key."],
        "sub_tools": ["count_words(text: str) -> int: Count words."],
        "files": "The working directory holds `notes.txt` (12 bytes).",
        "max_turns": 0,
        "sub_llm_max_turns": 3,
        "max_output_length": 2_000,
        "parallelism": 4,
    },
    "root_budget_only": {"root_budget": 9_000, "max_turns": 7},
}
"""Option sets laid over each combination of the switches below."""


def cases() -> dict[str, str]:
    """Every case's name -> the system message it gives."""
    out: dict[str, str] = {}
    switches = itertools.product(
        ("light", "medium", "heavy"), ("python", "bash"), (True, False), ((1, 1), (1, 3), (3, 3)), (False, True)
    )
    for (verbosity, language, sub_llms, (depth, max_depth), history), (extra, kwargs) in itertools.product(
        switches, EXTRAS.items()
    ):
        name = f"{verbosity}-{language}-subllms{int(sub_llms)}-d{depth}of{max_depth}-hist{int(history)}-{extra}"
        context: Any = ["a", "b"] if history else "some context"
        out[name] = root_system_prompt(
            context,
            verbosity=verbosity,  # type: ignore[arg-type]
            language=language,
            sub_llms=sub_llms,
            depth=depth,
            max_depth=max_depth,
            message_history=history,
            **kwargs,
        )
    return out


def digests() -> dict[str, str]:
    return {name: hashlib.sha256(text.encode()).hexdigest() for name, text in cases().items()}


def test_the_root_system_message_is_unchanged_byte_for_byte() -> None:
    pinned = json.loads(DIGESTS.read_text(encoding="utf-8"))
    now = digests()
    assert sorted(now) == sorted(pinned)
    changed = sorted(name for name in now if now[name] != pinned[name])
    assert not changed, changed


def test_the_cases_differ() -> None:
    """The grid reaches the options: its texts are not all one text."""
    assert len(set(digests().values())) > 100


if __name__ == "__main__":
    DIGESTS.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {DIGESTS}")
