"""The run folder of ``rlmq run`` / ``rlmq demo`` and its static HTML report.

:func:`write_run` writes, into one folder:

* ``rows.jsonl``: the contract's result rows, one per rollout;
* ``trajectories.jsonl``: one JSON per rollout: ``id``, ``messages``, ``trajectory``
  (root turns, REPL cells with code and output, each ``llm_batch`` with its sub-calls);
* ``meta.json``: the command, the settings (secrets left out, URL passwords masked),
  timings, ``repl_containment`` (what the REPL sandbox got on this host and what it could
  not contain; ``null`` when no REPL started), and ``interrupted`` (``signal``, ``finished``,
  ``rollouts``) when a signal stopped the run: then the folder holds the rollouts that
  finished, and the report says so;
* ``report.html``: one static file (inline CSS and SVG, no script, no CDN) with accuracy,
  stop reasons, token and time charts, and every rollout's trajectory, readable.

Everything taken from a run is escaped (``html.escape``); long texts are cut in the
report (the full text is in ``trajectories.jsonl``) and long prompts are folded in
``<details>``.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlmq.common.connection import mask_url
from rlmq.producer.env import RolloutResult
from rlmq.producer.repl import containment_seen

# Cut lengths in the HTML report (characters); the run folder's JSONL files keep everything.
MAX_PROMPT = 4000
MAX_TEXT = 12000
MAX_CHART_ROWS = 60

STOP_COLORS = {"answer_ready": "#2e7d32", "max_turns": "#ef6c00", "no_tool_call": "#6a1b9a", "error": "#c62828"}
STATUS_COLORS = {"ok": "#2e7d32", "rejected": "#ef6c00", "error": "#c62828"}
SECRET_KEYS = re.compile(r"(api_key|password|token|secret)", re.I)


def e(x: Any) -> str:
    """``html.escape`` of ``str(x)`` (quotes too)."""
    return html.escape("" if x is None else str(x), quote=True)


def cut(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with a visible marker."""
    if len(text) <= n:
        return text
    return text[:n] + f"\n… [{len(text) - n:,} more characters in trajectories.jsonl]"


