"""The run folder of ``rlmq run`` / ``rlmq demo`` and its static HTML report.

:func:`write_run` writes, into one folder:

* ``rows.jsonl``: the contract's result rows, one per rollout;
* ``trajectories.jsonl``: one JSON per rollout: ``id``, ``messages``, ``trajectory`` (and
  ``rollout`` with several rollouts per row)
  (root turns, REPL cells with code and output, each ``llm_batch`` with its sub-calls);
* ``meta.json``: the command, the settings (secrets left out, URL passwords masked),
  timings, ``repl_containment`` (what the REPL sandbox got on this host and what it could
  not contain; ``null`` when no REPL started), and ``interrupted`` (``signal``, ``finished``,
  ``rollouts``) when a signal stopped the run: then the folder holds the rollouts that
  finished, and the report says so;
* ``report.html``: one static file (inline CSS and SVG, no script, no CDN) with accuracy,
  stop reasons, token and time charts, and every rollout's trajectory, readable; a rollout
  that started children (``rlm_batch``) has its per-depth figures and its tree, each child
  collapsed (:mod:`rlmq.cli.report_trajectory`, bounded in size).

Everything taken from a run is escaped (``html.escape``, :mod:`rlmq.cli.report_html`) and a
Content-Security-Policy allows no script; long texts are cut in the report (the full text is
in ``trajectories.jsonl``) and long prompts are folded in ``<details>``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlmq.cli.report_html import CSS, bar_chart, correct_cell, cut, e, num, stop_bar, stop_chip
from rlmq.cli.report_trajectory import TreeView, depth_table_html, trajectory_html, tree_outline_html
from rlmq.cli.results import tree_totals, whole_figure
from rlmq.cli.run_folder import trajectory_line
from rlmq.common.connection import mask_url
from rlmq.producer.env import RolloutResult
from rlmq.producer.repl import containment_seen
from rlmq.producer.tree_metrics import number

__all__ = ["bar_chart", "cut", "default_run_dir", "e", "new_run_dir", "public_settings", "render_report", "write_run"]

SECRET_KEYS = re.compile(r"(api_key|password|secret|token$)", re.I)
"""Keys left out of ``meta.json``; ``token$`` (an auth token), not the ``*_tokens`` budget settings."""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""The report's Content-Security-Policy: no script, no request, whatever a string escaped."""


