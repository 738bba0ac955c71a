"""The rollout tree in the HTML report: nesting, per-depth figures, bounds, escaping
(rlmq/cli/report_trajectory.py); the browser test of it is tests/e2e/test_report_browser.py."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from rlmq.cli import report_trajectory as rt
from rlmq.cli.report import render_report, write_run
from rlmq.common.schemas import ResultRow
from rlmq.producer.env import RolloutResult
from rlmq.producer.tree_metrics import tree_metrics
from tests.trees import cell, child, hostile_tree, leaf, llm_batch, rlm_batch, root, sub, three_levels

EVIL = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">\"'&"


class Tree(HTMLParser):
    """Tags, attributes, and the nesting depth of each ``details.child``."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.stack: list[bool] = []  # per open <details>: is it a child
        self.child_levels: list[int] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += attrs
        if tag == "details":
            is_child = ("class", "child") in attrs
            self.stack.append(is_child)
            if is_child:
                self.child_levels.append(sum(self.stack))
                self.ids += [v or "" for k, v in attrs if k == "id"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.stack.pop()


def parse(page: str) -> Tree:
    t = Tree()
    t.feed(page)
    return t


def result(traj: list[dict[str, Any]], rid: str = "q-1") -> RolloutResult:
    metrics: dict[str, float | int] = {"main_rlm_turns": 2}
    metrics.update(tree_metrics(traj, {}))
    row = ResultRow(id=rid, final_answer="a", answer="a", correct=True, stop_reason="answer_ready", metrics=metrics)
    return RolloutResult(row=row, trajectory=traj, messages=[{"role": "user", "content": "q"}])


def report(tmp_path: Path, *trajs: list[dict[str, Any]]) -> str:
    folder = write_run(tmp_path / "run", [result(t, f"q-{i}") for i, t in enumerate(trajs)], {"command": "t"})
    return (folder / "report.html").read_text(encoding="utf-8")


def test_three_levels_nest_and_the_depth_table_heads_the_rollout(tmp_path: Path) -> None:
    page = report(tmp_path, three_levels())
    tree = parse(page)
    assert sorted(tree.child_levels) == [1, 1, 2, 2, 2, 2]  # 2 children at depth 2, 4 at depth 3 inside them
    assert all(re.fullmatch(r"rollout-0-n\d+", i) for i in tree.ids) and len(set(tree.ids)) == 6
    assert page.count("rlm_batch b2") == 3 and "child rollout(s) at depth 3" in page
    assert 'class="depths"' in page
    # depth 3: 4 rollouts, 8 root turns, 120 root completion tokens, 8 sub-LLM calls, 28 tokens
    assert re.search(r'<td class="num">3</td><td class="num">4</td><td class="num">8</td>'
                     r'<td class="num">120</td><td class="num">8</td><td class="num">28</td>', page)  # fmt: skip
    assert "charged to the tree's budget: 225 completion tokens" in page
    # the summary cards count the tree
    assert "rlm_batch tasks / child rollouts" in page and "9 / 6" in page
    # a child's summary line: depth, stop reason, turns, cells, calls
    assert re.search(r"child 0</span> depth 3 <span class=\"chip\"[^>]*>answer_ready</span> 2 turn\(s\) · "
                     r"1 cell\(s\) · 2 sub-call\(s\)", page)  # fmt: skip
    # a depth-2 child: its error slot is a sub-call, its two children are counted
    mid = r"child 1</span> depth 2 <span class=\"chip\"[^>]*>answer_ready</span> 1 turn\(s\) · 1 cell\(s\) · "
    assert re.search(mid + r"1 sub-call\(s\) · 30 root completion tokens · 2 child rollout\(s\)", page)
    # slots no child answered are a table under the call
    assert "answer (no child rollout)" in page and "deadline" in page


def test_a_rollout_without_children_has_no_tree(tmp_path: Path) -> None:
    page = report(tmp_path, [root(3), llm_batch(1), cell(), root(4)])
    assert 'class="depths"' not in page and 'class="child"' not in page and "rlm_batch tasks" not in page


def test_hostile_strings_in_the_tree_are_inert(tmp_path: Path) -> None:
    page = report(tmp_path, hostile_tree(EVIL))
    tree = parse(page)
    assert "script" not in tree.tags and "img" not in tree.tags
    assert not [k for k, _ in tree.attrs if k.startswith("on")]
    assert "pwned" not in "".join(v or "" for _, v in tree.attrs)
    assert "&lt;script&gt;" in page and "<script" not in page and "<img" not in page
    assert sorted(tree.child_levels) == [1, 2]
    for text in ("DEEP-MARK", "leaf answer", "mid answer", "task2", "task3", "gone", "mid output"):
        assert text + " &lt;script&gt;" in page, text
    assert "Content-Security-Policy" in page and "default-src &#x27;none&#x27;" in page


def test_a_wide_batch_shows_the_first_children_and_says_how_many_more(tmp_path: Path) -> None:
    kids = [child(i, 2, [root(1)], stop="max_turns" if i % 2 else "answer_ready") for i in range(30)]
    page = report(tmp_path, [root(1), rlm_batch(kids), cell()])
    assert len(parse(page).child_levels) == rt.MAX_CHILDREN_PER_BATCH
    assert "18 more child rollout(s) of this call not shown (9 answer_ready, 9 max_turns)" in page


def test_a_deep_tree_is_rendered_down_to_the_limit(tmp_path: Path) -> None:
    traj: list[dict[str, Any]] = [root(1), cell("DEEPEST")]
    for d in range(7, 1, -1):
        traj = [root(1), rlm_batch([child(0, d, traj)]), cell(f"IN-DEPTH-{d - 1}")]
    page = report(tmp_path, traj)
    # children down to depth 5 have their summary line; the depth-5 child's trajectory (and the
    # children in it) is not rendered
    assert parse(page).child_levels == [1, 2, 3, 4]
    assert "IN-DEPTH-4" in page and "IN-DEPTH-5" not in page and "DEEPEST" not in page
    assert "event(s) of depth 5 not rendered (deeper than 4)" in page


def test_a_big_tree_stays_within_the_size_limit(tmp_path: Path) -> None:
    big = "x" * 5000
    grand = [child(j, 3, [root(1, content=big), llm_batch(*[1] * 30), cell(big, big)] * 20) for j in range(12)]
    kids = [child(i, 2, [root(1), rlm_batch(grand), cell(big, big)]) for i in range(12)]
    page = render_report([result([root(1), rlm_batch(kids), cell()])], {})
    # every depth-2 child has its summary line; trajectories (and the children in them) only up to the limit
    levels = parse(page).child_levels
    assert levels.count(1) == 12 and 0 < levels.count(2) < 12 * 12
    assert rt.MAX_TREE_CHARS < len(page) < rt.MAX_TREE_CHARS + 500_000
    assert "passed the report's size limit" in page and "later event(s) of this child not rendered" in page
    assert "more sub-call(s) not shown here" in page


def test_tasks_cut_short_and_children_without_trajectories(tmp_path: Path) -> None:
    batch = rlm_batch([leaf(0), child(1, 3, []), sub(2, 1, "rejected")], tasks=["only the first"])
    page = report(tmp_path, [root(1), batch, cell()])
    assert "2 task(s) beyond the first 1 not kept" in page
    assert page.count("(prompt not kept)") == 2 and "(empty trajectory)" in page


def test_rows_without_tree_figures_get_them_from_their_trajectory() -> None:
    html = rt.depth_table_html({"main_rlm_turns": 2}, three_levels())
    assert '<td class="num">3</td><td class="num">4</td>' in html and "9 task(s) in 3 call(s)" in html
    assert rt.depth_table_html({}, [root(1)]) == ""


def test_a_child_whose_trajectory_was_not_kept_says_so_and_a_cut_event_is_shown() -> None:
    kid = child(0, 2, [root(1)])
    kid["child"] = dict(kid["child"], trajectory=[], trajectory_cut=1234)
    cut_event = {"type": "cut", "events_dropped": 7, "events_stubbed": 0, "chars": 9_000_000, "max_chars": 4_000_000}
    html = rt.trajectory_html([rlm_batch([kid, child(1, 2, [root(1), cut_event])]), cell()])
    assert "1,234 event(s) of this child were not kept" in html and "(empty trajectory)" not in html
    assert "events_dropped" in html and "9000000" in html
