"""RQ's records of jobs, kept truthful by rlmq's asyncio worker in batched Lua scripts.

A stock RQ worker spends about 57 Redis commands and a few milliseconds of Python per
job on bookkeeping, one job at a time. rlmq's worker holds hundreds of jobs in flight,
so it writes the same records (job hash status and timestamps, the started registry
with ``job_id:execution_id`` members and heartbeat-expiry scores, execution hashes, the
worker's executions set, finished / failed registries, the job's result stream) for a
whole batch of jobs in one script call. What is *not* written: RQ's per-job
``rq:executions:<job>`` index (only RQ's own horse reads it) and dependents/callbacks
(rlmq's jobs have none). ``tests/integration/test_records.py`` reads everything back
through RQ's own classes.

Every script takes all its keys through ``KEYS[]``; each has a header comment stating
its contract.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from dataclasses import dataclass, field
from string import Template
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from rlmq.common import keys as K
from rlmq.common.ledger import LEDGER_LUA, BudgetLedger
from rlmq.common.rqjobs import F_META, F_REPLY, JOB_FIELDS, utcnow_str
from rlmq.common.schemas import SubLLMResult
from rlmq.common.scripts import run_pipeline, sha1


def _lua(text: str) -> str:
    """A script with rlmq's job-hash field names spliced in (``$F_REPLY`` -> ``rlmq_reply``)."""
    return Template(text).substitute(JOB_FIELDS, REPLY_FIELD=K.REPLY_FIELD)


