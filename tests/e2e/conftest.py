"""End-to-end fixtures: real `rlmq worker` processes and the scripted model, on a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from rlmq.cli.local import LocalFleet


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Two worker processes serving the model ``e2e-scripted`` and the scripted model server."""
    logs = tmp_path_factory.mktemp("fleet-logs")
    with LocalFleet(
        redis_url=redis_url,
        model=f"e2e-scripted-{uuid.uuid4().hex[:6]}",
        workers=2,
        worker_concurrency=64,
        log_dir=str(logs),
    ) as f:
        yield f
