"""A rollout's trajectory in the run report (:mod:`rlmq.cli.report`), its rollout tree included.

Root turns, REPL cells (with the ``llm_batch`` / ``rlm_batch`` calls they made inside) and any
other event, in order. An ``rlm_batch`` call shows each of its children as a collapsed
``<details>``: its summary line gives the child's depth, stop reason, turns, cells, sub-LLM calls
and tokens; opened, its task, its answer and its own trajectory, nested the same way. The
per-depth figures of a tree (:mod:`rlmq.producer.tree_metrics`) head the rollout.

The rendered size is bounded (:class:`TreeView`): at most :data:`MAX_CHILDREN_PER_BATCH`
children of one call, :data:`MAX_CHILD_TRAJECTORIES` children's trajectories per rollout,
:data:`MAX_CHILD_EVENTS` events of one child, trajectories down to depth
:data:`MAX_RENDER_DEPTH`, about :data:`MAX_TREE_CHARS` characters of children per rollout; each
cut says what was left out (the full tree is in ``trajectories.jsonl``). Everything from the run
is escaped; DOM ids are built from counters, never from run data.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlmq.cli.report_html import (
    DEFAULT_COLOR,
    MAX_PROMPT,
    MAX_TEXT,
    STATUS_COLORS,
    chip,
    cut,
    e,
    fmt_seconds,
    num,
    stop_chip,
)
from rlmq.producer.tree_metrics import PER_DEPTH, depth_key, number, tree_metrics

MAX_CHILDREN_PER_BATCH = 12
"""Children of one ``rlm_batch`` call shown (the rest are counted in a note)."""
MAX_CHILD_TRAJECTORIES = 60
"""Children per rollout whose trajectory is rendered (the others show their summary line only)."""
MAX_CHILD_EVENTS = 40
"""Events of one child's trajectory rendered."""
MAX_RENDER_DEPTH = 4
"""Deepest depth whose trajectories are rendered (deeper children: summary line only)."""
MAX_TREE_CHARS = 2_000_000
"""About this many characters of children's trajectories per rollout, then summary lines only."""
MAX_CHILD_TEXT = 3000
"""Cut length of texts inside children (the top rollout's own texts: ``MAX_TEXT``)."""
MAX_CHILD_BATCH_ROWS = 20
"""Rows of one ``llm_batch`` table inside a child (a top rollout's tables are whole)."""


@dataclass
class TreeView:
    """What may still be rendered of one rollout's tree.

    Attributes:
        prefix: the rollout's DOM id; children get ``f"{prefix}-n{k}"`` (in document order), the
            body of each (what opening it shows) ``f"{prefix}-n{k}-body"``.
        trajectories_left: children's trajectories that may still be rendered.
        chars_left: characters of children's trajectories that may still be rendered.
    """

    prefix: str
    trajectories_left: int = MAX_CHILD_TRAJECTORIES
    chars_left: int = MAX_TREE_CHARS
    ids: int = 0

    def new_id(self) -> str:
        """A fresh DOM id in this rollout."""
        self.ids += 1
        return f"{self.prefix}-n{self.ids}"


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _text_cut(depth: int) -> int:
    return MAX_TEXT if depth <= 1 else MAX_CHILD_TEXT


def _prompt_html(prompt: str | None, depth: int) -> str:
    if prompt is None:
        return '<span class="na">(prompt not kept)</span>'
    if len(prompt) <= 160:
        return f'<pre class="out small">{e(prompt)}</pre>'
    first = prompt.strip().splitlines()[0] if prompt.strip() else ""
    lead = first[:90] + ("…" if len(first) > 90 else "")
    return (
        f"<details><summary>{e(lead)} ({len(prompt):,} chars)</summary>"
        f'<pre class="out small">{e(cut(prompt, min(MAX_PROMPT, _text_cut(depth))))}</pre></details>'
    )


