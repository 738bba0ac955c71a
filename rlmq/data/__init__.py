"""Data that ships with rlmq: a small sample dataset for ``rlmq run``.

``sample.jsonl`` holds 4 needle-in-a-haystack rows in the dataset shape (``{"id", "question",
"context", "answer", "info"}`` per line), each about 12,000 characters of CPython's own
documentation with one sentence hidden in it, made by :func:`rlmq.cli.demo.needle_rows`
(``n=4, min_chars=12_000, seed=7``). In the checkout it is ``rlmq/data/sample.jsonl``;
from an installed rlmq, :data:`SAMPLE_DATASET` (``python -m rlmq.data`` prints it).
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_DATASET = Path(__file__).resolve().with_name("sample.jsonl")
"""The sample dataset's path (a JSONL file of 4 rows)."""

SAMPLE_ROWS = {"n": 4, "min_chars": 12_000, "seed": 7}
"""The :func:`rlmq.cli.demo.needle_rows` arguments ``sample.jsonl`` was made with."""
