"""The HTML report of real rollouts, rendered by a real headless browser (Debian's chromium).

Not only parsed: chromium lays the page out and paints it, the screenshot must be a page
with content (many colours, plenty of non-white), and the DOM chromium built must carry
the accuracy and the rollout ids.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet
from rlmq.cli.report import write_run
from rlmq.common.schemas import DatasetRow, ResultRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv, RolloutResult
from rlmq.producer.tree_metrics import tree_metrics
from tests.trees import hostile_tree

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
INSTALL = "apt-get update && apt-get install -y chromium"


def chromium(args: list[str], profile: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} not found: this test needs Debian's chromium. Install it with: {INSTALL}")
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


async def test_report_of_real_rollouts_renders_in_headless_chromium(fleet: LocalFleet, tmp_path: Path) -> None:
    rows = [DatasetRow.model_validate(r) for r in needle_rows(2, min_chars=60_000, seed=3)]
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    started = time.time()
    async with RLMEnv(settings=settings, sub_llm_max_completion_tokens=4000, sub_llm_per_call_max_tokens=256) as env:
        results = await env.evaluate(rows, model=fleet.model, concurrency=2)
    assert all(r.row.correct for r in results), [r.row for r in results]
    meta = {
        "command": ["rlmq", "test-report"],
        "settings": settings.model_dump(mode="json"),
        "started": started,
        "finished": time.time(),
    }
    folder = write_run(tmp_path / "run", results, meta)
    report = folder / "report.html"
    url = report.resolve().as_uri()

    png = tmp_path / "report.png"
    shot = chromium([f"--screenshot={png}", "--window-size=1280,2000", url], tmp_path / "profile-shot")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.exists() and png.stat().st_size > 10_000, shot.stderr[-2000:]
    with Image.open(png) as im:
        assert im.size == (1280, 2000)
        rgb = im.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 22)
    assert colours is not None
    assert len(colours) >= 200, f"only {len(colours)} distinct colours: a blank or broken page"
    total = 1280 * 2000
    white = sum(n for n, c in colours if min(c) >= 245)
    assert (total - white) / total > 0.15, f"{(total - white) / total:.1%} non-white: the page looks empty"
    # the dark header bar and the green bars of the charts were painted
    assert sum(n for n, c in colours if max(c) < 70) > 1280 * 40
    assert sum(n for n, (r, g, b) in colours if g > r + 40 and g > b + 40) > 2000

    dom = chromium(["--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="accuracy">2/2 = 100.0%' in html
    for r in results:
        assert r.row.id in html
    assert "llm_batch b1" in html and "REPL cell" in html and "root turn 1" in html
    assert html.count("<svg") >= 4


def test_a_rollout_tree_expands_in_chromium_and_hostile_strings_stay_text(tmp_path: Path) -> None:
    """A 3-level tree (top -> child -> grandchild) with a hostile string in every text a model writes.

    Closed, no child is open; navigating to the grandchild's body makes chromium open both
    ``<details>`` above it (the browser's own revealing of a fragment's target); the hostile
    strings are text in the DOM chromium built: no script ran (the title is the report's), no
    element was injected.
    """
    evil = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
    traj = hostile_tree(evil)
    metrics: dict[str, float | int] = {"main_rlm_turns": 1, **tree_metrics(traj, {})}
    row = ResultRow(
        id="tree-1", final_answer="a", answer="a", correct=True, stop_reason="answer_ready", metrics=metrics
    )
    folder = write_run(tmp_path / "run", [RolloutResult(row=row, trajectory=traj)], {"command": "t"})
    url = (folder / "report.html").resolve().as_uri()

    def dom(fragment: str, profile: str) -> tuple[str, Counter[str], dict[str, bool]]:
        out = chromium(["--dump-dom", url + fragment], tmp_path / profile)
        assert out.returncode == 0, out.stderr[-2000:]
        tags = DomTags()
        tags.feed(out.stdout)
        return out.stdout, tags.tags, tags.child_open

    closed, tags, child_open = dom("", "profile-closed")
    assert list(child_open) == ["rollout-0-n1", "rollout-0-n2"]  # the child (depth 2), the grandchild (depth 3)
    assert not any(child_open.values())
    assert tags["script"] == 0 and tags["img"] == 0
    assert "<title>rlmq report: 1/1 = 100.0%</title>" in closed and "pwned</title>" not in closed
    assert "DEEP-MARK &lt;script&gt;document.title='pwned'&lt;/script&gt;&lt;img" in closed

    opened, tags, child_open = dom("#rollout-0-n2-body", "profile-open")
    assert child_open == {"rollout-0-n1": True, "rollout-0-n2": True}
    assert tags["script"] == 0 and tags["img"] == 0 and "pwned</title>" not in opened


class DomTags(HTMLParser):
    """Counts of the elements of a DOM, and whether each ``details.child`` is open."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.child_open: dict[str, bool] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        a = dict(attrs)
        if tag == "details" and a.get("class") == "child":
            self.child_open[a.get("id") or ""] = "open" in a
