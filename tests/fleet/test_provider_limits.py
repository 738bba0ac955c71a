"""Fleet-wide provider limits against a provider with a hard quota (the scripted model answers 429
past 30 requests per 1.5 s, counting every caller), driven by three worker processes: with the
limits declared (one worker's clock 15 s ahead), the fleet uses >= 90 % of the quota and almost
never hears a 429; the same fleet
without them (each worker retrying its own 429s, as before) is measured in the same test."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fleet.harness import log_text
from tests.fleet.provider import provider_run

pytestmark = pytest.mark.e2e


async def test_three_workers_share_a_providers_quota_without_its_429s(redis_url: str, tmp_path: Any) -> None:
    logs = str(tmp_path / "logs")
    common: dict[str, Any] = {"rpm": 30, "window": 1.5, "workers": 3, "rollouts": 3, "calls": 50, "log_dir": logs}
    # one of the three workers' clocks runs 15 s ahead: the limits count by Redis's clock, not theirs
    limited = await provider_run(redis_url, limited=True, skewed=15, **common)
    today = await provider_run(redis_url, limited=False, **common)
    summary = {"limited": limited.summary(), "today": today.summary()}
    print(summary)
    out = limited.outcome
    text = log_text(logs)
    assert "clock is +15" in text  # the skewed worker was really skewed, and said so
    assert (out.slots, out.lost, out.duplicated, out.overshoot) == (150, 0, 0, 0), (summary, text[-3000:])
    assert limited.share >= 0.9, summary
    assert limited.refused <= 0.01 * (limited.accepted + limited.refused), summary
    # before: every worker retried its own 429s: the provider refused many, and some calls were lost
    assert today.refused >= 0.5 * today.accepted, summary
