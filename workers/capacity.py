"""A worker's capacity: named pools of slots, and the rules by which jobs take and give them back.

:data:`MODEL_CALLS`: a sub-LLM job holds one of its slots from ``START`` until its result is
recorded (``worker_concurrency`` slots). A worker that hosts child rollouts (``repl_slots`` > 0)
also has one pool of REPL slots *per depth* (:func:`repl_pool`), ``repl_slots`` each,
for the depths 2 .. :data:`MAX_HOSTED_DEPTH`; a job kind names the pool family it takes
(:mod:`rlmq.workers.kinds`), the queue it came from names the depth.

Why per depth: a parent waiting for its children holds only a slot of its own depth, and its
children need slots of the next depth, so no depth's slots can all be held by rollouts that wait
for slots of the same pool: with one REPL slot per depth and one model-call slot, a tree of any
depth up to the bound finishes. The deepest level's ``rlm_batch`` runs as plain sub-LLM calls,
which need model-call slots only; a child's own root turns use the worker's model client and hold
no slot. :func:`fetch_shares` gives each queue its share of its own pool's free slots, so a full
depth (or full model-call slots) never stops the fetching of another depth's queue.

A budgeted call *parked* waiting for a release of its ledger's budget gives its slot back: up to
``max_parked`` parked calls do not count against the pool (``sub_llm_budget_max_parked``), so a
worker whose calls all wait for tokens still takes new jobs. A parked call that is granted takes
a slot again before it calls its model: it is held at the *resume gate* until running calls
(held, neither parked nor held at the gate) are fewer than the pool's slots. The first one held
always passes when nothing else runs, so the gate never deadlocks.

The rules are pure functions (:func:`free_slots`, :func:`must_wait_to_resume`), unit-tested in
``tests/unit/test_capacity.py``; :class:`Capacity` keeps the counts they are applied to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlmq.common import keys as K
from rlmq.common.tree import MAX_DEPTH

MODEL_CALLS = "model_calls"
"""The pool of model-call slots (``worker_concurrency``): what a sub-LLM job takes."""

REPL = "repl"
"""The family of the REPL-slot pools: what a child-rollout job takes (one pool per depth)."""

MAX_HOSTED_DEPTH = MAX_DEPTH
"""The deepest child rollouts a REPL-hosting worker serves (queues of depth 2 .. this)."""

PEEK_MAX = 500
"""Job ids one queue's peek reads at most per fetch round."""


def repl_pool(depth: int) -> str:
    """The pool of REPL slots of child rollouts at ``depth`` (>= 2): ``repl@<depth>``.

    Raises:
        ValueError: ``depth`` < 2.
    """
    if depth < 2:
        raise ValueError(f"child rollouts have depth >= 2, not {depth}")
    return f"{REPL}@{depth}"


def pool_family(pool: str) -> str:
    """The family of a pool: :data:`REPL` for every ``repl@<depth>``, else the pool itself."""
    return pool.split("@", 1)[0]


def hosted_depths(repl_slots: int) -> range:
    """The depths of the child rollouts a worker with ``repl_slots`` hosts: 2 ..
    :data:`MAX_HOSTED_DEPTH`, or none when ``repl_slots`` is 0."""
    return range(2, MAX_HOSTED_DEPTH + 1) if repl_slots > 0 else range(0)


def pool_of_queue(own: str, queue: str, repl_slots: int) -> str | None:
    """The pool the jobs of ``queue`` take on a worker of model queue ``own``, or ``None`` when
    that worker does not serve it: :data:`MODEL_CALLS` for ``own`` and its tenants; with
    ``repl_slots`` > 0, :func:`repl_pool` of ``d`` for the child queue of depth ``d`` of ``own``
    (and its tenants), for the depths of :func:`hosted_depths`."""
    if K.serves(own, queue):
        return MODEL_CALLS
    parsed = K.parse_child_queue(queue)
    if parsed is None or parsed[1] not in hosted_depths(repl_slots) or not K.serves(own, parsed[0]):
        return None
    return repl_pool(parsed[1])


