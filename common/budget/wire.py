"""The budget ledger's wire, named once: its hash fields, result codes and replies.

The ledger's Lua (:mod:`rlmq.common.budget.script`) has these names spliced in, as
:mod:`rlmq.common.jobs.lua` splices the job fields: ``$GRANTED`` becomes ``0``, ``$HASH_FIELDS``
the quoted field list, ``$HASH_LOCALS`` the Lua locals they are read into. Python reads a reply
through one constructor (:meth:`Reply.of`), never by position. The outcomes callers see
(:class:`Grant`, :class:`Settlement`, :class:`BudgetSnapshot`) live here too, so that
:mod:`rlmq.common.budget.wait` and :mod:`rlmq.common.budget.ledger` both import them from below
(no import cycle between the two).

Leased grants changed the wire: the script takes a fifth key (the grant-lease set, so a chain's
node keys start at ``KEYS[6]``) and the lease in ``ARGV[2]``; a begun reservation is
``call:<grant>``; the ``reclaimed`` counter is new; the release message may end in ``<lease end>``.
Each version runs its own script (by its own SHA), so no call mixes the layouts, but a process
from before leases reads a begun reservation as settled (a settle of it there leaves its grant
charged for good) and never reclaims a lease: do not mix such processes into a fleet that leases;
upgrade producers and workers together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum

__all__ = [
    "CLOSE_WIRE", "COUNTERS", "COUNT_REJECTIONS_WIRE", "HASH_FIELDS", "HEAD_ARGS", "OPEN_UNLIMITED_WIRE",
    "SCRIPT_KEYS", "BeginCode", "BudgetSnapshot", "Code", "Grant", "Op", "Release", "Reply", "ScriptWire",
    "SettleCode", "answered_op", "lua_names",
]  # fmt: skip


class Code(IntEnum):
    """A reservation's outcome (:attr:`Grant.code`); an ``int``, so ``grant.code == 0`` still holds."""

    GRANTED = 0
    """Granted: ``Grant.tokens`` > 0 is the call's ``max_tokens``."""
    REJECTED = 1
    """The budget is spent: nothing free and no live reservation that could give tokens back."""
    NO_LEDGER = 2
    """No budget hash: expired, lost, or a rollout without a budget."""
    ALREADY_SETTLED = 3
    """A retried job asked again for a reservation that was settled."""
    WAIT = 4
    """Less than a full grant is free but live reservations may give some back: ask again after a
    release, or at :attr:`Grant.retry_at`."""
    WAITED_OUT = 5
    """Never the script's: the waiter gave up at the call's deadline (:mod:`rlmq.common.budget.wait`)."""
    TREE_CLOSED = 6
    """The ledger is closed (its top rollout ended)."""
    NODE_GONE = 7
    """A node of the call's tree chain is gone (:attr:`Grant.gone_node`)."""
    UNLIMITED = 8
    """A liveness-only ledger (a tree without a budget) found the chain alive: call without a
    grant, settle nothing."""


class SettleCode(IntEnum):
    """A settlement's outcome (:attr:`Settlement.code`)."""

    SETTLED = 0
    ALREADY = 1
    """Settled before: nothing changes (settling is idempotent)."""
    UNKNOWN = 2
    """No such reservation."""


class BeginCode(IntEnum):
    """A begin's outcome (:meth:`rlmq.common.budget.ledger.BudgetLedger.begin`)."""

    BEGUN = 0
    """Begun now or before (or a grant never leased): call the model under it."""
    SETTLED = 1
    """The reservation is settled: do not call the model under it."""
    UNKNOWN = 2
    """No such reservation: its lease was reclaimed (or it was given back): reserve again."""


