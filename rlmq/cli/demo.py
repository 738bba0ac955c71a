"""The demo's data: needle-in-a-haystack rows over real text that ships with Python.

The haystack is CPython's own documentation, ``pydoc_data.topics`` (about 465K
characters). Each row takes a window of at least ``min_chars`` characters, hides one
sentence (the needle) at a random sentence boundary, and asks for it.
"""

from __future__ import annotations

import random

NAMES = [
    "ZEPHYR", "ORCHID", "BASALT", "KESTREL", "LANTERN", "MERIDIAN", "QUARTZ", "SABLE", "TUNDRA", "VESPER",
    "WILLOW", "AURORA", "CINDER", "DELTA", "EMBER", "FJORD",
]  # fmt: skip
WORDS = [
    "cobalt", "lantern", "harbor", "maple", "quill", "saffron", "thistle", "umber", "velvet", "walnut",
    "amber", "birch", "copper", "dune", "ember", "fable", "garnet", "hazel", "indigo", "juniper",
]  # fmt: skip


def haystack() -> str:
    """All of ``pydoc_data.topics`` joined: CPython's documentation topics, ~465K characters."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def needle_rows(n: int = 8, *, min_chars: int = 100_000, seed: int = 0) -> list[dict[str, object]]:
    """``n`` dataset rows (the contract's JSONL shape) with a needle each.

    Args:
        n: number of rows.
        min_chars: characters of context per row (at least).
        seed: makes the set reproducible.
    """
    rng = random.Random(seed)
    text = haystack()
    rows: list[dict[str, object]] = []
    for i in range(n):
        size = min(len(text), min_chars + rng.randrange(0, 20_000))
        start = rng.randrange(0, max(1, len(text) - size))
        window = text[start : start + size]
        name = f"{NAMES[i % len(NAMES)]}-{rng.randrange(10, 99)}"
        secret = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(100, 999)}"
        needle = f" The secret passphrase of agent {name} is {secret}. "
        # Hide it at a sentence boundary somewhere in the middle 80 %.
        pos = rng.randrange(len(window) // 10, 9 * len(window) // 10)
        dot = window.find(". ", pos)
        pos = dot + 1 if dot != -1 else pos
        context = window[:pos] + needle + window[pos:]
        rows.append(
            {
                "id": f"needle-{i}",
                "question": f"What is the secret passphrase of agent {name}? Reply with the passphrase only.",
                "context": context,
                "answer": secret,
                "info": {"needle_offset": pos, "context_chars": len(context)},
            }
        )
    return rows
