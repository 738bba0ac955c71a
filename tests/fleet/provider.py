"""The main job against a provider with a hard quota (the scripted model's ``--quota-*``), driven
by several worker processes with or without the fleet-wide provider limits.

:func:`provider_run` counts what the provider saw (its own ``/stats``): requests it accepted, the
429s it answered, and the share of its requests-per-window limit used while the fleet had work:
the requests accepted in the whole windows from the first accepted request while the fleet still
had work, over what the limit allows in them (:func:`rpm_share`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlmq.cli.local import LocalFleet, ProcessGroup, start_mock_llm
from tests.fleet.harness import Outcome, main_job, model_stats, skewed_env


@dataclass
class ProviderRun:
    """What :func:`provider_run` measured."""

    limited: bool
    accepted: int
    refused: int
    share: float
    seconds: float
    outcome: Outcome

    def summary(self) -> dict[str, Any]:
        sent = self.accepted + self.refused
        return {
            "fleet_limits": self.limited, "accepted": self.accepted, "answered_429": self.refused,
            "share_429": round(self.refused / sent, 4) if sent else 0.0, "share_of_rpm_used": round(self.share, 3),
            "seconds": round(self.seconds, 2), **self.outcome.summary(),
        }  # fmt: skip


def rpm_share(accepted_at: list[float], rpm: int, window: float) -> float:
    """The share of a ``rpm`` per ``window`` limit that requests accepted at ``accepted_at`` (seconds)
    used while the fleet had work: the requests accepted in the whole windows from the first one
    (``k`` windows, ending before the last request: the fleet still had work through them), over
    ``k * rpm``; with less than a window of work, the requests over ``rpm``."""
    if not accepted_at:
        return 0.0
    first, last = min(accepted_at), max(accepted_at)
    k = int((last - first) // window)
    if k == 0:
        return len(accepted_at) / rpm
    return sum(1 for t in accepted_at if t < first + k * window) / (k * rpm)


async def provider_run(
    redis_url: str,
    *,
    limited: bool,
    rpm: int,
    window: float,
    tpm: int | None = None,
    workers: int = 3,
    rollouts: int = 3,
    calls: int = 50,
    margin: float = 0.1,
    log_dir: str | None = None,
    skewed: float = 0.0,
) -> ProviderRun:
    """Run the main job (``rollouts`` x ``calls`` sub-calls of 10 tokens) through ``workers`` worker
    processes against a scripted model answering 429 past ``rpm`` requests (and ``tpm`` tokens) per
    ``window`` seconds; with ``limited`` the workers declare the same limits (``--provider-*``).
    ``skewed``: the wall clock of the last worker runs this many seconds ahead (libfaketime)."""
    group = ProcessGroup(log_dir)
    quota = ["--quota-rpm", str(rpm), "--quota-window", f"{window:g}"]
    limits = ["--provider-rpm", str(rpm), "--provider-window", f"{window:g}", "--provider-window-margin", f"{margin:g}"]
    if tpm is not None:
        quota += ["--quota-tpm", str(tpm)]
        limits += ["--provider-tpm", str(tpm)]
    try:
        base_url = start_mock_llm(group, extra=quota)
        model = f"quota-{uuid.uuid4().hex[:6]}"
        args = limits if limited else []
        with LocalFleet(redis_url=redis_url, model=model, base_url=base_url, workers=workers - bool(skewed),
                        worker_args=args, log_dir=log_dir) as fleet:  # fmt: skip
            if skewed:
                fleet.worker_env = skewed_env(skewed)
                fleet.start_worker("skewed")
                fleet.wait_for_workers(workers)
            started = time.monotonic()
            out = await main_job(redis_url, base_url, model, rollouts=rollouts, calls=calls, budget=calls * 40,
                                 tokens=10, sleep=0.02, timeout=120)  # fmt: skip
            seconds = time.monotonic() - started
        stats = model_stats(base_url)["quota"]
    finally:
        group.stop()
    share = rpm_share(stats["accepted_at"], rpm, window)
    return ProviderRun(limited, int(stats["accepted"]), int(stats["refused"]), share, seconds, out)