class Op(StrEnum):
    """The operations of the ledger's script (the first of :data:`OP_ARGS`). A reserve of another
    kind than the sub-LLM's is ``<op>:<kind>`` (``r:root``, ``L:root``)."""

    RESERVE = "r"
    """Reserve a grant (the caller calls the model at once)."""
    LEASED = "L"
    """Reserve a *leased* grant: it must be begun within the lease, or it is reclaimed."""
    SETTLE = "s"
    """Settle with the tokens the server reported."""
    RETIRE = "x"
    """Stop counting a reservation as live (its job runs again elsewhere)."""
    BEGIN = "b"
    """The leased grant's call is about to reach the model: never reclaimed from now on."""
    GIVE_BACK = "u"
    """A leased grant never begun goes back now."""
    SEGMENT = "g"
    """Reserve a *segment* of an answer (``g:<kind>:<spent>``): its first when ``spent`` is 0, else the
    next one of an answer that has spent ``spent`` tokens and continues on the server."""
    SEGMENT_LEASED = "G"
    """:attr:`SEGMENT`, leased (as :attr:`LEASED`)."""
    ANSWERED = "f"
    """An answer of kind ``<kind>`` ended after ``<total>`` tokens (``f:<kind>:<total>``, no reservation):
    the ledger keeps the longest (``longest`` / ``longest:<kind>``), from which later segments are sized."""


def answered_op(tokens: int, kind: str = "") -> str:
    """The op that notes an answer of reservation kind ``kind`` (``""``: the sub-LLM's) ended after
    ``tokens`` completion tokens (0: not on its own): ``f:<kind>:<tokens>`` (:attr:`Op.ANSWERED`)."""
    return f"{Op.ANSWERED.value}:{kind}:{max(0, int(tokens))}"


HASH_FIELDS = (
    "limit", "charged", "grants", "used", "released", "overrun", "rejections", "waits", "cap", "ttl", "closed",
    "unlimited", "reclaimed", "segments", "longest", "answered",
)  # fmt: skip
"""The fields of a ledger's budget hash (``LedgerKeys.budget``) the script reads, each into the Lua
local ``h_<field>``: ``limit`` (tokens), ``charged`` (reported + held by open reservations), ``grants``,
``used`` (tokens servers reported), ``released``, ``overrun`` (tokens a server returned past its grant),
``rejections``, ``waits`` ("wait" answers), ``cap`` (0: none; the cap of sub-LLM reservations), ``ttl``
(seconds, the owner's), ``closed`` (the top rollout ended), ``unlimited`` (a liveness-only ledger),
``reclaimed`` (tokens of leased grants that went back unbegun: given back or reclaimed), ``segments``
(segment grants: :attr:`Op.SEGMENT`), ``longest`` (the longest sub-LLM answer that ended, tokens),
``answered`` (sub-LLM answers that ended on their own). A reservation kind's own cap is ``cap:<kind>``,
and the longest answer of the kind that ended ``longest:<kind>`` (their count ``answered:<kind>``),
read only when a segment or an answer's end of that kind comes."""
COUNTERS = ("charged", "grants", "used", "released", "overrun", "rejections", "waits", "reclaimed", "segments")
"""The fields the script counts (integers, written back once per call when changed)."""

REPLY_FIELDS = ("value", "charged", "limit", "code", "detail", "need")
"""One operation's reply, in the order the script's ``reply(...)`` builds it (see :class:`Reply`)."""

SCRIPT_KEYS = {
    "budget": "budget", "reservations": "reservations", "live_set": "live_reservations", "channel": "released",
    "leases": "grant_leases", "answers": "answers",
}  # fmt: skip
"""The script's own keys, in order (``KEYS[1..]``): its Lua local -> the :class:`rlmq.common.keys.LedgerKeys`
attribute. The node keys of the caller's tree chain follow them."""

HEAD_ARGS = ("ttl", "lease")
"""The arguments before the operations: ``ARGV[1]`` the TTL (seconds) of a ledger that stores none (0:
the budget hash's own), ``ARGV[2]`` the grant lease (seconds) of a leased reserve (:attr:`Op.LEASED`)."""

