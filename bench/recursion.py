"""Recursive rollouts on the fleet: child rollouts per second and added latency per level.

``python -m bench.recursion [--quick] [--depths 1,2,3] [--rows R] [--lines L] [--split K]
[--latency S] [--workers N] [--repl-slots N] [--concurrency C] [--rlms-python PATH] [--out STEM]``

One invocation starts a private Redis (:class:`rlmq.common.redis_server.EmbeddedRedis`), one
scripted model server (``rlmq mock-llm --port 0``, its own process; ``--latency`` seconds per
completion) and ``--workers`` real ``rlmq worker`` processes serving it, the REPL hosts among
them with ``--repl-slots N`` (depth >= 2 needs them). It writes one needle dataset
(:mod:`bench.needle`: ``R`` rows of ``L`` lines, ``[[mock:rlm-split:K]]``), then for each depth
``d`` runs ``rlmq run <rows> --max-depth d`` twice against that fleet: one row at a time
(**latency**: the top rollout's time in its REPL cells, which holds its whole subtree, p50 over
the rows; "added per level" is the step from depth ``d - 1``) and ``C`` rows at once
(**throughput**: child rollouts per second = child rollouts the model server saw / wall time of
the run; the model server counts root requests by the depth line of their scaffold).

With ``--rlms-python`` (an interpreter of a throwaway venv with the ``rlms`` package, the RLM
paper's code: never a dependency of rlmq), the same rows and depths run through
``bench/recursion_rlms.py`` against the same model server: the same tree (one rlm RLM per
rollout, ``rlm_query_batched`` of ``K`` prompts at each level, plain completions at its
``max_depth``), side by side, twice: ``rlms`` with ``max_concurrent_subcalls = K`` (children in
parallel, as rlm runs them) and ``rlms-sequential`` with 1. rlm 0.1.3's local REPL changes the
process's working directory to a temporary folder around every cell and back to the folder it
found (``os.getcwd()``, one per process): sibling children in threads can restore a folder a
sibling already deleted, and that child fails (``FileNotFoundError``); the JSON counts the rows
where a child failed (``rows_with_child_errors``). Results: ``bench/results/recursion.json`` (``--quick``:
``recursion_quick.json``; ``--out STEM``: ``STEM.json``), and a table on stdout. No timing is
asserted.

A depth whose flags this checkout's ``rlmq run`` / ``rlmq worker`` do not have yet
(``--max-depth``, ``--repl-slots``) is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from bench.harness import LOG_DIR, RESULTS_DIR, machine, pct, save_json, say
from bench.needle import needle_rows

MODEL = "scripted"


def cli_has_flag(command: str, flag: str) -> bool:
    """True when ``rlmq <command> --help`` lists ``flag``."""
    from rlmq.cli.local import child_env, rlmq_command

    run = subprocess.run(
        rlmq_command(command, "--help"), capture_output=True, text=True, timeout=60, env=child_env(), check=False
    )
    return flag in run.stdout


def model_stats(base_url: str) -> dict[str, Any]:
    """``GET /stats`` of the scripted model server."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=30) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def reset_stats(base_url: str) -> None:
    """``DELETE /stats``: zero the model server's counters."""
    request = urllib.request.Request(base_url.removesuffix("/v1") + "/stats", method="DELETE")
    with urllib.request.urlopen(request, timeout=30):
        pass


def children_seen(stats: dict[str, Any]) -> int:
    """Root requests at depth >= 2 (one per child rollout turn) the server counted."""
    by_depth: dict[str, int] = stats.get("root_requests_by_depth", {})
    return sum(n for d, n in by_depth.items() if d.isdigit() and int(d) >= 2)


