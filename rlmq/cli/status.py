"""``rlmq status``: what the fleet is doing now, read straight from Redis.

Three tables:

* queues (RQ's ``rq:queues`` set): depth, age of the oldest waiting job (from its job
  hash's ``enqueued_at``), started and failed registry sizes, and the workers serving it
  (entries of ``rlmq:serving:<queue>`` whose heartbeat has not lapsed by Redis's clock,
  which also count for its tenant queues ``<queue>@<tenant>``; RQ's own per-queue worker
  set keeps workers killed with ``kill -9``, so it is not counted);
* workers (RQ's ``rq:workers`` set): state, sub-calls in flight (the size of the
  worker's ``rq:worker:<name>:executions`` set), concurrency, age of the last heartbeat;
* live rollouts (entries of ``rlmq:rollouts`` whose lease has not lapsed by Redis's clock: their
  host refreshes it every few seconds, so a killed host's rollouts drop out within the lease, as
  a killed worker does; plus each rollout's ``info`` and ``budget`` hashes): depth and parent
  (a child rollout of ``rlm_batch``, hosted by a worker: depth >= 2), model, age, sub-LLM budget
  used / limit, and for a top rollout whose tree has live children the tree's figures from its
  ledger (model calls, completion tokens charged, refusals).

:func:`collect` reads a snapshot (a JSON-able dict, what ``--json`` prints),
:func:`render` turns it into plain text tables; both are pure enough to test on fakeredis.
Only reads; never writes to Redis.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from rlmq.common import keys as K
from rlmq.common.provider_limits import snapshot as provider_snapshot


def _s(v: Any) -> str:
    if v is None:
        return ""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _int(v: Any, default: int | None = None) -> int | None:
    try:
        return int(float(_s(v)))
    except ValueError:
        return default


def parse_rq_time(text: str | bytes | None) -> float | None:
    """Unix seconds of an RQ timestamp (``2026-11-22T06:20:01.546671Z``); ``None`` if unparsable."""
    t = _s(text).strip()
    if not t:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(t, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    try:
        return float(t)
    except ValueError:
        return None


def collect(redis: Any, *, now: float | None = None, max_rollouts: int = 200) -> dict[str, Any]:
    """Read a snapshot of queues, workers and live rollouts from ``redis`` (a sync client).

    Args:
        redis: a ``redis.Redis`` (bytes or decoded responses; fakeredis works).
        now: Unix time the ages are computed against (default: now).
        max_rollouts: live rollouts listed at most (the soonest to expire are dropped).

    Returns:
        ``{"time", "queues": [...], "workers": [...], "rollouts": [...], "rollouts_total", "providers": [...]}``
        (``providers``: :func:`rlmq.common.provider_limits.snapshot`);
        times in Unix seconds, ages in seconds (``None`` when unknown).
    """
    now = time.time() if now is None else now
    sec, usec = redis.time()
    server_now = float(sec) + float(usec) / 1e6  # serving entries expire by Redis's clock
    queues = [_queue_row(redis, _s(k), now, server_now) for k in sorted(_s(k) for k in redis.smembers(K.RQ_QUEUES))]
    workers = [_worker_row(redis, _s(k), now, server_now) for k in sorted(_s(k) for k in redis.smembers(K.RQ_WORKERS))]
    total = int(redis.zcount(K.LIVE_ROLLOUTS, server_now, "+inf"))
    entries = redis.zrevrangebyscore(K.LIVE_ROLLOUTS, "+inf", server_now, 0, max_rollouts, withscores=True)
    rollouts = [row for m, e in entries if (row := _rollout_row(redis, _s(m), float(e), now, server_now)) is not None]
    _add_trees(redis, rollouts)
    rollouts.sort(key=lambda r: -(r["age"] or 0.0))
    providers = provider_snapshot(redis)
    return {
        "time": now, "queues": queues, "workers": workers, "rollouts": rollouts, "rollouts_total": total,
        "providers": providers,
    }  # fmt: skip


def _queue_row(redis: Any, qkey: str, now: float, server_now: float) -> dict[str, Any]:
    """One queue's row of :func:`collect` (``qkey``: a member of ``rq:queues``)."""
    name = K.queue_of_key(qkey)
    with redis.pipeline(transaction=False) as pipe:
        pipe.llen(qkey)
        pipe.lindex(qkey, 0)
        pipe.zcard(K.rq_started(name))
        pipe.zcard(K.rq_failed(name))
        # Live workers (heartbeat not lapsed) of the model queue, which serve its tenant
        # queues too (<queue>@<tenant>); RQ's per-queue worker set keeps dead ones.
        pipe.zcount(K.serving(name), server_now, "+inf")
        depth, head, started, failed, live = pipe.execute()
    oldest = None
    if head is not None:
        enq = parse_rq_time(redis.hget(K.rq_job(_s(head)), "enqueued_at"))
        oldest = None if enq is None else max(0.0, now - enq)
    return {
        "name": name, "depth": int(depth), "oldest_age": oldest, "started": int(started), "failed": int(failed),
        "workers": int(live),
    }  # fmt: skip