def public_settings(values: dict[str, Any]) -> dict[str, Any]:
    """Settings fit for ``meta.json``: secret-looking keys dropped, URL passwords masked."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if SECRET_KEYS.search(k):
            continue
        out[k] = mask_url(v) if isinstance(v, str) and "://" in v else v
    return out


def rollout_dom_id(i: int) -> str:
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
            fh.write(json.dumps({"id": r.row.id, "messages": r.messages, "trajectory": r.trajectory}, default=str))
            fh.write("\n")
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


# ---------------------------------------------------------------------------- charts


def bar_chart(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, str, Sequence[float]]],
    *,
    unit: str = "",
    fmt: str = "{:,.0f}",
) -> str:
    """A horizontal grouped bar chart as inline SVG.

    Args:
        labels: one per row (rollout ids).
        series: ``(name, colour, values)``; values align with ``labels``.
    """
    labels = list(labels)[:MAX_CHART_ROWS]
    n_series = max(1, len(series))
    bar_h, gap = 12, 8
    row_h = bar_h * n_series + gap
    label_w, plot_w, value_w = 150, 320, 80
    top = 28 if len(series) > 1 else 8
    height = top + row_h * len(labels) + 6
    width = label_w + plot_w + value_w
    vmax = max([v for _, _, vals in series for v in list(vals)[: len(labels)]] + [0]) or 1
    parts = [
        f'<svg class="chart" role="img" aria-label="{e(title)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
    ]
    if len(series) > 1:
        x = label_w
        for name, colour, _ in series:
            parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{e(colour)}"/>')
            parts.append(f'<text x="{x + 16}" y="16" class="lg">{e(name)}</text>')
            x += 24 + 7 * len(name)
    for i, label in enumerate(labels):
        y0 = top + i * row_h
        short = label if len(label) <= 22 else label[:21] + "…"
        parts.append(
            f'<text x="{label_w - 6}" y="{y0 + row_h / 2 + 1}" text-anchor="end" class="lb">'
            f"<title>{e(label)}</title>{e(short)}</text>"
        )
        for j, (name, colour, vals) in enumerate(series):
            v = float(vals[i]) if i < len(vals) else 0.0
            w = max(0.0, v / vmax * plot_w)
            y = y0 + j * bar_h
            parts.append(
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{e(colour)}">'
                f"<title>{e(label)} {e(name)}: {e(fmt.format(v))}{e(unit)}</title></rect>"
            )
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 3}" class="vl">{e(fmt.format(v))}</text>')
    parts.append(f'<line x1="{label_w}" y1="{top - 2}" x2="{label_w}" y2="{height - 4}" stroke="#999"/>')
    parts.append("</svg>")
    more = len(list(series[0][2])) - len(labels) if series else 0
    note = f'<p class="note">first {len(labels)} rollouts shown</p>' if more > 0 else ""
    return f"<figure><figcaption>{e(title)}</figcaption>{''.join(parts)}{note}</figure>"


def stop_bar(stops: Counter[str], total: int) -> str:
    """One stacked bar of stop reasons (inline SVG) with a legend."""
    width, height = 600, 26
    x = 0.0
    parts = [f'<svg class="stack" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for reason, n in sorted(stops.items(), key=lambda kv: -kv[1]):
        w = n / max(1, total) * width
        colour = STOP_COLORS.get(reason, "#607d8b")
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{colour}">'
            f"<title>{e(reason)}: {n}</title></rect>"
        )
        if w > 40:
            parts.append(f'<text x="{x + 6:.1f}" y="17" class="in">{e(reason)} {n}</text>')
        x += w
    parts.append("</svg>")
    legend = " ".join(
        f'<span class="chip" style="background:{STOP_COLORS.get(k, "#607d8b")}">{e(k)}: {v}</span>'
        for k, v in sorted(stops.items())
    )
    return "".join(parts) + f'<div class="legend">{legend}</div>'


# ---------------------------------------------------------------------------- page


CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d2330;
 background:#f4f6fa;margin:0}
header{background:#1f2a44;color:#fff;padding:18px 28px}
header h1{margin:0 0 4px;font-size:22px}
header .sub{color:#c8d1e6;font-size:13px;word-break:break-all}
main{padding:18px 28px;max-width:1400px}
h2{font-size:18px;margin:26px 0 10px;border-bottom:2px solid #d5dbe7;padding-bottom:4px}
.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{background:#fff;border:1px solid #d5dbe7;border-radius:8px;padding:10px 16px;min-width:150px}
.card .k{color:#5b6478;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:24px;font-weight:600}
.card .v.good{color:#2e7d32}.card .v.bad{color:#c62828}
.chip{display:inline-block;color:#fff;border-radius:10px;padding:1px 9px;font-size:12px;margin:2px 3px 2px 0}
.legend{margin:6px 0}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure{background:#fff;border:1px solid #d5dbe7;border-radius:8px;margin:0;padding:10px 12px}
figcaption{font-weight:600;margin-bottom:6px}
svg text{font:11px system-ui,"DejaVu Sans",sans-serif;fill:#1d2330}
svg text.in{fill:#fff;font-weight:600}
svg text.vl{fill:#3a4256}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border:1px solid #d5dbe7;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#e9edf5;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#2e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}.na{color:#5b6478}
section.rollout{background:#fff;border:1px solid #d5dbe7;border-radius:8px;margin:16px 0;padding:10px 16px}
section.rollout h3{margin:4px 0 8px;font-size:16px}
.ev{border-left:4px solid #90a4ae;margin:10px 0;padding:4px 0 4px 12px}
.ev.root{border-color:#1565c0}.ev.cell{border-color:#2e7d32}.ev.batch{border-color:#ef6c00}
.ev .tag{font-weight:700;font-size:12px;text-transform:uppercase;letter-spacing:.05em}
.ev.root .tag{color:#1565c0}.ev.cell .tag{color:#2e7d32}.ev.batch .tag{color:#ef6c00}
pre{background:#0f1524;color:#e6e9ef;padding:8px 10px;border-radius:6px;overflow-x:auto;white-space:pre-wrap;
 word-break:break-word;margin:4px 0;font:12px/1.4 "DejaVu Sans Mono",Menlo,Consolas,monospace}
pre.out{background:#f0f2f6;color:#1d2330;border:1px solid #d5dbe7}
pre.small{max-height:260px;overflow:auto}
pre.code{max-height:480px;overflow:auto}
table.subcalls th.wide{width:34%}
details>summary{cursor:pointer;color:#2a4a8a}
.meta{color:#5b6478;font-size:12px}
.note{color:#5b6478;font-size:12px;margin:4px 0 0}
.err{background:#fdecea;border:1px solid #f5c2c0;color:#8a1c1c;padding:6px 10px;border-radius:6px}
"""


