"""The eviction rule of :mod:`rlmq.common.fleet_checks`, apart from its round trip."""

from __future__ import annotations

import pytest

from rlmq.common.fleet_checks import eviction_verdict


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-ttl"])
def test_an_evicting_policy_with_a_maxmemory_is_refused_unless_accepted(policy: str) -> None:
    ok, message = eviction_verdict(policy, 64 << 20, allow=False)
    assert not ok and policy in message and "noeviction" in message and "--allow-evicting-redis" in message
    ok, message = eviction_verdict(policy, 64 << 20, allow=True)
    assert ok and "accepted" in message


def test_noeviction_or_no_maxmemory_is_fine_and_an_unreadable_policy_is_a_warning() -> None:
    assert eviction_verdict("noeviction", 64 << 20, allow=False) == (True, "")
    assert eviction_verdict("allkeys-lru", 0, allow=False) == (True, "")  # never full: never evicts
    ok, message = eviction_verdict(None, None, allow=False)
    assert ok and "CONFIG GET refused" in message