def _worker_row(redis: Any, wkey: str, now: float, server_now: float) -> dict[str, Any]:
    """One worker's row of :func:`collect` (``wkey``: a member of ``rq:workers``)."""
    name = K.worker_of_key(wkey)
    with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(wkey)
        pipe.scard(K.rq_worker_executions(name))
        raw, inflight = pipe.execute()
    h = _hash(raw)
    beat = parse_rq_time(h.get("last_heartbeat"))
    state = h.get("state") or ("gone" if not h else "?")
    if h.get("death"):
        state = "dead"
    queues = [q for q in h.get("queues", "").split(",") if q]
    lease = [redis.zscore(K.serving(q), name) for q in queues]
    live = any(x is not None and float(x) > server_now for x in lease)
    if not live and state not in ("gone", "dead"):
        state = "lapsed"  # no heartbeat within its lease (killed with kill -9?)
    return {
        "name": name,
        "state": state,
        "live": live,
        "queues": queues,
        "inflight": int(inflight),
        "concurrency": _int(h.get("rlmq_concurrency")),
        "heartbeat_age": None if beat is None else max(0.0, now - beat),
        "hostname": h.get("hostname") or None,
        "pid": _int(h.get("pid")),
        "successful": _int(h.get("successful_job_count"), 0),
        "failed": _int(h.get("failed_job_count"), 0),
    }


def _rollout_row(redis: Any, rid: str, expires: float, now: float, server_now: float) -> dict[str, Any] | None:
    """One live rollout's row of :func:`collect` (``expires``: its lease's end, Redis's clock);
    ``None`` for a member that is no rollout id."""
    try:
        keys = K.RolloutKeys(rid)
    except ValueError:
        return None
    with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.info)
        pipe.hgetall(keys.budget)
        info_raw, budget_raw = pipe.execute()
    info, budget = _hash(info_raw), _hash(budget_raw)
    started = info.get("started")
    return {
        "id": rid,
        "row": info.get("row") or None,
        "model": info.get("model") or None,
        "sub_model": info.get("sub_model") or None,
        "queue": info.get("queue") or None,
        "depth": _int(info.get("depth"), 1),
        "parent": info.get("parent") or None,
        "ledger": info.get("ledger") or rid,
        "age": None if not started else max(0.0, now - float(started)),
        "expires_in": expires - server_now,
        "budget_limit": _int(budget.get("limit")),
        "budget_used": _int(budget.get("used"), 0) if budget else None,
        "budget_charged": _int(budget.get("charged"), 0) if budget else None,
        "budget_rejections": _int(budget.get("rejections"), 0) if budget else None,
    }


def _add_trees(redis: Any, rollouts: list[dict[str, Any]]) -> None:
    """Give each listed top rollout whose tree has children (live now, or that reserved from its
    ledger) a ``tree`` entry: ``live_children`` (listed rollouts of its ledger), ``model_calls``
    (grants of the tree's ledger: its sub-LLM calls and child root turns), ``charged`` (completion
    tokens charged to the tree), ``limit`` (``None``: no budget) and ``rejections`` (model calls
    the budget refused, child root turns that ended a child as ``budget_spent`` among them)."""
    children: dict[str, int] = {}
    for r in rollouts:
        if (r.get("depth") or 1) > 1:
            children[r["ledger"]] = children.get(r["ledger"], 0) + 1
    for r in rollouts:
        if (r.get("depth") or 1) > 1 or r["id"] not in children:
            continue
        ledger = _hash(redis.hgetall(K.LedgerKeys(r["id"]).budget))
        r["tree"] = {
            "live_children": children[r["id"]],
            "model_calls": _int(ledger.get("grants"), 0),
            "charged": _int(ledger.get("charged"), 0),
            "limit": _int(ledger.get("limit")),
            "rejections": _int(ledger.get("rejections"), 0),
        }


def _tree(r: dict[str, Any]) -> str:
    tree = r.get("tree")
    if (r.get("depth") or 1) > 1:
        return f"in {r['ledger']}'s tree"
    if not tree:
        return "-"
    if tree["limit"] is None:  # a tree without a budget counts nothing in its ledger
        return f"{tree['live_children']} live children (no budget: nothing charged)"
    text = f"{tree['live_children']} live children, {tree['model_calls']} model calls, {tree['charged']} charged"
    if tree["rejections"]:
        text += f", {tree['rejections']} refused by the budget"
    return text


def fmt_age(seconds: float | None) -> str:
    """``"-"``, ``"850ms"``, ``"12.3s"``, ``"4m05s"``, ``"2h07m"``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: left-aligned columns separated by two spaces."""
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _budget(r: dict[str, Any], tops: dict[str, dict[str, Any]] | None = None) -> str:
    """A rollout's budget cell; a child rollout spends its tree's (its top rollout's ledger)."""
    if r["budget_limit"] is None and (r.get("depth") or 1) > 1:
        top = (tops or {}).get(r["ledger"])
        if top is None:
            return f"the tree's ({r['ledger']})"
        return "no budget" if top["budget_limit"] is None else f"the tree's: {_budget(top)}"
    if r["budget_limit"] is None:
        return "no budget"
    text = f"{r['budget_used']}/{r['budget_limit']}"
    if r["budget_charged"] and r["budget_charged"] != r["budget_used"]:
        text += f" ({r['budget_charged']} charged)"
    if r["budget_rejections"]:
        text += f" {r['budget_rejections']} rejected"
    return text