OP_ARGS = ("op", "id", "n", "deadline")
"""The arguments of one operation after :data:`HEAD_ARGS`: ``op`` (an :class:`Op`), reservation id,
``n`` (a reserve's cap, a settle's used tokens), ``deadline`` (Unix seconds; a reserve's)."""

SEGMENT_MIN = 64
"""Tokens: the smallest segment the ledger grants while live calls may give tokens back (a continuation
takes what is free from this size up; below it, it waits), and the least an answer's estimate is."""

ESTIMATE_SAMPLES = 8
"""Answers of a kind that must have ended on their own in a ledger before any number of answers may
run on an estimate (a first segment of 1.25 x the longest so far, below the cap). With ``n`` fewer
ended, at most ``n`` answers of the kind run on an estimate at once; the others start with, and
pledge, the whole cap. The first answers to end are the shortest: an estimate taken from one of
them let the ledger start a burst of answers on small first segments that outran it together at
the budget's end (half the answers of a binding batch cut)."""

RELEASE_FIELDS = ("free", "live", "lease_end")
"""The release message the script publishes, space-separated (see :class:`Release`); the last is
sent only while a grant lease is open."""


@dataclass(frozen=True)
class ScriptWire:
    """The named wire of one of the ledger's small scripts (:mod:`rlmq.common.budget.script`): the
    script reads its keys and arguments into Lua locals of these names, and Python lays them out by
    name (:meth:`layout`), never by position.

    Attributes:
        keys: the script's own keys in ``KEYS`` order: its Lua local -> the
            :class:`rlmq.common.keys.LedgerKeys` attribute; keys a call adds (node keys) follow them.
        args: its arguments' Lua locals, in ``ARGV`` order.
    """

    keys: Mapping[str, str]
    args: tuple[str, ...]

    def lua_names(self) -> dict[str, str]:
        """What :func:`string.Template` splices into the script: its keys' locals (``KEY_LOCALS``) and
        count (``KEY_COUNT``), its arguments' locals (``ARG_LOCALS``) and count (``ARG_COUNT``)."""
        return {
            "KEY_LOCALS": ", ".join(self.keys), "KEY_COUNT": str(len(self.keys)),
            "ARG_LOCALS": ", ".join(self.args), "ARG_COUNT": str(len(self.args)),
        }  # fmt: skip

    def layout(
        self, ledger_keys: object, more_keys: Sequence[str] = (), **args: str | int | float
    ) -> tuple[list[str], list[str | int | float]]:
        """``(KEYS, ARGV)`` of one call: the keys named by ``ledger_keys`` (a
        :class:`~rlmq.common.keys.LedgerKeys`), then ``more_keys``; the arguments by name.

        Raises:
            ValueError: ``args`` does not name exactly the script's arguments.
        """
        if set(args) != set(self.args):
            raise ValueError(f"script arguments {sorted(args)} are not {sorted(self.args)}")
        return [*(getattr(ledger_keys, attr) for attr in self.keys.values()), *more_keys], [args[a] for a in self.args]


COUNT_REJECTIONS_WIRE = ScriptWire({"budget": "budget"}, ("n",))
"""Count calls refused outside the ledger script: the budget hash; ``n`` how many."""
CLOSE_WIRE = ScriptWire({"budget": "budget", "channel": "released"}, ("close",))
"""Close a ledger or end some of its nodes: the budget hash and its release channel, then the node keys
to delete; ``close`` ``1`` to close the ledger, ``0`` to only delete the nodes."""
OPEN_UNLIMITED_WIRE = ScriptWire({"budget": "budget"}, ("ttl",))
"""Open a liveness-only ledger: the budget hash; ``ttl`` its TTL (seconds)."""


