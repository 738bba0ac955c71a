"""Where a rollout sits in a rollout tree (recursive sub-RLMs).

A top rollout (depth 1) is started by a producer; its REPL's ``rlm_batch`` starts child
rollouts (depth 2, ...) as jobs on the fleet, each with its own REPL and root model. The whole
tree charges one budget ledger, its top rollout's (:class:`~rlmq.common.keys.LedgerKeys`), and
each rollout of the tree is a *node* of it: a node id is the id that rollout runs under (a
child re-run after its worker died runs under a new id, so the dead attempt's descendants,
whose chain names the dead id, are refused at their next model call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DEPTH = 8
"""The deepest rollout tree (``max_depth``) rlmq runs: REPL-hosting workers serve the child
queues of depths 2 .. this (:data:`rlmq.workers.capacity.MAX_HOSTED_DEPTH`), so a deeper tree's
children would find no worker; ``max_depth`` above it is refused where the options are read."""
MAX_DEPTH_DEFAULT = 1
"""The ``max_depth`` setting's default, declared here (below the settings, which refer to it)
for :class:`TreePosition` too: 1 is a lone rollout, whose ``rlm_batch`` makes plain sub-LLM calls."""


@dataclass(frozen=True)
class TreePosition:
    """A rollout's place in its tree.

    Attributes:
        ledger_id: the tree's budget ledger (the top rollout's ledger id).
        depth: 1 for the top rollout, its parent's depth + 1 for a child.
        max_depth: the tree's depth limit (>= 1); at ``depth == max_depth`` ``rlm_batch``
            runs as plain sub-LLM calls (as the RLM paper's code does at its ``max_depth``).
        nodes: the node ids from the top rollout to this rollout's parent (empty for the top);
            every one of them must be alive for this rollout's model calls to be granted.
        parent_id: the parent rollout's id (``None`` for the top).
    """

    ledger_id: str
    depth: int = 1
    max_depth: int = MAX_DEPTH_DEFAULT
    nodes: tuple[str, ...] = field(default_factory=tuple)
    parent_id: str | None = None

    def __post_init__(self) -> None:
        if self.depth < 1 or self.max_depth < 1:
            raise ValueError(f"depth and max_depth are >= 1, not {self.depth} / {self.max_depth}")

    @property
    def can_recurse(self) -> bool:
        """True when this rollout's ``rlm_batch`` starts child rollouts (``depth < max_depth``)."""
        return self.depth < self.max_depth

    def child(self, own_node: str) -> TreePosition:
        """The position of a child of this rollout, which runs as node ``own_node``."""
        return TreePosition(
            ledger_id=self.ledger_id,
            depth=self.depth + 1,
            max_depth=self.max_depth,
            nodes=(*self.nodes, own_node),
            parent_id=own_node,
        )