# Contract: move candidate jobs from the queue into the started state, atomically.
# KEYS[1] queue list, KEYS[2] started registry (zset), KEYS[3] worker executions set,
# then per candidate i (i = 1..n): KEYS[3+2i-1] job hash, KEYS[3+2i] execution hash.
# ARGV[1] worker name, ARGV[2] now as RQ timestamp text, ARGV[3] now (unix s),
# ARGV[4] heartbeat ttl (s), then per candidate: ARGV[3+2i] job id, ARGV[4+2i] execution id.
# A candidate no longer in the queue (another worker took it) is skipped; one whose hash
# has expired (its producer gave up) is dropped from the queue and skipped; so is one whose
# current attempt of its current enqueue has started before (rlmq_started = created_at/attempt):
# a copy re-queued by an enqueue applied twice (a client retry after a lost reply resends the
# same created_at). Only the reaper starts a new attempt (it increments rlmq_attempts) and a
# new enqueue of the same job id has a new created_at, so one attempt never runs twice at
# once and its budget reservations are never shared by two executions.
# When the candidates are still the head of the queue (the usual case) one LTRIM takes them all;
# ZADD / SADD run once per call.
# Safe to send twice (a client retry after a lost reply): a candidate no longer in the queue whose
# job hash says it is started with this very execution id ($F_EXEC) is returned again (and its
# registry entries re-asserted), so the worker learns of every job the first run took.
# Returns, per job taken: {job id, execution id, data, attempts, reply key, enqueued_at}.
START_LUA = _lua("""
local out = {}
local ttl = tonumber(ARGV[4])
local expires = tonumber(ARGV[3]) + ttl
local n = (#KEYS - 3) / 2
-- Fast path: the candidates are still exactly the head of the queue (the usual case: this
-- worker just peeked them) -> one LTRIM instead of an LREM per job.
local head = redis.call('LRANGE', KEYS[1], 0, n - 1)
local at_head = (#head == n)
if at_head then
  for i = 1, n do
    if head[i] ~= ARGV[3 + 2 * i] then at_head = false; break end
  end
end
if at_head then redis.call('LTRIM', KEYS[1], n, -1) end
local zargs, members = {}, {}
for i = 1, n do
  local jkey = KEYS[3 + 2 * i - 1]
  local ekey = KEYS[3 + 2 * i]
  local jid = ARGV[3 + 2 * i]
  local eid = ARGV[4 + 2 * i]
  local taken = at_head or redis.call('LREM', KEYS[1], 1, jid) == 1
  -- pcall: a job key that is not a hash (written by someone else) is skipped, never an error
  local f = redis.pcall('HMGET', jkey, 'data', '$F_ATTEMPTS', '$F_REPLY', 'enqueued_at', 'status',
                        '$F_STARTED', 'created_at', '$F_EXEC', 'worker_name')
  if f.err then f = {} end
  if not taken and f[5] == 'started' and f[8] == eid and f[9] == ARGV[1] then
    local member = jid .. ':' .. eid
    zargs[#zargs + 1] = expires
    zargs[#zargs + 1] = member
    members[#members + 1] = member
    out[#out + 1] = {jid, eid, f[1], f[2] or '0', f[3] or '', f[4] or ''}
  elseif taken then
    local mark = (f[7] or '') .. '/' .. ((tonumber(f[2]) or 0) + 1)
    if f[1] and f[5] == 'queued' and f[6] ~= mark then
      local member = jid .. ':' .. eid
      redis.call('HSET', jkey, 'status', 'started', 'worker_name', ARGV[1], 'started_at', ARGV[2],
                 'last_heartbeat', ARGV[2], '$F_STARTED', mark, '$F_EXEC', eid)
      redis.call('PERSIST', jkey)
      redis.call('HSET', ekey, 'id', eid, 'job_id', jid, 'created_at', ARGV[3], 'last_heartbeat', ARGV[3],
                 'worker_name', ARGV[1])
      redis.call('EXPIRE', ekey, ttl + 60)
      zargs[#zargs + 1] = expires
      zargs[#zargs + 1] = member
      members[#members + 1] = member
      out[#out + 1] = {jid, eid, f[1], f[2] or '0', f[3] or '', f[4] or ''}
    end
  end
end
for i = 1, #members, 500 do
  local last = math.min(i + 499, #members)
  redis.call('ZADD', KEYS[2], unpack(zargs, 2 * i - 1, 2 * last))
  redis.call('SADD', KEYS[3], unpack(members, i, last))
end
return out
""")
# Contract: record the end of executions and deliver their results, exactly once.
# KEYS[1] started registry, KEYS[2] worker executions set, KEYS[3] finished registry,
# KEYS[4] failed registry, KEYS[5] worker hash,
# then per job i: KEYS[5+4i-3] job hash, KEYS[5+4i-2] execution hash,
# KEYS[5+4i-1] result stream, KEYS[5+4i] reply stream.
# ARGV[1] now text, ARGV[2] now (unix s), ARGV[3] result ttl, ARGV[4] failure ttl,
# ARGV[5] reply ttl, ARGV[6] worker name,
# then per job i: ARGV[6+5i-4] job id, ARGV[6+5i-3] execution id, ARGV[6+5i-2] '1' ok / '0' failed,
# ARGV[6+5i-1] SubLLMResult JSON (added to the reply stream), ARGV[6+5i] RQ result payload
# (base64 return value when ok, base64 zlib exc string when failed).
# Only an execution still in the started registry is recorded and delivered: one the reaper
# re-queued meanwhile is a late duplicate and is dropped, and so is a second run of the same
# call (a client retry after a lost reply). Returns {recorded, undeliverable}.
# Every write to a key someone else can write (job hash, result stream, reply stream) goes
# through redis.pcall: a Lua error after a write would leave the jobs half-moved (out of the
# started registry, never delivered). A job whose reply key is not a stream is recorded as
# failed and counted undeliverable; a job hash that is not a hash is left alone.
# One ZMSCORE tells which are still live; registry, set, DEL and ZADD then run once per call
# over all live jobs; per job the job hash (HSET, EXPIRE), its result stream (XADD, EXPIRE)
# and its reply (XADD) cost a command each. Needs Redis >= 6.2.
FINISH_LUA = _lua("""
local n = (#KEYS - 5) / 4
local now = tonumber(ARGV[2])
local rttl, fttl, replyttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- Bulk commands run over slices of at most 500 arguments (Lua's C stack limits unpack).
local function bulk(cmd, key, list, step)
  step = step or 1
  local per = 500 * step
  for i = 1, #list, per do
    local last = math.min(i + per - 1, #list)
    if key then
      redis.call(cmd, key, unpack(list, i, last))
    else
      redis.call(cmd, unpack(list, i, last))
    end
  end
end
local members, seen = {}, {}
for i = 1, n do
  members[i] = ARGV[6 + 5 * i - 4] .. ':' .. ARGV[6 + 5 * i - 3]
end
local scores = {}
for i = 1, n, 500 do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(members, i, math.min(i + 499, n)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end
local live, ekeys, fin, fail = {}, {}, {}, {}
local ok_n, failed_n, lost = 0, 0, 0
local todo = {}
for i = 1, n do
  local member = members[i]
  if scores[i] and not seen[member] then
    seen[member] = true
    live[#live + 1] = member
    ekeys[#ekeys + 1] = KEYS[5 + 4 * i - 2]
    todo[#todo + 1] = i
  end
end
if #live == 0 then return {0, 0} end
-- Keys a producer can write (reply stream, job hash) are written with pcall: one of the
-- wrong type fails alone, never the script halfway (which would leave jobs half-moved).
for _, i in ipairs(todo) do
  local jkey, skey, rkey = KEYS[5 + 4 * i - 3], KEYS[5 + 4 * i - 1], KEYS[5 + 4 * i]
  local jid, eid, ok = ARGV[6 + 5 * i - 4], ARGV[6 + 5 * i - 3], ARGV[6 + 5 * i - 2]
  local sent = redis.pcall('XADD', rkey, '*', '$REPLY_FIELD', ARGV[6 + 5 * i - 1])
  if type(sent) == 'table' and sent.err then
    lost = lost + 1; ok = '0'
  else
    redis.call('EXPIRE', rkey, replyttl)
  end
  -- finished: RQ result type 1 with a return value; failed: type 2 with an exception string
  local status, ttl, registry, rtype, field = 'finished', rttl, fin, 1, 'return_value'
  if ok == '1' then
    ok_n = ok_n + 1
  else
    status, ttl, registry, rtype, field = 'failed', fttl, fail, 2, 'exc_string'
    failed_n = failed_n + 1
  end
  local h = redis.pcall('HSET', jkey, 'status', status, 'ended_at', ARGV[1])
  if not (type(h) == 'table' and h.err) then redis.call('EXPIRE', jkey, ttl) end
  registry[#registry + 1] = now + ttl
  registry[#registry + 1] = jid
  local x = redis.pcall('XADD', skey, 'MAXLEN', '~', 10, '*', 'type', rtype, 'worker_name', ARGV[6],
                        field, ARGV[6 + 5 * i], 'execution_id', eid, 'execution_ended_at', ARGV[2])
  if not (type(x) == 'table' and x.err) then redis.call('EXPIRE', skey, ttl) end
end
bulk('ZREM', KEYS[1], live)
bulk('SREM', KEYS[2], live)
bulk('DEL', nil, ekeys)
bulk('ZADD', KEYS[3], fin, 2)
bulk('ZADD', KEYS[4], fail, 2)
if ok_n > 0 then redis.call('HINCRBY', KEYS[5], 'successful_job_count', ok_n) end
if failed_n > 0 then redis.call('HINCRBY', KEYS[5], 'failed_job_count', failed_n) end
return {#live, lost}
""")
# Contract: take back executions whose worker stopped heartbeating (or that a worker hands
# back on shutdown), re-queueing or failing each one, atomically per execution.
# KEYS[1] started registry, KEYS[2] queue list, KEYS[3] failed registry,
# then per execution i: KEYS[3+5i-4] job hash, KEYS[3+5i-3] execution hash,
# KEYS[3+5i-2] result stream, KEYS[3+5i-1] reply stream, KEYS[3+5i] the worker executions set.
# ARGV[1] now text, ARGV[2] cutoff score (only members scored below it; '+inf' to hand back),
# ARGV[3] failure ttl, ARGV[4] reply ttl, ARGV[5] max attempts, ARGV[6] now (unix s),
# then per execution i: ARGV[6+3i-2] member 'job:exec', ARGV[6+3i-1] job id,
# ARGV[6+3i] SubLLMResult JSON of the error to deliver when attempts are used up.
# Keys a producer can write are written with redis.pcall (as in FINISH).
# Returns {requeued, failed}.
REAP_LUA = _lua("""
local requeued, failed = 0, 0
local n = (#KEYS - 3) / 5
local cutoff = ARGV[2]
local maxa = tonumber(ARGV[5])
for i = 1, n do
  local jkey, ekey, skey, rkey, wkey = KEYS[3+5*i-4], KEYS[3+5*i-3], KEYS[3+5*i-2], KEYS[3+5*i-1], KEYS[3+5*i]
  local member, jid = ARGV[6 + 3 * i - 2], ARGV[6 + 3 * i - 1]
  local score = redis.call('ZSCORE', KEYS[1], member)
  if score and (cutoff == '+inf' or tonumber(score) < tonumber(cutoff)) then
    redis.call('ZREM', KEYS[1], member)
    redis.call('DEL', ekey)
    redis.call('SREM', wkey, member)
    local st = redis.pcall('HGET', jkey, 'status')
    if st == 'started' then
      local attempts = redis.call('HINCRBY', jkey, '$F_ATTEMPTS', 1)
      if attempts < maxa then
        redis.call('HSET', jkey, 'status', 'queued', 'worker_name', '', 'started_at', '')
        redis.call('LPUSH', KEYS[2], jid)
        requeued = requeued + 1
      else
        local fttl = tonumber(ARGV[3])
        redis.call('HSET', jkey, 'status', 'failed', 'ended_at', ARGV[1])
        redis.call('EXPIRE', jkey, fttl)
        redis.call('ZADD', KEYS[3], tonumber(ARGV[6]) + fttl, jid)
        local x = redis.pcall('XADD', skey, 'MAXLEN', '~', 10, '*', 'type', 2, 'worker_name', '',
                              'exc_string', '', 'execution_ended_at', ARGV[6])
        if not (type(x) == 'table' and x.err) then redis.call('EXPIRE', skey, fttl) end
        local r = redis.pcall('XADD', rkey, '*', '$REPLY_FIELD', ARGV[6 + 3 * i])
        if not (type(r) == 'table' and r.err) then redis.call('EXPIRE', rkey, tonumber(ARGV[4])) end
        failed = failed + 1
      end
    end
  end
end
return {requeued, failed}
""")