def _num(m: dict[str, Any], k: str) -> float:
    v = m.get(k, 0) or 0
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _fmt_seconds(s: Any) -> str:
    try:
        return f"{float(s):.2f} s"
    except (TypeError, ValueError):
        return "-"


def _correct_cell(c: bool | None) -> str:
    if c is None:
        return '<span class="na">–</span>'
    return '<span class="ok">✔ correct</span>' if c else '<span class="bad">✘ wrong</span>'


def _summary(rows: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[str, str]:
    n = len(rows)
    graded = [r for r in rows if r.get("correct") is not None]
    right = sum(1 for r in graded if r["correct"])
    acc_text = f"{right}/{len(graded)} = {right / len(graded):.1%}" if graded else "not graded"
    acc_cls = "" if not graded else ("good" if right == len(graded) else ("bad" if right * 2 < len(graded) else ""))
    tot = {k: sum(_num(r.get("metrics", {}), k) for r in rows) for k in (
        "sub_llm_call_count", "sub_llm_completion_tokens", "sub_llm_prompt_tokens", "main_rlm_prompt_tokens",
        "main_rlm_completion_tokens", "repl_total_time_seconds", "sub_llm_error_count", "sub_llm_rejected_count",
    )}  # fmt: skip
    cards = [
        ("accuracy", acc_text, acc_cls),
        ("rollouts", f"{n}", ""),
        ("errors", f"{sum(1 for r in rows if r.get('error'))}", "bad" if any(r.get("error") for r in rows) else ""),
        ("sub-LLM calls", f"{tot['sub_llm_call_count']:,.0f}", ""),
        ("sub-LLM completion tokens", f"{tot['sub_llm_completion_tokens']:,.0f}", ""),
        ("root tokens (prompt / completion)",
         f"{tot['main_rlm_prompt_tokens']:,.0f} / {tot['main_rlm_completion_tokens']:,.0f}", ""),
        ("REPL time", f"{tot['repl_total_time_seconds']:.2f} s", ""),
    ]  # fmt: skip
    if meta.get("seconds") is not None:
        cards.append(("wall time", f"{float(meta['seconds']):.1f} s", ""))
    if tot["sub_llm_error_count"] or tot["sub_llm_rejected_count"]:
        cards.append(
            ("sub-calls error / rejected", f"{tot['sub_llm_error_count']:.0f} / {tot['sub_llm_rejected_count']:.0f}",
             "bad"),
        )  # fmt: skip
    acc_id = ' id="accuracy"'
    html_cards = "".join(
        f'<div class="card"><div class="k">{e(k)}</div><div class="v {c}"{acc_id if k == "accuracy" else ""}>'
        f"{e(v)}</div></div>"
        for k, v, c in cards
    )
    return acc_text, html_cards


def _rollout_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "<tr><th>#</th><th>rollout</th><th>result</th><th>stop reason</th><th>final answer</th><th>expected</th>"
        "<th>root turns</th><th>sub-calls</th><th>sub completion tokens</th><th>REPL s</th></tr>"
    )
    body = []
    for i, r in enumerate(rows):
        m = r.get("metrics", {})
        stop = r.get("stop_reason", "")
        body.append(
            f'<tr><td class="num">{i + 1}</td><td><a href="#{rollout_dom_id(i)}">{e(r.get("id"))}</a></td>'
            f"<td>{_correct_cell(r.get('correct'))}</td>"
            f'<td><span class="chip" style="background:{STOP_COLORS.get(stop, "#607d8b")}">{e(stop)}</span></td>'
            f"<td>{e(cut(str(r.get('final_answer') or ''), 200))}</td><td>{e(r.get('answer') or '')}</td>"
            f'<td class="num">{_num(m, "main_rlm_turns"):.0f}</td>'
            f'<td class="num">{_num(m, "sub_llm_call_count"):.0f}</td>'
            f'<td class="num">{_num(m, "sub_llm_completion_tokens"):,.0f}</td>'
            f'<td class="num">{_num(m, "repl_total_time_seconds"):.2f}</td></tr>'
        )
    return f"<table>{head}{''.join(body)}</table>"