def fetch_shares(free: Mapping[str, int], queue_pools: Sequence[tuple[str, str]]) -> dict[str, int]:
    """How many jobs one fetch round peeks on each queue.

    Each pool's free slots are shared equally (rounded up) among the queues that take that
    pool's slots (a model's queue and its tenants; one depth's child queue and its tenants),
    at most :data:`PEEK_MAX` each; a queue whose pool is full (or absent) gets 0. Pools never
    lend each other slots, so a full pool never stops another pool's queues.

    Args:
        free: pool -> free slots now (may be <= 0).
        queue_pools: ``(queue, pool)`` of every queue served, in round-robin order.

    Returns:
        queue -> jobs to peek (0: not peeked this round).
    """
    count: dict[str, int] = {}
    for _, pool in queue_pools:
        count[pool] = count.get(pool, 0) + 1
    out: dict[str, int] = {}
    for queue, pool in queue_pools:
        slots = free.get(pool, 0)
        out[queue] = 0 if slots <= 0 else min(PEEK_MAX, -(-slots // count[pool]))
    return out


def free_slots(slots: int, held: int, parked: int, max_parked: int) -> int:
    """Jobs a fetch round may start now in a pool (may be <= 0: none).

    Args:
        slots: the pool's size.
        held: jobs of the pool started and not yet recorded (parked ones included).
        parked: of those, calls parked waiting for a budget release.
        max_parked: parked calls that give their slot back; past that, parked calls hold theirs.
    """
    return slots - held + min(parked, max_parked)


def must_wait_to_resume(slots: int, held: int, parked: int, resuming: int) -> bool:
    """True when a call granted after parking must wait before calling its model.

    Running calls are ``held - parked - resuming`` (those held at the resume gate, this one
    included, do not count); the call waits while they fill the pool. With nothing else
    running (``held == parked + resuming``) it never waits, whatever ``slots``.

    Args:
        slots: the pool's size (>= 1).
        held / parked: as for :func:`free_slots`.
        resuming: calls held at the resume gate now, this one included.
    """
    return held - parked - resuming >= slots


@dataclass(frozen=True)
class PoolSpec:
    """One pool: ``slots`` (>= 1) and how many parked calls give their slot back (``max_parked``)."""

    slots: int
    max_parked: int = 0

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_parked < 0:
            raise ValueError(f"a pool needs slots >= 1 and max_parked >= 0, not {self}")


class Capacity:
    """The counts of a worker's pools: held jobs, parked calls, calls at the resume gate.

    Args:
        pools: pool name -> its :class:`PoolSpec`.

    Raises:
        ValueError: no pool.
    """

    def __init__(self, pools: Mapping[str, PoolSpec]) -> None:
        if not pools:
            raise ValueError("a worker needs at least one capacity pool")
        self.pools = dict(pools)
        self._held = dict.fromkeys(self.pools, 0)
        self._parked = dict.fromkeys(self.pools, 0)
        self._resuming = dict.fromkeys(self.pools, 0)

    def add_pool(self, name: str, spec: PoolSpec) -> None:
        """Add a pool (a job kind that takes another capacity: the REPL slots).

        Raises:
            ValueError: a pool of that name exists.
        """
        if name in self.pools:
            raise ValueError(f"capacity pool {name!r} exists")
        self.pools[name] = spec
        self._held[name] = self._parked[name] = self._resuming[name] = 0

    def _check(self, pool: str) -> str:
        if pool not in self.pools:
            raise KeyError(f"no capacity pool {pool!r} (pools: {', '.join(self.pools)})")
        return pool

    def hold(self, pool: str) -> None:
        """A job of ``pool`` was started (it holds a slot until :meth:`let_go`).

        Raises:
            KeyError: no such pool.
        """
        self._held[self._check(pool)] += 1

    def let_go(self, pool: str) -> None:
        """A job of ``pool`` was recorded, handed back or left to the reaper."""
        self._held[pool] -= 1

    def held(self, pool: str) -> int:
        """Jobs of ``pool`` held now."""
        return self._held[self._check(pool)]

    def set_parked(self, pool: str, parked: int) -> None:
        """``parked`` calls of ``pool`` wait for a budget release now."""
        self._parked[self._check(pool)] = max(0, parked)

    def free(self, pool: str) -> int:
        """Jobs of ``pool`` a fetch round may start now (see :func:`free_slots`)."""
        spec = self.pools[self._check(pool)]
        return free_slots(spec.slots, self._held[pool], self._parked[pool], spec.max_parked)

    def enter_resume(self, pool: str) -> None:
        """A call granted after parking arrives at the resume gate of ``pool``."""
        self._resuming[self._check(pool)] += 1

    def leave_resume(self, pool: str) -> None:
        """That call leaves the gate (to call its model, or cancelled)."""
        self._resuming[self._check(pool)] -= 1

    def must_wait(self, pool: str) -> bool:
        """Whether a call at the resume gate of ``pool`` must wait (see :func:`must_wait_to_resume`)."""
        spec = self.pools[self._check(pool)]
        return must_wait_to_resume(spec.slots, self._held[pool], self._parked[pool], self._resuming[pool])