def lua_names() -> dict[str, str]:
    """What :func:`string.Template` splices into the ledger's Lua: every :class:`Code`,
    :class:`SettleCode` and :class:`BeginCode` by name (``SETTLE_`` / ``BEGIN_`` before the latter
    two), every :class:`Op` (``OP_`` before it), the keys' locals and count, the positions of
    :data:`HEAD_ARGS` (``ARGV_TTL``, ``ARGV_LEASE``) and their count, the hash fields and their
    locals, the counters, the reply's fields and the width of one operation's arguments."""
    names = {c.name: str(c.value) for c in Code}
    names.update({"SETTLE_" + c.name: str(c.value) for c in SettleCode})
    names.update({"BEGIN_" + c.name: str(c.value) for c in BeginCode})
    names.update({"OP_" + o.name: o.value for o in Op})
    names["KEY_LOCALS"] = ", ".join(SCRIPT_KEYS)
    names["KEY_COUNT"] = str(len(SCRIPT_KEYS))
    names.update({"ARGV_" + a.upper(): str(i) for i, a in enumerate(HEAD_ARGS, 1)})
    names["HEAD_ARGS"] = str(len(HEAD_ARGS))
    names["HASH_FIELDS"] = ", ".join(f"'{f}'" for f in HASH_FIELDS)
    names["HASH_LOCALS"] = ", ".join(f"h_{f}" for f in HASH_FIELDS)
    names["COUNTERS"] = ", ".join(f"'{f}'" for f in COUNTERS)
    names["COUNTER_TABLE"] = ", ".join(f"{f} = tonumber(h_{f} or '0')" for f in COUNTERS)
    names["REPLY_FIELDS"] = ", ".join(REPLY_FIELDS)
    names["OP_ARGS"] = str(len(OP_ARGS))
    names["SEGMENT_MIN"] = str(SEGMENT_MIN)
    names["ESTIMATE_SAMPLES"] = str(ESTIMATE_SAMPLES)
    return names


@dataclass(frozen=True, slots=True)
class Reply:
    """One operation's reply from the script (all integers).

    Attributes:
        value: a reserve's grant (tokens), a settle's released tokens (grant - used; negative for
            an overrun), a retire's 1 when the reservation was live.
        charged: tokens charged to the ledger after the operation.
        limit: the ledger's budget (tokens; 0 when it has none).
        code: :class:`Code` of a reserve, :class:`SettleCode` of a settle.
        detail: for :data:`Code.WAIT`, the earliest live reservation's deadline in ms (Unix); for
            :data:`Code.NODE_GONE`, the gone node's position in the chain (from 1); else 0.
        need: for :data:`Code.WAIT`, the grant the call waits for (tokens); for a new grant, the
            full grant (``min(cap, limit)``; a grant below it is the last remainder); else 0.
    """

    value: int
    charged: int
    limit: int
    code: int
    detail: int
    need: int

    @classmethod
    def of(cls, raw: Sequence[int | bytes | str]) -> Reply:
        """The reply the script returned for one operation (a list of :data:`REPLY_FIELDS`)."""
        value, charged, limit, code, detail, need = (int(x) for x in raw)
        return cls(value, charged, limit, code, detail, need)


@dataclass(frozen=True, slots=True)
class Release:
    """A release message of a ledger (:data:`RELEASE_FIELDS`), published after a settle, retire,
    give-back or reclaim, or a leased grant, once the ledger has had a waiter.

    Attributes:
        free: ``limit - charged`` after it (tokens).
        live: live reservations left.
        lease_end: when the ledger's earliest open grant lease ends (Unix seconds, Redis's clock);
            ``None`` when no lease is open.
    """

    free: int
    live: int
    lease_end: float | None

    @classmethod
    def of(cls, data: bytes | str) -> Release | None:
        """The release ``data`` says, or ``None`` for a message that is not one (``closed``, garbage)."""
        text = data.decode() if isinstance(data, bytes) else str(data)
        parts = text.split()
        if not len(RELEASE_FIELDS) - 1 <= len(parts) <= len(RELEASE_FIELDS):
            return None
        try:
            free, live, *rest = parts
            return cls(int(free), int(live), float(rest[0]) if rest else None)
        except ValueError:
            return None