def summarize_rows(rows: list[dict[str, Any]], answers: dict[str, str]) -> dict[str, Any]:
    """Correct rows, errors and the per-row REPL time of a run's output rows."""
    times = [float(r.get("metrics", {}).get("repl_total_time_seconds", float("nan"))) for r in rows]
    return {
        "rows": len(rows),
        "correct": sum(1 for r in rows if (r.get("final_answer") or "").strip() == answers.get(r["id"])),
        "errors": sum(1 for r in rows if r.get("error")),
        "repl_s_p50": pct([t for t in times if t == t], 50),
        "first_error": next((r["error"] for r in rows if r.get("error")), None),
    }


class Bench:
    """The fleet and the runs of one invocation (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.redis_url = ""
        self.base_url = ""
        self.tmp = tempfile.mkdtemp(prefix="rlmq-bench-recursion-")
        self.data = os.path.join(self.tmp, "needle.jsonl")
        rows = needle_rows(args.rows, args.lines, parts=args.split, seed=args.seed)
        self.answers = {str(r["id"]): str(r["answer"]) for r in rows}
        with open(self.data, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        self.has_max_depth = cli_has_flag("run", "--max-depth")
        self.has_repl_slots = cli_has_flag("worker", "--repl-slots")

    def skip_reason(self, depth: int) -> str | None:
        """Why this checkout cannot run ``depth`` yet, or ``None``."""
        if depth > 1 and not self.has_max_depth:
            return "rlmq run has no --max-depth yet (this checkout predates rlm_batch)"
        if depth > 1 and not self.has_repl_slots:
            return "rlmq worker has no --repl-slots yet (this checkout predates REPL hosts)"
        return None

    def rlmq_run(self, depth: int, concurrency: int) -> dict[str, Any]:
        """One ``rlmq run`` of the dataset at ``depth`` with ``concurrency`` rows at once."""
        from rlmq.cli.local import child_env, rlmq_command

        out = os.path.join(self.tmp, f"rlmq-d{depth}-c{concurrency}.jsonl")
        argv = rlmq_command(
            "run", self.data, "--base-url", self.base_url, "--model", MODEL,
            "--concurrency", str(concurrency), "--output", out,
        )  # fmt: skip
        if self.has_max_depth:
            argv += ["--max-depth", str(depth)]
        reset_stats(self.base_url)
        started = time.perf_counter()
        run = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=self.args.timeout,
            env=child_env({"RLMQ_REDIS_URL": self.redis_url}),
            check=False,
        )
        wall = time.perf_counter() - started
        stats = model_stats(self.base_url)
        with open(out + ".model-stats.json", "w") as fh:  # the server's counters of this run, for a closer look
            json.dump(stats, fh)
        if run.returncode != 0 or not os.path.exists(out):
            return {"exit": run.returncode, "wall_s": wall, "stderr": run.stderr[-1500:]}
        with open(out) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        children = children_seen(stats)
        return {
            "exit": run.returncode,
            "wall_s": wall,
            **summarize_rows(rows, self.answers),
            "child_rollouts": children,
            "child_rollouts_per_s": children / wall if wall > 0 else float("nan"),
            "leaf_calls": stats["per_role"]["sub"]["completions"],
            "root_requests_by_depth": stats.get("root_requests_by_depth", {}),
            "per_role": stats["per_role"],
        }

    def rlms_run(self, depth: int, concurrency: int, subcalls: int) -> dict[str, Any]:
        """The same rows through the ``rlms`` package (``bench/recursion_rlms.py``), ``subcalls``
        children of an RLM at once (its ``max_concurrent_subcalls``)."""
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recursion_rlms.py")
        result = os.path.join(self.tmp, f"rlms-d{depth}-c{concurrency}-s{subcalls}.json")
        argv = [
            self.args.rlms_python, script, "--base-url", self.base_url, "--data", self.data,
            "--max-depth", str(depth), "--subcalls", str(subcalls), "--concurrency", str(concurrency),
            "--result", result,
        ]  # fmt: skip
        reset_stats(self.base_url)
        started = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLMQ_", "OPENAI_"))}
        run = subprocess.run(argv, capture_output=True, text=True, timeout=self.args.timeout, env=env, check=False)
        wall = time.perf_counter() - started
        stats = model_stats(self.base_url)
        if run.returncode != 0 or not os.path.exists(result):
            return {"exit": run.returncode, "wall_s": wall, "stderr": run.stderr[-1500:]}
        with open(result) as fh:
            doc = json.load(fh)
        rows = doc["rows"]
        roots = int(stats["per_role"]["root"]["completions"])
        children = max(0, roots - len(rows)) if depth > 1 else 0  # one root turn per RLM (answer ready on turn 1)
        inner = float(doc["wall_s"])
        return {
            "exit": 0,
            "wall_s": wall,
            "rows": len(rows),
            "correct": sum(1 for r in rows if r["correct"]),
            "errors": sum(1 for r in rows if r["error"]),
            "rows_with_child_errors": sum(1 for r in rows if r.get("child_errors")),
            "first_child_error": next((r["child_errors"][0] for r in rows if r.get("child_errors")), None),
            "row_s_p50": pct([float(r["seconds"]) for r in rows], 50),
            "first_error": next((r["error"] for r in rows if r["error"]), None),
            "child_rollouts": children,
            "child_rollouts_per_s": children / inner if inner > 0 else float("nan"),
            "leaf_calls": stats["per_role"]["sub"]["completions"],
            "root_turns": roots,
            "rlms_version": doc.get("rlms_version"),
        }

    def run(self) -> dict[str, Any]:
        """Every depth, rlmq (and rlms when given); returns the results document."""
        from rlmq.cli.local import LocalFleet
        from rlmq.common.redis_server import EmbeddedRedis

        args = self.args
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
        doc: dict[str, Any] = {
            "bench": "recursion",
            "machine": machine(),
            "argv": sys.argv[1:],
            "setup": {
                "rows": args.rows,
                "lines": args.lines,
                "split": args.split,
                "latency_s": args.latency,
                "workers": args.workers,
                "repl_slots": args.repl_slots,
                "concurrency": args.concurrency,
            },  # fmt: skip
            "rlmq": {},
            "rlms": {},
        }
        worker_args = ["--repl-slots", str(args.repl_slots)] if self.has_repl_slots else []
        with EmbeddedRedis() as redis_server:
            self.redis_url = redis_server.url
            fleet = LocalFleet(
                redis_url=self.redis_url,
                model=MODEL,
                base_url=None,
                workers=args.workers,
                worker_args=worker_args,
                mock_latency=args.latency,
                log_dir=LOG_DIR,
            )
            with fleet:
                self.base_url = str(fleet.base_url)
                for depth in depths:
                    reason = self.skip_reason(depth)
                    if reason is not None:
                        doc["rlmq"][str(depth)] = {"skipped": reason}
                        say(f"rlmq depth {depth}: skipped: {reason}")
                        continue
                    say(f"rlmq depth {depth}: one row at a time, then {args.concurrency} at once")
                    doc["rlmq"][str(depth)] = {
                        "latency": self.rlmq_run(depth, 1),
                        "throughput": self.rlmq_run(depth, args.concurrency),
                    }
                if args.rlms_python:
                    for system, subcalls in (("rlms", args.split), ("rlms-sequential", 1)):
                        doc[system] = {}
                        for depth in depths:
                            say(f"{system} depth {depth}: one row at a time, then {args.concurrency} at once")
                            doc[system][str(depth)] = {
                                "subcalls": subcalls,
                                "latency": self.rlms_run(depth, 1, subcalls),
                                "throughput": self.rlms_run(depth, args.concurrency, subcalls),
                            }
                else:
                    doc["rlms"] = {"skipped": "no --rlms-python given"}
        added(doc)
        return doc


def added(doc: dict[str, Any]) -> None:
    """Add ``added_latency_s`` (p50 step from the depth below) to every measured depth, in place."""
    for system, key in (("rlmq", "repl_s_p50"), ("rlms", "row_s_p50"), ("rlms-sequential", "row_s_p50")):
        runs = doc.get(system, {})
        previous: float | None = None
        for depth in sorted((d for d in runs if d.isdigit()), key=int):
            latency = runs[depth].get("latency", {})
            value = latency.get(key)
            if isinstance(value, float) and value == value:
                latency["added_latency_s"] = None if previous is None else value - previous
                previous = value


def print_table(doc: dict[str, Any]) -> None:
    """The results as a table on stdout."""
    print(
        f"\nRecursive needle tree: {doc['setup']['rows']} rows x {doc['setup']['lines']} lines, "
        f"split {doc['setup']['split']}, model latency {doc['setup']['latency_s']} s"
    )
    head = (
        f"{'system':15} {'depth':>5} {'correct':>8} {'p50 s/row':>10} {'added s':>8} "
        f"{'children':>9} {'child/s':>8} {'leaves':>7}"
    )
    print(head)
    print("-" * len(head))
    for system, key in (("rlmq", "repl_s_p50"), ("rlms", "row_s_p50"), ("rlms-sequential", "row_s_p50")):
        runs = doc.get(system, {})
        for depth in sorted((d for d in runs if d.isdigit()), key=int):
            entry = runs[depth]
            if "skipped" in entry:
                print(f"{system:15} {depth:>5}  skipped: {entry['skipped']}")
                continue
            lat, thr = entry["latency"], entry["throughput"]
            if lat.get("exit") != 0 or thr.get("exit") != 0:
                print(f"{system:15} {depth:>5}  failed: {(lat.get('stderr') or thr.get('stderr') or '')[-300:]}")
                continue
            step = lat.get("added_latency_s")
            print(
                f"{system:15} {depth:>5} {thr['correct']:>4}/{thr['rows']:<3} {lat[key]:>10.3f} "
                f"{'-' if step is None else f'{step:.3f}':>8} {thr['child_rollouts']:>9} "
                f"{thr['child_rollouts_per_s']:>8.1f} {thr['leaf_calls']:>7}"
            )
    for system in ("rlms", "rlms-sequential"):
        runs = doc.get(system, {})
        failed = [d for d in runs if d.isdigit() and runs[d]["throughput"].get("rows_with_child_errors")]
        for depth in failed:
            entry = runs[depth]["throughput"]
            print(
                f"{system} depth {depth}: {entry['rows_with_child_errors']} row(s) with a failed child: "
                f"{entry['first_child_error']}"
            )
    if "skipped" in doc.get("rlms", {}):
        print(f"rlms: skipped: {doc['rlms']['skipped']}")


def results_stem(args: argparse.Namespace) -> str:
    """Where the JSON goes: ``--out``, else ``bench/results/recursion[_quick]``."""
    if args.out:
        return str(args.out)
    return os.path.join(RESULTS_DIR, "recursion_quick" if args.quick else "recursion")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="child rollouts per second and added latency per level")
    parser.add_argument("--quick", action="store_true", help="a small run (smoke): 2 rows of 60 lines, split 2")
    parser.add_argument("--depths", default="1,2,3")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--split", type=int, default=4, help="K: parts (children, or leaves) per rollout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per model completion")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repl-slots", type=int, default=8, help="REPL slots per depth of each worker")
    parser.add_argument("--concurrency", type=int, default=4, help="rows at once in the throughput run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--rlms-python", default=None, help="python of a venv with the rlms package")
    parser.add_argument("--out", default=None, help="write STEM.json instead")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.lines, args.split = min(args.rows, 2), min(args.lines, 60), min(args.split, 2)
    os.makedirs(LOG_DIR, exist_ok=True)
    doc = Bench(args).run()
    path = save_json(doc, results_stem(args))
    print_table(doc)
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
