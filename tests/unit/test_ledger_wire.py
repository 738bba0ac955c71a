"""The budget ledger's wire is named once (``common/ledger_wire.py``) and spliced into its Lua:
no field is read by position, no result code is a bare number, and a reply is read by one
constructor. These read the script's template text, so a new bare index fails here."""

from __future__ import annotations

import re
from pathlib import Path

from rlmq.common.ledger_script import LEDGER_LUA
from rlmq.common.ledger_wire import COUNTERS, HASH_FIELDS, REPLY_FIELDS, Code, Reply, SettleCode, lua_names

SOURCE = (Path(__file__).resolve().parents[2] / "common" / "ledger_script.py").read_text(encoding="utf-8")
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
    assert "$" not in LEDGER_LUA
    names = lua_names()
    assert {c.name for c in Code} <= set(names) and {"SETTLE_" + c.name for c in SettleCode} <= set(names)
    assert names["NODE_GONE"] == str(int(Code.NODE_GONE)) == "7"


def test_a_reply_is_read_by_name() -> None:
    r = Reply.of([b"12", b"40", b"100", b"4", b"1700000000123", b"50"])
    assert (r.value, r.charged, r.limit, r.code, r.detail, r.need) == (12, 40, 100, Code.WAIT, 1700000000123, 50)
    assert tuple(Reply.__dataclass_fields__) == REPLY_FIELDS