@dataclass(frozen=True)
class Grant:
    """Outcome of a reservation.

    Attributes:
        tokens: completion tokens granted (0 unless ``code`` is :data:`Code.GRANTED`); the model
            call's ``max_tokens``.
        charged: tokens charged to the rollout after this reservation.
        limit: the rollout's budget in tokens.
        code: a :class:`Code`.
        retry_at: for :data:`Code.WAIT`, the Unix time (seconds) at which the earliest live
            reservation's deadline passes and it stops counting as live (0 otherwise).
        need: for :data:`Code.WAIT`, the grant the call waits for (tokens free before it is given);
            for a new grant, the full grant its cap asked for (0 when the ledger did not say: a
            grant asked for again). A grant below it is the budget's last remainder (:attr:`cut`).
        gone_node: for :data:`Code.NODE_GONE`, the first node of the chain whose key is gone.
        leased: the grant is leased (:meth:`rlmq.common.budget.ledger.BudgetLedger.reserve` with
            ``leased``): its holder must :meth:`~rlmq.common.budget.ledger.BudgetLedger.begin` it before its
            call reaches the model, or it is reclaimed.
    """

    tokens: int
    charged: int
    limit: int
    code: int
    retry_at: float = 0.0
    need: int = 0
    gone_node: str = ""
    leased: bool = False

    @property
    def tree_refused(self) -> bool:
        """True for a refusal by the tree (:data:`Code.TREE_CLOSED` or :data:`Code.NODE_GONE`), not the budget."""
        return self.code in (Code.TREE_CLOSED, Code.NODE_GONE)

    @property
    def refusal_reason(self) -> str:
        """``tree_closed`` or ``parent_gone`` (a node of the chain is gone), for a tree refusal; else ``""``."""
        if self.code == Code.TREE_CLOSED:
            return "tree_closed"
        return "parent_gone" if self.code == Code.NODE_GONE else ""

    @property
    def refusal_message(self) -> str:
        """What a tree refusal says (``tree_closed: ...`` / ``parent_gone: ...``); ``""`` otherwise."""
        if self.code == Code.TREE_CLOSED:
            return "tree_closed: the top rollout of its tree has ended (its budget ledger is closed)"
        if self.code == Code.NODE_GONE:
            return f"parent_gone: rollout {self.gone_node or '?'} of its tree chain has ended or died"
        return ""

    @property
    def granted(self) -> bool:
        return self.tokens > 0

    @property
    def cut(self) -> bool:
        """True for a grant below its full cap: the budget's last remainder (its answer may be cut)."""
        return self.granted and self.tokens < self.need


@dataclass(frozen=True)
class Settlement:
    """Outcome of settling a reservation: ``released`` tokens went back to the budget; ``code`` a
    :class:`SettleCode`."""

    released: int
    charged: int
    limit: int
    code: int


@dataclass(frozen=True)
class BudgetSnapshot:
    """A ledger at one moment (all figures in completion tokens).

    ``waits`` counts the reservations answered "wait" (a call can be told to wait several
    times); ``cap`` is the per-call cap of sub-LLM reservations (0: none); ``ttl`` the seconds
    its keys live after a refresh, as its owner stored it (0: an older ledger without one).
    """

    limit: int
    charged: int
    used: int
    grants: int
    rejections: int
    released: int
    overrun: int
    cap: int = 0
    waits: int = 0
    ttl: int = 0

    @property
    def remaining(self) -> int:
        """Tokens neither spent nor held by an open reservation."""
        return max(0, self.limit - self.charged)

    @property
    def held(self) -> int:
        """Tokens held by open reservations (running calls, or calls of dead workers)."""
        return self.charged - self.used
