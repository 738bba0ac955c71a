"""The ``rlms`` side of ``bench.recursion``: the same needle tree through the RLM paper's package.

Run by ``bench.recursion`` with the interpreter of a throwaway virtualenv that has ``rlms``
installed (never rlmq's own environment: ``rlms`` is not a dependency of rlmq)::

    /tmp/rlms-venv/bin/python bench/recursion_rlms.py --base-url URL --data rows.jsonl \
        --max-depth D --subcalls C --concurrency R --result out.json

It imports only the standard library and ``rlm``. Each row runs
``RLM(backend="openai", max_depth=D, max_concurrent_subcalls=C).completion(prompt=<question line +
context>, root_prompt=<question>)`` against the scripted model server, whose rlm-format root
(:mod:`rlmq.scripted.recursion`) splits the context and calls ``rlm_query_batched`` (``rlm``
runs plain completions by itself at its ``max_depth``). ``R`` rows run at once, one process
each. Writes one JSON document to ``--result``: ``{"rows": [{"id", "seconds", "answer", "correct",
"error"}], "wall_s", "rlms_version"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from importlib.metadata import version
from typing import Any


def run_row(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from rlm import RLM

    started = time.perf_counter()
    answer: str | None = None
    error: str | None = None
    child_errors: list[str] = []

    def child_done(depth: int, model: str, seconds: float, failure: str | None) -> None:
        if failure:
            child_errors.append(f"depth {depth}: {failure}"[:300])

    try:
        rlm = RLM(
            backend="openai",
            backend_kwargs={"model_name": "scripted", "base_url": args.base_url, "api_key": "unused"},
            environment="local",
            max_depth=args.max_depth,
            max_iterations=4,
            max_concurrent_subcalls=args.subcalls,
            on_subcall_complete=child_done,
        )
        result = rlm.completion(prompt=row["question"] + "\n" + row["context"], root_prompt=row["question"])
        answer = str(result.response).strip()
    except Exception as exc:  # a failed row is a figure of the benchmark, not a crash of it
        error = f"{type(exc).__name__}: {exc}"[:300]
    return {
        "id": row["id"],
        "seconds": time.perf_counter() - started,
        "answer": answer,
        "correct": answer == row["answer"],
        "error": error,
        "child_errors": child_errors[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-depth", type=int, required=True)
    parser.add_argument("--subcalls", type=int, default=4, help="max_concurrent_subcalls of every RLM")
    parser.add_argument("--concurrency", type=int, default=1, help="rows at once (one process each)")
    parser.add_argument("--result", required=True, help="the JSON file to write")
    args = parser.parse_args()
    with open(args.data) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    started = time.perf_counter()
    # One process per row at a time: rlm's local REPL changes the process's working directory
    # while a cell runs, so two top-level RLMs in threads of one process break each other's cells.
    with ProcessPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        results = list(pool.map(partial(run_row, args=args), rows))
    doc = {"rows": results, "wall_s": time.perf_counter() - started, "rlms_version": version("rlms")}
    with open(args.result, "w") as fh:  # not stdout: rlm prints there
        json.dump(doc, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