def _providers(ps: list[dict[str, Any]]) -> list[str]:
    """The PROVIDER LIMITS table (none: nothing), what is used of each fleet-wide limit now."""
    if not ps:
        return []

    def of(used: int, limit: int | None) -> str:
        return f"{used}/{limit}" if limit else f"{used}/-"

    rows = [
        [
            p["upstream"], f"{p['window']:g} s", of(p["requests"], p["rpm"]), of(p["tokens"], p["tpm"]),
            of(p["running"], p["max_concurrent"]), f"{p['paused_for']:.1f} s" if p["paused_for"] else "-",
        ]
        for p in ps
    ]  # fmt: skip
    headers = ["UPSTREAM", "WINDOW", "REQUESTS/LIMIT", "TOKENS/LIMIT", "RUNNING/LIMIT", "PAUSED (429)"]
    return ["", f"PROVIDER LIMITS ({len(ps)})", table(headers, rows)]


def render(snap: dict[str, Any], *, redis_label: str = "") -> str:
    """The snapshot of :func:`collect` as plain text tables."""
    stamp = datetime.fromtimestamp(snap["time"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    out = [f"rlmq status  {redis_label}  {stamp}".replace("    ", "  ").strip(), ""]
    qs, ws, rs = snap["queues"], snap["workers"], snap["rollouts"]
    out += [f"QUEUES ({len(qs)})", _queue_table(qs)]
    inflight = sum(w["inflight"] for w in ws)
    live = sum(1 for w in ws if w.get("live", True))
    out += ["", f"WORKERS ({live} live, {inflight} sub-calls in flight)", _worker_table(ws)]
    out += _providers(snap.get("providers") or [])
    shown = "" if len(rs) == snap["rollouts_total"] else f", {len(rs)} shown"
    out += ["", f"LIVE ROLLOUTS ({snap['rollouts_total']}{shown})", _rollout_table(rs)]
    return "\n".join(out)


def _queue_table(qs: list[dict[str, Any]]) -> str:
    if not qs:
        return "  (none)"
    rows = [[q["name"], str(q["depth"]), fmt_age(q["oldest_age"]), str(q["started"]), str(q["failed"]),
             str(q["workers"])] for q in qs]  # fmt: skip
    return table(["QUEUE", "DEPTH", "OLDEST", "STARTED", "FAILED", "WORKERS"], rows)


def _worker_table(ws: list[dict[str, Any]]) -> str:
    if not ws:
        return "  (none)"
    rows = [
        [w["name"], w["state"], str(w["inflight"]), "-" if w["concurrency"] is None else str(w["concurrency"]),
         fmt_age(w["heartbeat_age"]), str(w["successful"]), str(w["failed"]), ",".join(w["queues"])]
        for w in ws
    ]  # fmt: skip
    return table(["WORKER", "STATE", "IN-FLIGHT", "CONCURRENCY", "HEARTBEAT", "OK", "FAILED", "QUEUES"], rows)


def _rollout_table(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "  (none)"
    tops = {r["id"]: r for r in rs if (r.get("depth") or 1) == 1}
    rows = [
        [r["id"], str(r.get("depth") or 1), r.get("parent") or "-", r["row"] or "-", r["model"] or "-",
         r["sub_model"] or "-", fmt_age(r["age"]), _budget(r, tops), _tree(r)]
        for r in rs
    ]  # fmt: skip
    header = ["ROLLOUT", "DEPTH", "PARENT", "ROW", "MODEL", "SUB-MODEL", "AGE", "SUB-LLM BUDGET USED/LIMIT", "TREE"]
    return table(header, rows)


def run_status(redis: Any, *, as_json: bool = False, watch: float | None = None, redis_label: str = "",
               out: Any = None, iterations: int | None = None) -> int:  # fmt: skip
    """Print the status once, or with ``watch`` every ``watch`` seconds until Ctrl-C.

    Args:
        iterations: stop after this many redraws (tests); ``None``: until interrupted.
    """
    out = out or sys.stdout
    n = 0
    try:
        while True:
            snap = collect(redis)
            if as_json:
                text = json.dumps(snap, indent=None if watch else 2)
            else:
                text = render(snap, redis_label=redis_label)
                if watch:
                    text = "\x1b[H\x1b[2J" + text + f"\n\n(every {watch:g} s; Ctrl-C to stop)"
            print(text, file=out, flush=True)
            n += 1
            if not watch or (iterations is not None and n >= iterations):
                return 0
            time.sleep(watch)  # the redraw period of --watch
    except KeyboardInterrupt:
        return 0
