"""The budget ledger's wire is named once (``common/budget/wire.py``) and spliced into its Lua:
no field is read by position, no result code is a bare number, and a reply is read by one
constructor. These read the script's template text, so a new bare index fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.asyncio import Redis

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.budget.script import LEDGER_LUA
from rlmq.common.budget.wire import (
    CLOSE_WIRE,
    COUNTERS,
    HASH_FIELDS,
    RELEASE_FIELDS,
    REPLY_FIELDS,
    SCRIPT_KEYS,
    Code,
    Op,
    Release,
    Reply,
    SettleCode,
    lua_names,
)
from rlmq.common.keys import LedgerKeys
from rlmq.common.settings import Settings

SOURCE = (Path(__file__).resolve().parents[2] / "common" / "budget" / "script.py").read_text(encoding="utf-8")
TEMPLATE = SOURCE[SOURCE.index("LEDGER_LUA = _lua(") : SOURCE.index('""")', SOURCE.index("LEDGER_LUA = _lua("))]


def test_every_reply_names_its_code() -> None:
    """Each ``reply(...)`` the script builds gives its code as a spliced name (``$GRANTED``) or
    the one variable that carries a tree refusal's code; never a number."""
    calls = re.findall(r"\breply\(([^()]*(?:\([^()]*\)[^()]*)*)\)", TEMPLATE)
    assert len(calls) >= 10, calls
    for args in calls:
        if args == "$REPLY_FIELDS":  # the function's own parameter list
            continue
        parts = [a.strip() for a in re.split(r",(?![^(]*\))", args)]
        assert len(parts) == len(REPLY_FIELDS), args
        code = parts[REPLY_FIELDS.index("code")]
        assert code.startswith("$") or code == "refusal_code", f"bare result code in reply({args})"


def test_no_field_is_read_by_position() -> None:
    """The hash is read into named locals (``h_limit``, ...); no ``b[1]``-style index is left, and
    every field the wire names is read and used."""
    assert not re.search(r"\bb\[\d+\]", TEMPLATE)
    assert "local $HASH_LOCALS = unpack(redis.call('HMGET', budget, $HASH_FIELDS))" in TEMPLATE
    for field in HASH_FIELDS:
        assert f"h_{field}" in LEDGER_LUA.split("HMGET", 1)[1], f"{field} is read but never used"
    for field in COUNTERS:
        assert f"{field} = tonumber(h_{field} or '0')" in LEDGER_LUA


def test_the_spliced_script_has_no_placeholder_left_and_every_code_is_spelled_once() -> None:
    # A '$' left is Lua's own: a pattern's end anchor, right before the pattern's closing quote
    # (segment ids ``<answer>:s<k>``, the answers set's entries); a placeholder is ``$NAME``.
    assert not re.search(r"\$[A-Za-z_]", LEDGER_LUA), "a placeholder left unspliced"
    assert all(LEDGER_LUA[m.end()] == "'" for m in re.finditer(r"\$", LEDGER_LUA)), "a '$' outside a Lua pattern"
    names = lua_names()
    assert {c.name for c in Code} <= set(names) and {"SETTLE_" + c.name for c in SettleCode} <= set(names)
    assert names["NODE_GONE"] == str(int(Code.NODE_GONE)) == "7"


def test_a_reply_is_read_by_name() -> None:
    r = Reply.of([b"12", b"40", b"100", b"4", b"1700000000123", b"50"])
    assert (r.value, r.charged, r.limit, r.code, r.detail, r.need) == (12, 40, 100, Code.WAIT, 1700000000123, 50)
    assert tuple(Reply.__dataclass_fields__) == REPLY_FIELDS


def test_every_op_key_and_head_argument_is_spliced_by_name() -> None:
    """Leased grants added ops, a key and an argument: the template compares no bare op letter,
    reads no ``KEYS[<n>]`` / ``ARGV[<n>]`` by number, and every op the wire names is handled."""
    assert not re.search(r"(?:\bop|\bkind) == '[^$]", TEMPLATE), "a bare op letter in the Lua"
    assert not re.search(r"\b(?:KEYS|ARGV)\[\d", TEMPLATE), "a key or argument read by its number"
    assert "local $KEY_LOCALS = unpack(KEYS, 1, $KEY_COUNT)" in TEMPLATE
    for op in Op:
        assert f"'$OP_{op.name}'" in TEMPLATE or op is Op.SETTLE, f"op {op.name} is never handled"
    names = lua_names()
    assert (names["ARGV_TTL"], names["ARGV_LEASE"], names["HEAD_ARGS"]) == ("1", "2", "2")
    assert names["KEY_LOCALS"].split(", ") == list(SCRIPT_KEYS)


def test_the_script_keys_go_out_in_the_order_the_lua_names_them() -> None:
    """``KEYS[1..6]`` are the budget hash, reservations, live set, release channel, lease set and
    running answers (the Lua's locals), then the caller's node keys: a shifted layout would read a
    wrong key."""
    keys = LedgerKeys("led")
    assert BudgetLedger._keys(("led", ("n1", "n2"))) == [
        keys.budget, keys.reservations, keys.live_reservations, keys.released, keys.grant_leases, keys.answers,
        keys.node("n1"), keys.node("n2"),
    ]  # fmt: skip
    assert list(SCRIPT_KEYS) == ["budget", "reservations", "live_set", "channel", "leases", "answers"]


def test_the_head_arguments_carry_the_lease_and_the_lease_is_the_declared_setting() -> None:
    ledger = BudgetLedger(Redis(), grant_lease=7.5)  # no connection is made
    assert ledger._head_args() == [0, 7.5]
    assert BudgetLedger(Redis())._head_args() == [0, Settings.model_fields["sub_llm_budget_grant_lease"].default]
    with pytest.raises(ValueError, match="grant lease"):
        BudgetLedger(Redis(), grant_lease=0)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("12 3", Release(12, 3, None)),
        (b"0 1 1700000000.25", Release(0, 1, 1700000000.25)),
        ("closed", None),
        ("1 2 3 4", None),
        ("x 2", None),
        ("5 2 soon", None),
    ],
)
def test_a_release_message_is_read_by_name(data: str | bytes, expected: Release | None) -> None:
    assert Release.of(data) == expected
    assert tuple(Release.__dataclass_fields__) == RELEASE_FIELDS


@pytest.mark.parametrize("name", ["COUNT_REJECTIONS_LUA", "CLOSE_LEDGER_LUA", "OPEN_UNLIMITED_LUA"])
def test_the_small_scripts_read_their_keys_and_arguments_by_name(name: str) -> None:
    """The ledger's small scripts read ``KEYS`` / ``ARGV`` only into their wire's named locals (no
    ``KEYS[n]`` / ``ARGV[n]`` in their text) and go out by ``EVALSHA``."""
    start = SOURCE.index(f"{name} = _small(")
    body = SOURCE[start : SOURCE.index('""",', start)]
    assert "KEYS[" not in body and "ARGV[" not in body
    assert "redis.eval(" not in SOURCE
    for module in ("ledger.py", "tree.py"):
        text = (Path(__file__).resolve().parents[2] / "common" / "budget" / module).read_text(encoding="utf-8")
        assert ".eval(" not in text, module


def test_a_small_scripts_layout_is_by_name() -> None:
    keys, args = CLOSE_WIRE.layout(LedgerKeys("r1"), ["n1"], close=1)
    assert keys == [LedgerKeys("r1").budget, LedgerKeys("r1").released, "n1"] and args == [1]
    with pytest.raises(ValueError):
        CLOSE_WIRE.layout(LedgerKeys("r1"), closed=1)
