"""``rlmq.common.jobs``: the job store, rlmq's queue protocol on RQ's job record.

What it owns: the store (:mod:`.store`, :class:`~rlmq.common.jobs.store.JobStore`: enqueue,
start, heartbeat, finish, reap), its Lua (:mod:`.lua`), RQ's job record as rlmq writes and reads
it (:mod:`.record`) and the large result payloads moved beside the reply stream (:mod:`.spill`).

What it may import (held by ``tests/unit/test_layout.py``): the flat modules of
:mod:`rlmq.common`, :mod:`rlmq.common.settings` and :mod:`rlmq.common.budget` (an enqueue runs in
the same script as the ledger's reservations); never ``producer`` or ``workers``.
"""
