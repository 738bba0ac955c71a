"""``rlmq run``'s local fleet starts REPL-hosting workers when its rollouts recurse."""

from __future__ import annotations

from typing import Any

from rlmq.cli.local import LOCAL_REPL_SLOTS, LocalFleet, local_repl_slots


def test_local_workers_host_children_only_when_the_trees_are_deeper_than_one() -> None:
    assert local_repl_slots(1) == 0
    assert local_repl_slots(2) == local_repl_slots(3) == LOCAL_REPL_SLOTS
    assert local_repl_slots(1, repl_slots=2) == local_repl_slots(3, repl_slots=2) == 2


def test_a_local_fleet_passes_its_repl_slots_and_the_override_to_each_worker() -> None:
    started: list[list[str]] = []

    def spawn(argv: list[str], name: str, env: Any = None) -> Any:
        started.append(argv)

    plain = LocalFleet(redis_url="redis://x", base_url="http://m/v1", worker_args=["--queue", "q"])
    plain.group.spawn = spawn  # type: ignore[method-assign]
    plain.start_worker("w0")
    assert "--repl-slots" not in started[-1] and started[-1][-2:] == ["--queue", "q"]
    hosts = LocalFleet(redis_url="redis://x", base_url="http://m/v1", repl_slots=3, allow_uncontained_repl=True)
    hosts.group.spawn = spawn  # type: ignore[method-assign]
    hosts.start_worker("w1")
    argv = started[-1]
    assert argv[argv.index("--repl-slots") + 1] == "3" and "--allow-uncontained-repl" in argv
    contained = LocalFleet(redis_url="redis://x", base_url="http://m/v1", repl_slots=1)
    contained.group.spawn = spawn  # type: ignore[method-assign]
    contained.start_worker("w2")
    assert "--allow-uncontained-repl" not in started[-1]