def _batch_html(ev: dict[str, Any]) -> str:
    prompts: list[str] = list(ev.get("prompts") or [])
    results: list[dict[str, Any]] = list(ev.get("results") or [])
    counts = Counter(str(r.get("status")) for r in results)
    head = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    rows = []
    for r in sorted(results, key=lambda x: int(x.get("index", 0))):
        idx = int(r.get("index", 0))
        status = str(r.get("status", ""))
        prompt = prompts[idx] if idx < len(prompts) else None
        first = (prompt or "").strip().splitlines()[0] if prompt and prompt.strip() else ""
        if prompt is None:
            prompt_html = '<span class="na">(prompt not kept)</span>'
        elif len(prompt) <= 160:
            prompt_html = f'<pre class="out small">{e(prompt)}</pre>'
        else:
            lead = first[:90] + ("…" if len(first) > 90 else "")
            prompt_html = (
                f"<details><summary>{e(lead)} ({len(prompt):,} chars)</summary>"
                f'<pre class="out small">{e(cut(prompt, MAX_PROMPT))}</pre></details>'
            )
        err = ""
        if status == "error":
            err = f'<div class="meta">{e(r.get("error_kind") or "")}: {e(cut(str(r.get("error") or ""), 500))}</div>'
        rows.append(
            f'<tr><td class="num">{idx}</td>'
            f'<td><span class="chip" style="background:{STATUS_COLORS.get(status, "#607d8b")}">{e(status)}</span></td>'
            f'<td class="num">{int(r.get("prompt_tokens", 0)):,} / {int(r.get("completion_tokens", 0)):,}</td>'
            f'<td class="num">{int(r.get("turns", 0))}</td>'
            f'<td class="num">{float(r.get("seconds", 0.0)):.2f}</td>'
            f'<td class="num">{float(r.get("queue_wait_seconds", 0.0)):.3f}</td>'
            f"<td>{prompt_html}</td>"
            f'<td><pre class="small">{e(cut(str(r.get("content", "")), MAX_TEXT))}</pre>{err}'
            f'<div class="meta">{e(r.get("worker") or "")}</div></td></tr>'
        )
    table = (
        '<table class="subcalls"><tr><th>#</th><th>status</th><th>tokens prompt / completion</th><th>turns</th>'
        '<th>seconds</th><th>queue wait s</th><th class="wide">prompt</th><th class="wide">sub-LLM answer</th></tr>'
        + "".join(rows)
        + "</table>"
    )
    more = ""
    if len(results) > len(prompts):
        more = f'<p class="note">{len(results) - len(prompts)} prompt(s) beyond the first {len(prompts)} not kept</p>'
    return (
        f'<div class="ev batch"><span class="tag">llm_batch {e(ev.get("batch_id", ""))}</span> '
        f'<span class="meta">{len(results)} prompt(s), {e(head)}, {_fmt_seconds(ev.get("seconds"))}</span>'
        f"{table}{more}</div>"
    )


def _trajectory_html(traj: list[dict[str, Any]]) -> str:
    out: list[str] = []
    pending: list[dict[str, Any]] = []  # batches run inside the next cell
    turn = 0
    for ev in traj:
        kind = ev.get("type")
        if kind == "llm_batch":
            pending.append(ev)
            continue
        if kind == "root":
            turn += 1
            usage = ev.get("usage") or {}
            content = str(ev.get("content") or "")
            calls = ev.get("tool_calls") or []
            body = f'<pre class="out">{e(cut(content, MAX_TEXT))}</pre>' if content.strip() else ""
            if not calls:
                body += '<div class="meta">(no tool call)</div>'
            out.append(
                f'<div class="ev root"><span class="tag">root turn {turn}</span> '
                f'<span class="meta">{int(usage.get("prompt", 0)):,} prompt / {int(usage.get("completion", 0)):,} '
                f"completion tokens, {_fmt_seconds(ev.get('seconds'))}"
                f"{', ' + str(len(calls)) + ' tool call(s)' if calls else ''}</span>{body}</div>"
            )
            continue
        if kind == "cell":
            flags = [f for f in ("timed_out", "restarted") if ev.get(f)]
            batches = "".join(_batch_html(b) for b in pending)
            pending = []
            out.append(
                f'<div class="ev cell"><span class="tag">REPL cell</span> '
                f'<span class="meta">{_fmt_seconds(ev.get("seconds"))}{" " + ", ".join(flags) if flags else ""}</span>'
                f'<pre class="code">{e(cut(str(ev.get("code", "")), MAX_TEXT))}</pre>{batches}'
                f'<div class="meta">output</div><pre class="out">{e(cut(str(ev.get("output", "")), MAX_TEXT))}</pre>'
                "</div>"
            )
            continue
        out.append(
            f'<div class="ev"><span class="tag">{e(kind)}</span>'
            f'<pre class="out">{e(cut(json.dumps(ev, default=str), MAX_TEXT))}</pre></div>'
        )
    out.extend(_batch_html(b) for b in pending)
    return "".join(out) or '<p class="na">(empty trajectory)</p>'


