"""The report of the queue-path benchmark: summary figures, the printed tables, the file name and the plot."""

from __future__ import annotations

from typing import Any


def summarize(
    rows: dict[str, dict[str, Any]], census: dict[str, dict[str, Any]], light_rows: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Ratios between scenarios, the light-load figures and the budget's cost, from one run's rows."""
    ratios: dict[str, float] = {}
    for name in ("rlmq", "rlmq-budget"):
        if name not in rows:
            continue
        for ref in ("openai5", "openai", "rq"):
            if ref in rows:
                ratios[f"{name}/{ref} calls_per_s"] = rows[name]["calls_per_s"] / rows[ref]["calls_per_s"]
    light: dict[str, Any] = {}
    if "direct" in light_rows:
        d = light_rows["direct"]
        for name in ("rlmq", "rlmq-budget"):
            if name in light_rows:
                x = light_rows[name]
                light[name] = {
                    "p50_ms": x["p50_ms"],
                    "p99_ms": x["p99_ms"],
                    "added_p50_ms": x["p50_ms"] - d["p50_ms"],
                    "added_p99_ms": x["p99_ms"] - d["p99_ms"],
                    "paired_added_p50_ms": x.get("paired_added_p50_ms", float("nan")),
                    "paired_added_p99_ms": x.get("paired_added_p99_ms", float("nan")),
                    # the added p50 in direct calls: hops cost what the direct call's own
                    # wake-ups and round trips cost, so this ratio is what stays put when
                    # the shared box speeds up or slows down
                    "added_p50_per_direct_p50": (x["p50_ms"] - d["p50_ms"]) / d["p50_ms"],
                }
        light["direct"] = {"p50_ms": d["p50_ms"], "p99_ms": d["p99_ms"]}
    budget: dict[str, Any] = {}
    if "rlmq" in census and "rlmq-budget" in census:
        u, b = census["rlmq"], census["rlmq-budget"]
        budget["round_trips_per_call"] = b["top_level_per_call"] - u["top_level_per_call"]
        budget["commands_per_call"] = (b["top_level_per_call"] + b["in_lua_per_call"]) - (
            u["top_level_per_call"] + u["in_lua_per_call"]
        )
    if "rlmq" in rows and "rlmq-budget" in rows:
        u, b = rows["rlmq"], rows["rlmq-budget"]
        budget["worker_cpu_ms_per_call"] = b["worker_cpu_ms_per_call"] - u["worker_cpu_ms_per_call"]
        budget["redis_cpu_ms_per_call"] = b["redis_cpu_ms_per_call"] - u["redis_cpu_ms_per_call"]
        budget["throughput_ratio"] = b["calls_per_s"] / u["calls_per_s"]
    if "rlmq" in light and "rlmq-budget" in light:
        budget["light_added_p50_ms"] = light["rlmq-budget"]["p50_ms"] - light["rlmq"]["p50_ms"]
        budget["light_added_p99_ms"] = light["rlmq-budget"]["p99_ms"] - light["rlmq"]["p99_ms"]
    return {"ratios": ratios, "light": light, "budget": budget}


def print_table(doc: dict[str, Any]) -> None:
    """Print a results document as the tables the README quotes."""
    labels = {
        "openai5": "(a) AsyncOpenAI, sem 5/batch",
        "openai": "(a) AsyncOpenAI, unbounded",
        "rq": "(b) stock RQ SimpleWorker",
        "rlmq": "(c) rlmq, unbudgeted",
        "rlmq-budget": "(c) rlmq, budgeted",
    }
    head = (
        f"{'scenario':32} {'conc':>5} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cli cpu':>8} {'wrk cpu':>8} "
        f"{'redis cmd':>9} {'cli RSS':>8} {'wrk RSS':>8} {'err':>4}"
    )
    print("\nThroughput (CPU in ms per sub-call, RSS peak MB; redis cmd = INFO commandstats, Lua inside included)")
    print(head)
    print("-" * len(head))
    for key, row in doc["rows"].items():
        print(
            f"{labels.get(key, key):32} {row['concurrency']:>5} {row['calls_per_s']:>8.0f} {row['p50_ms']:>8.1f} "
            f"{row['p99_ms']:>8.1f} {row['client_cpu_ms_per_call']:>8.3f} {row['worker_cpu_ms_per_call']:>8.3f} "
            f"{row['redis_commands_per_call']:>9.1f} {row['client_peak_rss_mb']:>8.0f} "
            f"{row['worker_peak_rss_mb']:>8.0f} {row['errors']:>4}"
        )
    if doc["ratios"]:
        print("\nRatios (same run): " + ", ".join(f"{k} = {v:.2f}x" for k, v in doc["ratios"].items()))
    census = dict(doc["census"])
    if "rq" in doc["rows"] and "census" in doc["rows"]["rq"]:
        census["rq"] = doc["rows"]["rq"]["census"]
    if census:
        print("\nRedis commands per sub-call (MONITOR census): top-level round trips + commands run inside Lua")
        for key, c in census.items():
            print(
                f"  {labels.get(key, key):30} top-level {c['top_level_per_call']:5.2f}"
                f"  in Lua {c['in_lua_per_call']:5.2f}  total {c['top_level_per_call'] + c['in_lua_per_call']:5.2f}"
            )
    if doc["light"]:
        print("\nLight load (one prompt at a time), ms")
        for key, x in doc["light"].items():
            extra = (
                f"  added p50 {x['added_p50_ms']:.2f}  added p99 {x['added_p99_ms']:.2f}"
                f"  (per round: p50 {x['paired_added_p50_ms']:.2f}  p99 {x['paired_added_p99_ms']:.2f};"
                f"  added p50 = {x['added_p50_per_direct_p50']:.2f}x the direct p50)"
                if "added_p50_ms" in x
                else ""
            )
            print(f"  {key:12} p50 {x['p50_ms']:.2f}  p99 {x['p99_ms']:.2f}{extra}")
    if doc["budget"]:
        print("\nBudget enforcement cost (budgeted - unbudgeted rlmq): " + ", ".join(
            f"{k} = {v:.3f}" for k, v in doc["budget"].items()
        ))  # fmt: skip
    s = doc.get("slow")
    if s:
        print(
            f"\nSlow model: {s['n']} sub-calls at concurrency {s['concurrency']},"
            f" model {s['model_latency_s']:g} s/call,"
            f" one worker: wall {s['wall_s']:.2f} s vs ideal {s['ideal_s']:.2f} s ({s['wall_over_ideal']:.3f}x),"
            f" worker peak RSS {s['worker_peak_rss_mb']:.0f} MB, worker CPU {s['worker_cpu_ms_per_call']:.3f} ms/call,"
            f" errors {s['errors']}"
        )


def results_name(quick: bool, only: str | None) -> str:
    """File stem under ``bench/results``: ``queue_path`` for the full run, ``queue_path_quick``
    for ``--quick``; a subset (``--only``) gets its own, so it never overwrites a full run."""
    name = "queue_path_quick" if quick else "queue_path"
    if only:
        name += "_only_" + "_".join(sorted(x.strip().replace("-", "_") for x in only.split(",") if x.strip()))
    return name


def plot(doc: dict[str, Any], path: str) -> str | None:
    """Throughput and latency against concurrency (the sweep) as a PNG at ``path``; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sweep = doc.get("sweep") or {}
    if not sweep:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in sweep.items():
        xs = [p["concurrency"] for p in pts]
        (line,) = ax1.plot(xs, [p["calls_per_s"] for p in pts], marker="o", label=name)
        color = line.get_color()
        ax2.plot(xs, [p["p50_ms"] for p in pts], marker="o", color=color, label=f"{name} p50")
        ax2.plot(xs, [p["p99_ms"] for p in pts], marker="x", color=color, linestyle="--", label=f"{name} p99")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sub-calls in flight")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylabel("sub-calls / s")
    ax2.set_ylabel("latency per sub-call (ms, from llm_batch start)")
    ax2.set_yscale("log")
    fig.suptitle("rlmq queue path vs in-process AsyncOpenAI (zero-latency scripted model, 127.0.0.1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