def _slot_of(jid: str, meta_raw: bytes | None) -> tuple[str, str, int]:
    """``(rollout id, batch id, index)`` of a job, from its ``rlmq_meta`` or else its id."""
    try:
        meta = json.loads(meta_raw) if meta_raw else {}
        return str(meta["rollout_id"]), str(meta["batch_id"]), int(meta["index"])
    except (ValueError, TypeError, KeyError):
        return K.parse_job_id(jid) or ("unknown", "unknown", 0)


def rq_return_value(value: Any) -> str:
    """RQ's result-stream encoding of a return value with the JSON serializer."""
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode()


def rq_exc_string(text: str) -> str:
    """RQ's result-stream encoding of an exception string."""
    return base64.b64encode(zlib.compress(text.encode())).decode()


@dataclass
class StartedJob:
    """A job this worker now runs. Times in Unix seconds."""

    job_id: str
    execution_id: str
    data: bytes
    attempt: int
    reply_key: str

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"


@dataclass
class FinishedJob:
    """What :meth:`Records.finish` needs of one job."""

    job: StartedJob
    ok: bool
    result_json: str
    rq_payload: str
    """:func:`rq_return_value` of a summary when ok, :func:`rq_exc_string` otherwise."""
    settles: list[tuple[str, str, int]] = field(default_factory=list)
    """Budget settlements sent in the same round trip as ``FINISH`` (rollout, reservation, used)."""