def _slot_row(r: dict[str, Any], prompt: str | None, depth: int) -> str:
    """One table row of a sub-call slot: status, tokens, turns, times, prompt, answer."""
    status = str(r.get("status", ""))
    err = ""
    if status == "error":  # the error text once: the answer slot often is that text already
        text = str(r.get("error") or "")
        detail = "" if not text or text in str(r.get("content", "")) else f": {e(cut(text, 500))}"
        err = f'<div class="meta">{e(r.get("error_kind") or "error")}{detail}</div>'
    return (
        f'<tr><td class="num">{number(r.get("index"))}</td>'
        f"<td>{chip(status, STATUS_COLORS.get(status, DEFAULT_COLOR))}</td>"
        f'<td class="num">{number(r.get("prompt_tokens")):,} / {number(r.get("completion_tokens")):,}</td>'
        f'<td class="num">{number(r.get("turns"))}</td>'
        f'<td class="num">{num(r, "seconds"):.2f}</td>'
        f'<td class="num">{num(r, "queue_wait_seconds"):.3f}</td>'
        f"<td>{_prompt_html(prompt, depth)}</td>"
        f'<td><pre class="small">{e(cut(str(r.get("content", "")), _text_cut(depth)))}</pre>{err}'
        f'<div class="meta">{e(r.get("worker") or "")}</div></td></tr>'
    )


def _slot_table(rows: list[str], answer: str = "sub-LLM answer") -> str:
    return (
        '<table class="subcalls"><tr><th>#</th><th>status</th><th>tokens prompt / completion</th><th>turns</th>'
        f'<th>seconds</th><th>queue wait s</th><th class="wide">prompt</th><th class="wide">{e(answer)}</th></tr>'
        + "".join(rows)
        + "</table>"
    )


def _texts(items: Any) -> list[str]:
    return [x if isinstance(x, str) else json.dumps(x, default=str) for x in items] if isinstance(items, list) else []


def batch_html(ev: dict[str, Any], depth: int = 1) -> str:
    """One ``llm_batch`` event: a table of its slots (inside a child: the first
    :data:`MAX_CHILD_BATCH_ROWS`)."""
    prompts = _texts(ev.get("prompts"))
    results = sorted(_dicts(ev.get("results")), key=lambda x: number(x.get("index")))
    counts = Counter(str(r.get("status")) for r in results)
    head = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    shown = results if depth <= 1 else results[:MAX_CHILD_BATCH_ROWS]
    rows = []
    for r in shown:
        idx = number(r.get("index"))
        rows.append(_slot_row(r, prompts[idx] if idx < len(prompts) else None, depth))
    more = ""
    if len(results) > len(prompts):
        more = f'<p class="note">{len(results) - len(prompts)} prompt(s) beyond the first {len(prompts)} not kept</p>'
    if len(shown) < len(results):
        more += f'<p class="cutnote">{len(results) - len(shown)} more sub-call(s) not shown here</p>'
    return (
        f'<div class="ev batch"><span class="tag">llm_batch {e(ev.get("batch_id", ""))}</span> '
        f'<span class="meta">{len(results)} prompt(s), {e(head)}, {fmt_seconds(ev.get("seconds"))}</span>'
        f"{_slot_table(rows)}{more}</div>"
    )