def render_report(results: Sequence[RolloutResult], meta: dict[str, Any]) -> str:
    """The whole ``report.html`` as a string (static: inline CSS and SVG, no script)."""
    rows = [r.row.model_dump() for r in results]
    ids = [str(r["id"]) for r in rows]
    acc_text, cards = _summary(rows, meta)
    stops: Counter[str] = Counter(str(r["stop_reason"]) for r in rows)
    metrics = [r.get("metrics", {}) for r in rows]
    charts = [
        bar_chart(
            "Sub-LLM completion tokens per rollout", ids,
            [("completion", "#ef6c00", [_num(m, "sub_llm_completion_tokens") for m in metrics])],
        ),
        bar_chart(
            "Root-model tokens per rollout", ids,
            [("prompt", "#90caf9", [_num(m, "main_rlm_prompt_tokens") for m in metrics]),
             ("completion", "#1565c0", [_num(m, "main_rlm_completion_tokens") for m in metrics])],
        ),
        bar_chart(
            "REPL time per rollout (seconds)", ids,
            [("REPL", "#2e7d32", [_num(m, "repl_total_time_seconds") for m in metrics])],
            unit=" s", fmt="{:.2f}",
        ),
    ]  # fmt: skip
    command = meta.get("command")
    command_text = " ".join(command) if isinstance(command, list) else str(command or "")
    started = meta.get("started")
    when = datetime.fromtimestamp(float(started), UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if started else ""
    sections = []
    for i, (res, row) in enumerate(zip(results, rows, strict=True)):
        err = f'<div class="err">{e(row["error"])}</div>' if row.get("error") else ""
        m = row.get("metrics", {})
        budget = ""
        if "sub_llm_budget_limit" in m:
            budget = (
                f" · sub-LLM budget: <b>{_num(m, 'sub_llm_budget_used'):,.0f}/{_num(m, 'sub_llm_budget_limit'):,.0f}"
                f"</b> completion tokens used, {_num(m, 'sub_llm_budget_rejections'):,.0f} rejected"
            )
        stop = row["stop_reason"]
        sections.append(
            f'<section class="rollout" id="{rollout_dom_id(i)}"><h3>{i + 1}. {e(row["id"])} '
            f"{_correct_cell(row.get('correct'))} "
            f'<span class="chip" style="background:{STOP_COLORS.get(stop, "#607d8b")}">{e(stop)}</span></h3>'
            f'<div class="meta">final answer: <b>{e(cut(str(row.get("final_answer") or ""), 500))}</b>'
            f" · expected: <b>{e(row.get('answer') or '–')}</b>{budget}</div>{err}"
            f"{_question_html(res)}{_trajectory_html(res.trajectory)}</section>"
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
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>rlmq report: {e(acc_text)}</title><style>{CSS}</style></head><body>"
        f'<header><h1>rlmq run report</h1><div class="sub">{e(when)} · {e(command_text)}</div></header><main>'
        f'{banner}<h2>Summary</h2><div class="cards">{cards}</div>'
        f"<h2>Stop reasons</h2>{stop_bar(stops, len(rows))}"
        f'<h2>Tokens and time</h2><div class="charts">{"".join(charts)}</div>'
        f"<h2>Rollouts</h2>{_rollout_table(rows)}"
        f"<h2>Trajectories</h2>{''.join(sections)}"
        f"<h2>Settings</h2><details><summary>settings of this run</summary><table>{settings_rows}</table></details>"
        '<p class="note">Full texts: rows.jsonl, trajectories.jsonl and meta.json in this folder.</p>'
        "</main></body></html>\n"
    )


def _question_html(res: RolloutResult) -> str:
    question = next((str(m.get("content")) for m in res.messages if m.get("role") == "user" and m.get("content")), None)
    if question is None:
        return ""
    return f'<div class="meta">question</div><pre class="out small">{e(cut(question, 2000))}</pre>'


def default_run_dir(command: str, root: str | Path = "runs", now: datetime | None = None) -> Path:
    """``runs/<UTC timestamp>-<command>`` (``20261122T062001Z-demo``)."""
    now = now or datetime.now(UTC)
    return Path(root) / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{command}"


def rows_of(results: Iterable[RolloutResult]) -> list[dict[str, Any]]:
    """The result rows (dicts) of ``results``."""
    return [r.row.model_dump() for r in results]
