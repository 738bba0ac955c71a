"""``rlmq.common.budget``: the hard completion-token budget of a rollout (tree), kept in Redis.

What it owns: the ledger (:mod:`.ledger`, :class:`~rlmq.common.budget.ledger.BudgetLedger`, the
one entry point) and its parts: how its operations reach Redis (:mod:`.calls`), its tree of live
nodes and its closing (:mod:`.tree`), answers granted in segments (:mod:`.segments`), a sub-call's
turns from grant to settlement (:mod:`.turn`), its Lua (:mod:`.script`) and its wire, named once
(:mod:`.wire`); calls parked until budget is released (:mod:`.wait`); and how many replicas must
acknowledge a grant (:mod:`.replica_acks`).

What it may import (held by ``tests/unit/test_layout.py``): the flat modules of
:mod:`rlmq.common` (keys, errors, scripts, sentinel, ...) and :mod:`rlmq.common.settings`; never
the job store (:mod:`rlmq.common.jobs`, which builds on the ledger), ``producer`` or ``workers``.
"""