def _child_counts(child: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(root turns, REPL cells, sub-LLM calls, root completion tokens, child rollouts) of a child:
    the first four from its metrics, else counted from its trajectory (sub-LLM calls as
    :mod:`~rlmq.producer.tree_metrics` counts them); its own children from its trajectory."""
    m = child["metrics"] if isinstance(child.get("metrics"), dict) else {}
    traj = _dicts(child.get("trajectory"))
    kinds = Counter(ev.get("type") for ev in traj)

    def pick(key: str, fallback: int) -> int:
        return number(m[key]) if key in m else fallback

    slots = [
        (ev.get("type"), r)
        for ev in traj
        if ev.get("type") in ("llm_batch", "rlm_batch")
        for r in _dicts(ev.get("results"))
    ]
    kids = sum(1 for kind, r in slots if kind == "rlm_batch" and isinstance(r.get("child"), dict))
    usages = [ev.get("usage") for ev in traj if ev.get("type") == "root"]
    tokens = sum(number(u.get("completion")) for u in usages if isinstance(u, dict))
    return (
        pick("main_rlm_turns", kinds["root"]),
        pick("repl_call_count", kinds["cell"]),
        pick("sub_llm_call_count", len(slots) - kids),
        pick("main_rlm_completion_tokens", tokens),
        kids,
    )


def _child_html(r: dict[str, Any], task: str | None, depth: int, view: TreeView) -> str:
    """One child rollout (a result with ``child``) as a collapsed ``<details>``."""
    child: dict[str, Any] = r["child"]
    dom_id = view.new_id()
    turns, cells, calls, tokens, kids = _child_counts(child)
    first = (task or "").strip().splitlines()[0] if task and task.strip() else ""
    lead = first[:80] + ("…" if len(first) > 80 else "")
    summary = (
        f'<summary><span class="tag">child {number(r.get("index"))}</span> depth {depth} '
        f"{stop_chip(child.get('stop_reason', ''))} {turns} turn(s) · {cells} cell(s) · {calls} sub-call(s) · "
        f"{tokens:,} root completion tokens{f' · {kids} child rollout(s)' if kids else ''} · "
        f"{fmt_seconds(r.get('seconds'))}"
        f"{' · ' + e(lead) if lead else ''}</summary>"
    )
    status = str(r.get("status", ""))
    body = [
        f'<div class="meta">task</div>{_prompt_html(task, depth)}',
        f'<div class="meta">answer {chip(status, STATUS_COLORS.get(status, DEFAULT_COLOR))}</div>'
        f'<pre class="small">{e(cut(str(r.get("content", "")), MAX_CHILD_TEXT))}</pre>',
        f'<div class="meta">rollout {e(child.get("rollout_id", ""))} · worker {e(r.get("worker") or "")} · '
        f"attempt {number(r.get('attempt'))}</div>",
    ]
    traj = _dicts(child.get("trajectory"))
    dropped = number(child.get("trajectory_cut"))
    if dropped and not traj:  # its parent's allowance of child trajectories was spent
        body.append(
            f'<p class="cutnote">{dropped:,} event(s) of this child were not kept: its parent\'s allowance '
            "of child trajectories was spent (docs/recursion.md, Bounds)</p>"
        )
    elif depth > MAX_RENDER_DEPTH:
        body.append(
            f'<p class="cutnote">{len(traj)} event(s) of depth {depth} not rendered (deeper than '
            f"{MAX_RENDER_DEPTH}); see trajectories.jsonl</p>"
        )
    elif view.trajectories_left <= 0 or view.chars_left <= 0:
        body.append(
            f'<p class="cutnote">{len(traj)} event(s) not rendered: this rollout\'s tree passed the '
            "report's size limit; see trajectories.jsonl</p>"
        )
    else:
        view.trajectories_left -= 1
        body.append(trajectory_html(traj[:MAX_CHILD_EVENTS], depth=depth, view=view))
        if len(traj) > MAX_CHILD_EVENTS:
            body.append(
                f'<p class="cutnote">{len(traj) - MAX_CHILD_EVENTS} later event(s) of this child not '
                "rendered; see trajectories.jsonl</p>"
            )
    return (
        f'<details class="child" id="{dom_id}">{summary}<div class="kid" id="{dom_id}-body">{"".join(body)}</div>'
        "</details>"
    )


def rlm_batch_html(ev: dict[str, Any], depth: int, view: TreeView) -> str:
    """One ``rlm_batch`` event of a rollout at ``depth``: its children (collapsed, the first
    :data:`MAX_CHILDREN_PER_BATCH`), then its slots that no child answered (plain calls at
    ``max_depth``, refusals, failures) as a table."""
    tasks = _texts(ev.get("tasks"))
    results = sorted(_dicts(ev.get("results")), key=lambda x: number(x.get("index")))
    kids = [r for r in results if isinstance(r.get("child"), dict)]
    plain = [r for r in results if not isinstance(r.get("child"), dict)]
    counts = Counter(str(r.get("status")) for r in results)
    head = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))

    def task_of(r: dict[str, Any]) -> str | None:
        idx = number(r.get("index"))
        return tasks[idx] if idx < len(tasks) else None

    parts = [_child_html(r, task_of(r), depth + 1, view) for r in kids[:MAX_CHILDREN_PER_BATCH]]
    if len(kids) > MAX_CHILDREN_PER_BATCH:
        rest = Counter(str(r["child"].get("stop_reason", "")) for r in kids[MAX_CHILDREN_PER_BATCH:])
        stops = ", ".join(f"{v} {k}" for k, v in sorted(rest.items()))
        parts.append(
            f'<p class="cutnote">{len(kids) - MAX_CHILDREN_PER_BATCH} more child rollout(s) of this call not shown '
            f"({e(stops)}); see trajectories.jsonl</p>"
        )
    if plain:
        shown = plain[: max(MAX_CHILD_BATCH_ROWS, MAX_CHILDREN_PER_BATCH)]
        parts.append(_slot_table([_slot_row(r, task_of(r), depth) for r in shown], "answer (no child rollout)"))
        if len(shown) < len(plain):
            parts.append(f'<p class="cutnote">{len(plain) - len(shown)} more slot(s) without a child not shown</p>')
    if len(results) > len(tasks):
        parts.append(f'<p class="note">{len(results) - len(tasks)} task(s) beyond the first {len(tasks)} not kept</p>')
    return (
        f'<div class="ev rlm"><span class="tag">rlm_batch {e(ev.get("batch_id", ""))}</span> '
        f'<span class="meta">{len(results)} task(s): {len(kids)} child rollout(s) at depth {depth + 1}, {e(head)}, '
        f"{fmt_seconds(ev.get('seconds'))}</span>{''.join(parts)}</div>"
    )


def trajectory_html(traj: list[dict[str, Any]], *, depth: int = 1, view: TreeView | None = None) -> str:
    """A rollout's trajectory at ``depth`` (1: a top rollout) as HTML; ``view`` bounds its tree
    (inside children, each piece rendered is charged to ``view.chars_left``; when it is spent,
    the rest of the child is left out with a note)."""
    view = view if view is not None else TreeView("rollout")
    size = _text_cut(depth)
    out: list[str] = []
    pending: list[dict[str, Any]] = []  # batches run inside the next cell

    def charge(piece: str) -> str:
        if depth > 1:
            view.chars_left -= len(piece)
        return piece

    def calls(evs: list[dict[str, Any]]) -> str:
        return "".join(
            rlm_batch_html(b, depth, view) if b.get("type") == "rlm_batch" else charge(batch_html(b, depth))
            for b in evs
        )

    turn = 0
    events = _dicts(traj)
    for n, ev in enumerate(events):
        if depth > 1 and view.chars_left <= 0:
            out.append(
                f'<p class="cutnote">{len(events) - n} more event(s) of this child not rendered: this rollout\'s '
                "tree passed the report's size limit; see trajectories.jsonl</p>"
            )
            pending = []
            break
        kind = ev.get("type")
        if kind in ("llm_batch", "rlm_batch"):
            pending.append(ev)
            continue
        if kind == "root":
            turn += 1
            usage = ev["usage"] if isinstance(ev.get("usage"), dict) else {}
            content = str(ev.get("content") or "")
            tool_calls = ev["tool_calls"] if isinstance(ev.get("tool_calls"), list) else []
            body = f'<pre class="out">{e(cut(content, size))}</pre>' if content.strip() else ""
            if not tool_calls:
                body += '<div class="meta">(no tool call)</div>'
            out.append(
                charge(
                    f'<div class="ev root"><span class="tag">root turn {turn}</span> '
                    f'<span class="meta">{number(usage.get("prompt")):,} prompt / '
                    f"{number(usage.get('completion')):,} completion tokens, {fmt_seconds(ev.get('seconds'))}"
                    f"{', ' + str(len(tool_calls)) + ' tool call(s)' if tool_calls else ''}</span>{body}</div>"
                )
            )
            continue
        if kind == "cell":
            flags = [f for f in ("timed_out", "restarted") if ev.get(f)]
            code = charge(f'<pre class="code">{e(cut(str(ev.get("code", "")), size))}</pre>')
            output = charge(f'<pre class="out">{e(cut(str(ev.get("output", "")), size))}</pre>')
            batches, pending = calls(pending), []
            out.append(
                f'<div class="ev cell"><span class="tag">REPL cell</span> '
                f'<span class="meta">{fmt_seconds(ev.get("seconds"))}{" " + ", ".join(flags) if flags else ""}</span>'
                f'{code}{batches}<div class="meta">output</div>{output}</div>'
            )
            continue
        out.append(
            charge(
                f'<div class="ev"><span class="tag">{e(kind)}</span>'
                f'<pre class="out">{e(cut(json.dumps(ev, default=str), size))}</pre></div>'
            )
        )
    out.append(calls(pending))
    return "".join(out) or '<p class="na">(empty trajectory)</p>'


def depth_table_html(metrics: dict[str, Any], trajectory: list[dict[str, Any]]) -> str:
    """The per-depth figures of a rollout that started children (``""`` when it started none):
    from its row's metrics, or computed from its trajectory for a row without them."""
    m: dict[str, Any] = metrics if "tree_rollout_count" in metrics else tree_metrics(trajectory, metrics)
    if not number(m.get("rlm_call_count")):
        return ""
    rows = []
    d = 1
    while depth_key(d, "rollouts") in m:
        cells = "".join(f'<td class="num">{number(m.get(depth_key(d, name))):,}</td>' for name in PER_DEPTH)
        rows.append(f'<tr><td class="num">{d}</td>{cells}</tr>')
        d += 1
    totals = ("tree_rollout_count", "tree_root_turns", "tree_root_completion_tokens", "tree_sub_llm_call_count",
              "tree_sub_llm_completion_tokens")  # fmt: skip
    total = "".join(f'<td class="num">{number(m.get(k)):,}</td>' for k in totals)
    return (
        '<table class="depths"><tr><th>depth</th><th>rollouts</th><th>root turns</th><th>root completion tokens</th>'
        "<th>sub-LLM calls</th><th>sub-LLM completion tokens</th></tr>"
        f"{''.join(rows)}<tr><th>tree</th>{total}</tr></table>"
        f'<div class="meta">rlm_batch: {number(m.get("rlm_call_count")):,} task(s) in '
        f"{number(m.get('rlm_batch_count')):,} call(s), {number(m.get('rlm_call_failed_count')):,} failed or refused; "
        f"charged to the tree's budget: {number(m.get('tree_charged_completion_tokens')):,} completion tokens</div>"
    )


MAX_OUTLINE_NODES = 150
"""Child rollouts listed in one rollout's tree outline (the rest are counted in a note)."""


def tree_outline_html(trajectory: list[dict[str, Any]]) -> str:
    """A rollout's tree at a glance (``""`` when it started no child): one line per child rollout,
    nested under its parent, with its depth, stop reason, answer, sub-calls, the completion tokens
    its subtree charged and its own children. At most :data:`MAX_OUTLINE_NODES` lines (a note
    counts the rest); everything from the run is escaped."""
    shown = 0
    left_out = 0

    def level(traj: list[dict[str, Any]], depth: int) -> str:
        nonlocal shown, left_out
        items: list[str] = []
        for ev in _dicts(traj):
            if ev.get("type") != "rlm_batch":
                continue
            for r in sorted(_dicts(ev.get("results")), key=lambda x: number(x.get("index"))):
                child = r.get("child")
                if not isinstance(child, dict):
                    continue
                if shown >= MAX_OUTLINE_NODES:
                    left_out += 1
                    continue
                shown += 1
                m = child["metrics"] if isinstance(child.get("metrics"), dict) else {}
                calls = number(m.get("tree_sub_llm_call_count", m.get("sub_llm_call_count")))
                charged = number(m.get("tree_charged_completion_tokens"))
                answer = cut(str(r.get("content", "")).strip(), 80).splitlines()[0] if r.get("content") else ""
                below = level(_dicts(child.get("trajectory")), depth + 1)
                items.append(
                    f'<li><span class="tag">child {number(r.get("index"))}</span> depth {depth + 1} '
                    f"{stop_chip(child.get('stop_reason', ''))} answer <b>{e(answer or '–')}</b> · "
                    f"{calls:,} sub-call(s) · {charged:,} tokens charged{below}</li>"
                )
        return f"<ul>{''.join(items)}</ul>" if items else ""

    body = level(trajectory, 1)
    if not body:
        return ""
    note = f'<p class="cutnote">{left_out} more child rollout(s) not listed</p>' if left_out else ""
    return (
        f'<details class="outline" open><summary>tree: {shown + left_out} child rollout(s)</summary>'
        f'<div class="tree">{body}</div>{note}</details>'
    )