class Records:
    """RQ-compatible bookkeeping of one worker on one queue, batched.

    Args:
        redis: asyncio client, ``decode_responses=False``.
        queue: RQ queue name.
        worker_name: RQ worker name (its ``rq:worker:<name>`` hash is written by RQ's
            own ``Worker.register_birth``).
        heartbeat_ttl: seconds a started job stays owned without a heartbeat.
        result_ttl / failure_ttl / reply_ttl: seconds finished jobs, failed jobs and
            reply lists are kept.
        max_attempts: executions a job may get before the reaper fails it.
        ledger: the budget ledger whose settlements :meth:`finish` sends along (see
            :attr:`FinishedJob.settles`).
    """

    def __init__(
        self,
        redis: Redis,
        queue: str,
        worker_name: str,
        *,
        heartbeat_ttl: int = 10,
        result_ttl: int = 600,
        failure_ttl: int = 86400,
        reply_ttl: int = 3600,
        max_attempts: int = 2,
        ledger: BudgetLedger | None = None,
    ) -> None:
        self.redis = redis
        self.ledger = ledger
        self.queue = queue
        self.worker_name = worker_name
        self.heartbeat_ttl = heartbeat_ttl
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.reply_ttl = reply_ttl
        self.max_attempts = max_attempts
        self.queue_key = K.rq_queue(queue)
        self.started_key = K.rq_started(queue)
        self.worker_key = K.rq_worker(worker_name)
        self.executions_key = K.rq_worker_executions(worker_name)
        self._start = redis.register_script(START_LUA)
        self._finish_sha = sha1(FINISH_LUA)
        self._reap = redis.register_script(REAP_LUA)
        self._exec_seq = 0
        self._exec_prefix = f"{time.time_ns():x}"

    def _next_execution_id(self) -> str:
        self._exec_seq += 1
        return f"{self._exec_prefix}{self._exec_seq:x}"

    async def start(self, job_ids: list[bytes]) -> list[StartedJob]:
        """Take the given queued jobs and mark them started by this worker (one round trip).

        Safe to re-send after a lost reply (see ``START_LUA``): the jobs the first run took
        come back again, so none is left started with nobody running it."""
        if not job_ids:
            return []
        keys: list[str] = [self.queue_key, self.started_key, self.executions_key]
        argv: list[Any] = [self.worker_name, utcnow_str(), time.time(), self.heartbeat_ttl]
        for raw in job_ids:
            jid = raw.decode()
            eid = self._next_execution_id()
            keys += [K.rq_job(jid), K.rq_execution(jid, eid)]
            argv += [jid, eid]
        rows: list[list[bytes]] = await self._start(keys=keys, args=argv)
        return [
            StartedJob(
                job_id=r[0].decode(),
                execution_id=r[1].decode(),
                data=r[2],
                attempt=int(r[3] or 0) + 1,
                reply_key=r[4].decode(),
            )
            for r in rows
        ]

    async def finish(self, done: list[FinishedJob]) -> tuple[int, int]:
        """Record the end of ``done`` and add their results to their reply streams.

        The budget settlements the jobs carry (:attr:`FinishedJob.settles`) go first, in the
        same round trip. Safe to run twice (a retry after a lost reply records nothing twice).

        Returns:
            ``(recorded, undeliverable)``: jobs recorded now (the others were taken back by
            the reaper, or recorded by an earlier run of the same call), and of those, jobs
            whose reply key was not a stream (recorded as failed; the producer's slot ends
            at its deadline).

        Raises:
            redis.RedisError: an error reply (``READONLY``, ``OOM``, ...) or a lost connection;
                nothing was moved then, and the same call may be made again.
        """
        if not done:
            return (0, 0)
        keys: list[str] = [
            self.started_key,
            self.executions_key,
            K.rq_finished(self.queue),
            K.rq_failed(self.queue),
            self.worker_key,
        ]
        argv: list[Any] = [
            utcnow_str(), time.time(), self.result_ttl, self.failure_ttl, self.reply_ttl, self.worker_name,
        ]  # fmt: skip
        for d in done:
            j = d.job
            keys += [K.rq_job(j.job_id), K.rq_execution(j.job_id, j.execution_id), K.rq_results(j.job_id), j.reply_key]
            argv += [j.job_id, j.execution_id, "1" if d.ok else "0", d.result_json, d.rq_payload]
        settles = [s for d in done for s in d.settles]

        # Settlements first, then FINISH, in one round trip on one connection: by the time a
        # producer sees a result, the ledger has already released what its last call did not use.
        def build(pipe: Pipeline) -> None:
            if settles and self.ledger is not None:
                self.ledger.add_settles(pipe, settles)
            pipe.evalsha(self._finish_sha, len(keys), *keys, *argv)

        outcomes = await run_pipeline(self.redis, build, [LEDGER_LUA, FINISH_LUA])
        recorded, undeliverable = outcomes[-1]
        return int(recorded), int(undeliverable)

    async def heartbeat(self, members: list[str], state: str) -> None:
        """Extend this worker's ownership of ``members`` (``job:exec``) and its own liveness
        (its RQ worker hash and its entry in :func:`rlmq.common.keys.serving`)."""
        expires = time.time() + self.heartbeat_ttl
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in range(0, len(members), 2000):
                chunk = members[i : i + 2000]
                pipe.zadd(self.started_key, dict.fromkeys(chunk, expires), xx=True)
            pipe.hset(self.worker_key, mapping={"last_heartbeat": utcnow_str(), "state": state})
            pipe.expire(self.worker_key, self.heartbeat_ttl + 60)
            pipe.expire(self.executions_key, self.heartbeat_ttl + 60)
            serving = K.serving(self.queue)
            pipe.zadd(serving, {self.worker_name: expires})
            pipe.zremrangebyscore(serving, "-inf", expires - self.heartbeat_ttl - 3600)  # long-dead workers
            await pipe.execute()

    async def expired_members(self, limit: int = 200) -> list[str]:
        """Started-registry members whose heartbeat has lapsed (oldest first)."""
        raw = await self.redis.zrangebyscore(self.started_key, "-inf", time.time(), start=0, num=limit)
        return [m.decode() for m in cast(list[bytes], raw)]

    async def reap(self, members: list[str], *, hand_back: bool = False) -> tuple[int, int]:
        """Re-queue (or fail, when out of attempts) the executions ``members``.

        With ``hand_back`` the members are taken back whatever their heartbeat (graceful
        shutdown); otherwise only those whose heartbeat has lapsed. A job failed here gets
        an error :class:`~common.schemas.SubLLMResult` on its reply stream.

        Returns:
            ``(requeued, failed)``.
        """
        if not members:
            return (0, 0)
        job_ids = [m.rsplit(":", 1)[0] for m in members]
        async with self.redis.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.hmget(K.rq_job(jid), F_REPLY, F_META, "worker_name")
            infos: list[list[bytes | None] | Exception] = await pipe.execute(raise_on_error=False)
        keys: list[str] = [self.started_key, self.queue_key, K.rq_failed(self.queue)]
        argv: list[Any] = [
            utcnow_str(), "+inf" if hand_back else time.time(), self.failure_ttl, self.reply_ttl,
            self.max_attempts, time.time(),
        ]  # fmt: skip
        for member, jid, info in zip(members, job_ids, infos, strict=True):
            reply, meta_raw, worker = info if not isinstance(info, Exception) else (None, None, None)
            rollout, batch, index = _slot_of(jid, meta_raw)
            eid = member.rsplit(":", 1)[1]
            err = SubLLMResult.failure(
                rollout, batch, index, job_id=jid, kind="abandoned",
                content="[error] sub-LLM call lost: its worker died and the retries are used up",
                error="worker stopped heartbeating",
            )  # fmt: skip
            wname = worker.decode() if worker else self.worker_name
            keys += [
                K.rq_job(jid), K.rq_execution(jid, eid), K.rq_results(jid),
                reply.decode() if reply else K.ORPHAN_REPLIES, K.rq_worker_executions(wname),
            ]  # fmt: skip
            argv += [member, jid, err.model_dump_json()]
        res = await self._reap(keys=keys, args=argv)
        return int(res[0]), int(res[1])
