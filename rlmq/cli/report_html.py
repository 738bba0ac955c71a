"""HTML building blocks of the run report (:mod:`rlmq.cli.report`): escaping, cutting, the page's
CSS and its inline-SVG charts.

Everything taken from a run goes through :func:`e` (``html.escape``, quotes too): a hostile
model writes much of what the report shows.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from typing import Any

# Cut lengths in the HTML report (characters); the run folder's JSONL files keep everything.
MAX_PROMPT = 4000
MAX_TEXT = 12000
MAX_CHART_ROWS = 60
DEFAULT_COLOR = "#607d8b"

STOP_COLORS = {
    "answer_ready": "#2e7d32", "max_turns": "#ef6c00", "no_tool_call": "#6a1b9a", "prompt_too_long": "#ad1457",
    "code_timeout": "#00838f", "error": "#c62828", "budget_spent": "#6d4c41",
}  # fmt: skip
STATUS_COLORS = {"ok": "#2e7d32", "rejected": "#ef6c00", "error": "#c62828"}


def e(x: Any) -> str:
    """``html.escape`` of ``str(x)`` (quotes too)."""
    return html.escape("" if x is None else str(x), quote=True)


def cut(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with a visible marker."""
    if len(text) <= n:
        return text
    return text[:n] + f"\n… [{len(text) - n:,} more characters in trajectories.jsonl]"


def chip(text: Any, colour: str) -> str:
    """A coloured label; ``colour`` is one of this module's constants (never run data)."""
    return f'<span class="chip" style="background:{colour}">{e(text)}</span>'


def stop_chip(stop: Any) -> str:
    """The chip of a stop reason, coloured by :data:`STOP_COLORS`."""
    return chip(stop, STOP_COLORS.get(str(stop), DEFAULT_COLOR))


def num(m: Any, k: str) -> float:
    """``m[k]`` as a float; 0.0 when ``m`` is no dict or the value is missing or not a number."""
    v = m.get(k, 0) if isinstance(m, dict) else 0
    try:
        return float(v or 0)
    except (TypeError, ValueError):
        return 0.0


def fmt_seconds(s: Any) -> str:
    """``"1.23 s"``, or ``"-"`` when ``s`` is not a number."""
    try:
        return f"{float(s):.2f} s"
    except (TypeError, ValueError):
        return "-"


def correct_cell(c: bool | None) -> str:
    """The result mark of a graded (or ungraded, ``None``) rollout."""
    if c is None:
        return '<span class="na">–</span>'
    return '<span class="ok">✔ correct</span>' if c else '<span class="bad">✘ wrong</span>'


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
    """One stacked bar of stop reasons (inline SVG); each count is written once: inside its
    segment, or in a legend below for a segment too narrow to hold it."""
    width, height = 600, 26
    x = 0.0
    parts = [f'<svg class="stack" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    narrow: list[tuple[str, int]] = []
    for reason, n in sorted(stops.items(), key=lambda kv: -kv[1]):
        w = n / max(1, total) * width
        colour = STOP_COLORS.get(reason, DEFAULT_COLOR)
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{colour}">'
            f"<title>{e(reason)}: {n}</title></rect>"
        )
        label = f"{reason} {n}"
        if w > 8 + 7 * len(label):  # the label fits inside its segment
            parts.append(f'<text x="{x + 6:.1f}" y="17" class="in">{e(label)}</text>')
        else:
            narrow.append((reason, n))
        x += w
    parts.append("</svg>")
    legend = " ".join(
        f'<span class="chip" style="background:{STOP_COLORS.get(k, DEFAULT_COLOR)}">{e(k)}: {v}</span>'
        for k, v in sorted(narrow)
    )
    return "".join(parts) + (f'<div class="legend">{legend}</div>' if legend else "")


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
.ev.rlm{border-color:#6a1b9a}.ev.rlm>.tag{color:#6a1b9a}
details.child{border:1px solid #d9c8e6;border-left:4px solid #6a1b9a;border-radius:6px;margin:6px 0;background:#fbf8fd}
details.child>summary{padding:4px 8px;color:#1d2330}
details.child>summary .tag{color:#6a1b9a;font-weight:700;font-size:12px;text-transform:uppercase}
details.child>.kid{padding:2px 10px 8px 14px;background:#fff}
details.traj{border:1px solid #d5dbe7;border-radius:6px;margin:8px 0;background:#fff}
details.traj>summary{padding:6px 10px;font-weight:600}
details.outline{margin:8px 0}
.tree ul{list-style:none;margin:0;padding-left:18px;border-left:2px solid #d9c8e6}
.tree>ul{padding-left:6px}
.tree li{margin:3px 0;font-size:13px}
.tree .tag{color:#6a1b9a;font-weight:700;font-size:12px;text-transform:uppercase}
.cutnote{color:#8a4b00;font-size:12px;margin:4px 0}
table.depths{width:auto;margin:6px 0}
"""