def public_settings(values: dict[str, Any]) -> dict[str, Any]:
    """Settings fit for ``meta.json``: secret-looking keys dropped, URL passwords masked."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if SECRET_KEYS.search(k):
            continue
        out[k] = mask_url(v) if isinstance(v, str) and "://" in v else v
    return out


def rollout_dom_id(i: int) -> str:
    """The DOM id of the ``i``-th rollout's section (its children's ids start with it)."""
    return f"rollout-{i}"


# ---------------------------------------------------------------------------- run folder


def write_run(folder: str | Path, results: Sequence[RolloutResult], meta: dict[str, Any]) -> Path:
    """Write the run folder (rows, trajectories, meta, HTML report) and return its path.

    Args:
        folder: created if missing (parents too); existing files of the same names are replaced.
        results: the finished rollouts, in dataset order.
        meta: ``command`` (list or str), ``settings`` (dict; secrets are removed here too),
            ``started`` / ``finished`` (Unix seconds), anything else JSON-able.
    """
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    rows = [r.row.model_dump() for r in results]
    with open(path / "rows.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    with open(path / "trajectories.jsonl", "w", encoding="utf-8") as fh:
        for r in results:
            fh.write(trajectory_line(r))
    meta = dict(meta)
    if isinstance(meta.get("settings"), dict):
        meta["settings"] = public_settings(meta["settings"])
    if meta.get("started") is not None and meta.get("finished") is not None:
        meta.setdefault("seconds", round(float(meta["finished"]) - float(meta["started"]), 3))
    meta.setdefault("rollouts", len(results))
    meta.setdefault("repl_containment", containment_seen())  # what the REPL sandbox could not contain here
    meta.setdefault("files", ["rows.jsonl", "trajectories.jsonl", "meta.json", "report.html"])
    (path / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    (path / "report.html").write_text(render_report(results, meta), encoding="utf-8")
    return path


def _whole(m: dict[str, Any], name: str) -> int:
    """A rollout's figure ``name`` (``sub_llm_call_count``, ...) over its whole tree when its row
    has the tree figure (``tree_<name>``), else its own."""
    return whole_figure(m, f"tree_{name}", name)


def _summary(rows: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[str, str]:
    """The accuracy text and the summary cards: each figure once, whole trees counted."""
    n = len(rows)
    graded = [r for r in rows if r.get("correct") is not None]
    right = sum(1 for r in graded if r["correct"])
    acc_text = f"{right}/{len(graded)} = {right / len(graded):.1%}" if graded else "not graded"
    acc_cls = "" if not graded else ("good" if right == len(graded) else ("bad" if right * 2 < len(graded) else ""))
    metrics = [r.get("metrics") or {} for r in rows]
    tot = {k: sum(num(m, k) for m in metrics) for k in (
        "main_rlm_prompt_tokens", "main_rlm_completion_tokens", "repl_total_time_seconds",
    )}  # fmt: skip
    whole = tree_totals(rows)
    sub_tokens = sum(_whole(m, "sub_llm_completion_tokens") for m in metrics)
    errors = sum(1 for r in rows if r.get("error"))
    cards = [
        ("accuracy", acc_text, acc_cls),
        ("rollouts", f"{n}", ""),
        ("rollouts ended in error", f"{errors}", "bad" if errors else ""),
        ("sub-LLM calls", f"{whole['sub_calls']:,}", ""),
        ("sub-LLM completion tokens", f"{sub_tokens:,}", ""),
        ("root tokens (prompt / completion)",
         f"{tot['main_rlm_prompt_tokens']:,.0f} / {tot['main_rlm_completion_tokens']:,.0f}", ""),
        ("REPL time", f"{tot['repl_total_time_seconds']:.2f} s", ""),
    ]  # fmt: skip
    if meta.get("seconds") is not None:
        cards.append(("wall time", f"{float(meta['seconds']):.1f} s", ""))
    if whole["rlm_tasks"]:
        cards += [
            ("rlm_batch tasks / child rollouts", f"{whole['rlm_tasks']:,} / {whole['children']:,}", ""),
            ("deepest tree", f"depth {whole['depth']}", ""),
            ("tree completion tokens charged", f"{whole['charged']:,}", ""),
        ]
    if whole["budget_spent"]:
        cards.append(("children ended by the budget", f"{whole['budget_spent']:,}", "bad"))
    if whole["sub_failed"] or whole["sub_rejected"]:
        cards.append(("sub-calls error / rejected", f"{whole['sub_failed']:,} / {whole['sub_rejected']:,}", "bad"))
    acc_id = ' id="accuracy"'
    html_cards = "".join(
        f'<div class="card"><div class="k">{e(k)}</div><div class="v {c}"{acc_id if k == "accuracy" else ""}>'
        f"{e(v)}</div></div>"
        for k, v, c in cards
    )
    return acc_text, html_cards


def _rollout_table(rows: list[dict[str, Any]]) -> str:
    """One line per rollout; its sub-calls and their tokens over its whole tree, and its child
    rollouts when the run started any."""
    trees = any(number((r.get("metrics") or {}).get("rlm_call_count")) for r in rows)
    head = (
        "<tr><th>#</th><th>rollout</th><th>result</th><th>stop reason</th><th>final answer</th><th>expected</th>"
        "<th>root turns</th><th>sub-calls</th><th>sub completion tokens</th>"
        + ("<th>child rollouts</th><th>tokens charged</th>" if trees else "")
        + "<th>REPL s</th></tr>"
    )
    body = []
    for i, r in enumerate(rows):
        m = r.get("metrics") or {}
        stop = r.get("stop_reason", "")
        tree_cells = ""
        if trees:
            children = max(0, number(m.get("tree_rollout_count")) - 1)
            tree_cells = (
                f'<td class="num">{children:,}</td>'
                f'<td class="num">{number(m.get("tree_charged_completion_tokens")):,}</td>'
            )
        body.append(
            f'<tr><td class="num">{i + 1}</td><td><a href="#{rollout_dom_id(i)}">{e(r.get("id"))}</a></td>'
            f"<td>{correct_cell(r.get('correct'))}</td>"
            f"<td>{stop_chip(stop)}</td>"
            f"<td>{e(cut(str(r.get('final_answer') or ''), 200))}</td><td>{e(r.get('answer') or '')}</td>"
            f'<td class="num">{num(m, "main_rlm_turns"):.0f}</td>'
            f'<td class="num">{_whole(m, "sub_llm_call_count"):,}</td>'
            f'<td class="num">{_whole(m, "sub_llm_completion_tokens"):,}</td>{tree_cells}'
            f'<td class="num">{num(m, "repl_total_time_seconds"):.2f}</td></tr>'
        )
    return f"<table>{head}{''.join(body)}</table>"


def _charts(ids: list[str], metrics: list[dict[str, Any]]) -> list[str]:
    """The per-rollout charts that have something to show (a chart whose every bar is 0, as in
    a run interrupted before any rollout finished, is left out rather than drawn empty)."""
    trees = any(number(m.get("rlm_call_count")) for m in metrics)
    sub = [("sub-LLM calls", "#ef6c00", [float(_whole(m, "sub_llm_completion_tokens")) for m in metrics])]
    if trees:  # what the children's own root turns added to the tree's charge
        child_roots = [
            float(max(0, number(m.get("tree_charged_completion_tokens")) - _whole(m, "sub_llm_completion_tokens")))
            for m in metrics
        ]
        sub.append(("child root turns", "#8d6e63", child_roots))
    specs = [
        ("Completion tokens charged per rollout tree" if trees else "Sub-LLM completion tokens per rollout", sub,
         "", "{:,.0f}"),
        ("Root-model tokens per rollout",
         [("prompt", "#90caf9", [num(m, "main_rlm_prompt_tokens") for m in metrics]),
          ("completion", "#1565c0", [num(m, "main_rlm_completion_tokens") for m in metrics])], "", "{:,.0f}"),
        ("REPL time per rollout (seconds)", [("REPL", "#2e7d32", [num(m, "repl_total_time_seconds") for m in metrics])],
         " s", "{:.2f}"),
    ]  # fmt: skip
    return [
        bar_chart(title, ids, series, unit=unit, fmt=fmt)
        for title, series, unit, fmt in specs
        if any(v > 0 for _, _, values in series for v in values)
    ]


def render_report(results: Sequence[RolloutResult], meta: dict[str, Any]) -> str:
    """The whole ``report.html`` as a string (static: inline CSS and SVG, no script).

    The summary cards, the rollout table and the charts count each rollout's whole tree; each
    rollout's trajectory is collapsed (a ``<details>`` whose summary line says what it holds),
    and a rollout that started children shows its tree (per-depth figures and an outline of its
    child rollouts) above it.
    """
    rows = [r.row.model_dump() for r in results]
    ids = [str(r["id"]) for r in rows]
    acc_text, cards = _summary(rows, meta)
    stops: Counter[str] = Counter(str(r["stop_reason"]) for r in rows)
    charts = _charts(ids, [r.get("metrics") or {} for r in rows])
    command = meta.get("command")
    command_text = " ".join(command) if isinstance(command, list) else str(command or "")
    started = meta.get("started")
    when = datetime.fromtimestamp(float(started), UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if started else ""
    sections = []
    for i, (res, row) in enumerate(zip(results, rows, strict=True)):
        err = f'<div class="err">{e(row["error"])}</div>' if row.get("error") else ""
        m = row.get("metrics", {})
        budget = ""
        if "sub_llm_budget_limit" in m and number(m.get("rlm_call_count")):  # its use: the tree table's
            budget = (
                f" · sub-LLM budget of the tree: <b>{num(m, 'sub_llm_budget_limit'):,.0f}</b> completion tokens, "
                f"{num(m, 'sub_llm_budget_rejections'):,.0f} rejected"
            )
        elif "sub_llm_budget_limit" in m:
            budget = (
                f" · sub-LLM budget: <b>{num(m, 'sub_llm_budget_used'):,.0f}/{num(m, 'sub_llm_budget_limit'):,.0f}"
                f"</b> completion tokens used, {num(m, 'sub_llm_budget_rejections'):,.0f} rejected"
            )
        stop = row["stop_reason"]
        kinds = Counter(str(ev.get("type")) for ev in res.trajectory if isinstance(ev, dict))
        traj_line = (
            f"trajectory: {kinds['root']} root turn(s), {kinds['cell']} REPL cell(s), "
            f"{kinds['llm_batch']} llm_batch, {kinds['rlm_batch']} rlm_batch call(s)"
        )
        sections.append(
            f'<section class="rollout" id="{rollout_dom_id(i)}"><h3>{i + 1}. {e(row["id"])} '
            f"{correct_cell(row.get('correct'))} "
            f"{stop_chip(stop)}</h3>"
            f'<div class="meta">final answer: <b>{e(cut(str(row.get("final_answer") or ""), 500))}</b>'
            f" · expected: <b>{e(row.get('answer') or '–')}</b>{budget}</div>{err}"
            f"{depth_table_html(m, res.trajectory)}{tree_outline_html(res.trajectory)}"
            f'<details class="traj"><summary>{e(traj_line)}</summary>'
            f"{_question_html(res)}{_trajectory(i, res)}</details></section>"
        )
    settings = meta.get("settings") or {}
    stopped = meta.get("interrupted")
    banner = (
        f'<div class="err" id="interrupted">Interrupted by {e(stopped.get("signal"))}: '
        f"{e(stopped.get('finished'))} of {e(stopped.get('rollouts'))} rollouts finished and are shown here; "
        "the others were cancelled.</div>"
        if isinstance(stopped, dict)
        else ""
    )
    settings_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in settings.items() if v is not None)
    body = banner + (f'<h2>Summary</h2><div class="cards">{cards}</div>' if rows else "")
    if rows:
        body += f"<h2>Stop reasons</h2>{stop_bar(stops, len(rows))}"
    if charts:
        body += f'<h2>Tokens and time</h2><div class="charts">{"".join(charts)}</div>'
    if rows:
        body += (
            f"<h2>Rollouts</h2>{_rollout_table(rows)}"
            f'<h2>Trajectories</h2><p class="note">Each rollout\'s trajectory is folded: open it to read its '
            f"turns, cells and calls.</p>{''.join(sections)}"
        )
    else:  # nothing to count or draw: no empty cards or chart frames
        body += '<h2>Summary</h2><p class="note">No rollout finished: there is nothing to show.</p>'
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{e(CSP)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>rlmq report: {e(acc_text)}</title><style>{CSS}</style></head><body>"
        f'<header><h1>rlmq run report</h1><div class="sub">{e(when)} · {e(command_text)}</div></header><main>'
        f"{body}"
        f"<h2>Settings</h2><details><summary>settings of this run</summary><table>{settings_rows}</table></details>"
        '<p class="note">Full texts: rows.jsonl, trajectories.jsonl and meta.json in this folder.</p>'
        "</main></body></html>\n"
    )


def _trajectory(i: int, res: RolloutResult) -> str:
    return trajectory_html(res.trajectory, view=TreeView(rollout_dom_id(i)))


def _question_html(res: RolloutResult) -> str:
    question = next((str(m.get("content")) for m in res.messages if m.get("role") == "user" and m.get("content")), None)
    if question is None:
        return ""
    return f'<div class="meta">question</div><pre class="out small">{e(cut(question, 2000))}</pre>'


def default_run_dir(command: str, root: str | Path = "runs", now: datetime | None = None) -> Path:
    """``runs/<UTC timestamp>-<command>`` (``20261122T062001Z-demo``)."""
    now = now or datetime.now(UTC)
    return Path(root) / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{command}"


def new_run_dir(command: str, root: str | Path = "runs", now: datetime | None = None) -> Path:
    """:func:`default_run_dir`, created now (parents too); ``-2``, ``-3``, ... after its name
    when another run took it in the same second (``mkdir`` decides, so two processes never
    share one)."""
    base = default_run_dir(command, root, now)
    base.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            n += 1
            continue
        return path


def rows_of(results: Iterable[RolloutResult]) -> list[dict[str, Any]]:
    """The result rows (dicts) of ``results``."""
    return [r.row.model_dump() for r in results]
