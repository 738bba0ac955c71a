"""The Lua scripts of the job store (``ENQUEUE``, ``START``, ``FINISH``, ``REAP``), each with its contract.

Called by :class:`rlmq.common.jobs.store.JobStore` (``ENQUEUE``: by the producer's dispatch). rlmq's
job-hash field names are spliced in from :mod:`rlmq.common.jobs.record` (``$F_REPLY`` -> ``rlmq_reply``),
so they are spelled once.
"""

from __future__ import annotations

from string import Template

from rlmq.common import keys as K
from rlmq.common.jobs.record import JOB_FIELDS


def _lua(text: str) -> str:
    """A script with rlmq's job-hash field names spliced in (``$F_REPLY`` -> ``rlmq_reply``)."""
    return Template(text).substitute(JOB_FIELDS, REPLY_FIELD=K.REPLY_FIELD)


# Contract: enqueue jobs at most once per call, also when the call is sent twice (a client
# retry after a lost reply re-sends it with the same created_at).
# KEYS[1] queue list, then per job i: KEYS[1+i] job hash.
# ARGV[1] job hash ttl (s), ARGV[2] created_at (RQ timestamp text), ARGV[3] c = number of
# common field/value pairs, ARGV[4 .. 3+2c] the fields and values every job hash shares, then
# per job i (o = 3+2c+4(i-1)): ARGV[o+1] job id, ARGV[o+2] data, ARGV[o+3] description,
# ARGV[o+4] rlmq_meta.
# A job whose hash already carries this created_at was written by an earlier run of this very
# call: it is neither written nor pushed again. All or nothing: the only key that could fail a
# write halfway, the queue, is checked first (a job key of another type is replaced).
# Returns the number of jobs pushed.
ENQUEUE_LUA = _lua("""
if type(redis.pcall('LLEN', KEYS[1])) == 'table' then
  return redis.error_reply('WRONGTYPE the queue key is not a list; nothing enqueued')
end
local c = tonumber(ARGV[3])
local common = {}
for k = 4, 3 + 2 * c do common[#common + 1] = ARGV[k] end
local base = 3 + 2 * c
local ids = {}
for i = 1, #KEYS - 1 do
  local jkey = KEYS[1 + i]
  local o = base + 4 * (i - 1)
  local seen = redis.pcall('HGET', jkey, 'created_at')
  if seen ~= ARGV[2] then
    if type(seen) == 'table' and seen.err then redis.call('DEL', jkey) end  -- not a hash: replaced
    redis.call('HSET', jkey, 'data', ARGV[o + 2], 'description', ARGV[o + 3], '$F_META', ARGV[o + 4],
               unpack(common))
    redis.call('EXPIRE', jkey, ARGV[1])
    ids[#ids + 1] = ARGV[o + 1]
  end
end
for i = 1, #ids, 500 do
  redis.call('RPUSH', KEYS[1], unpack(ids, i, math.min(i + 499, #ids)))
end
return #ids
""")
# Contract: move candidate jobs from the queue into the started state, atomically.
# KEYS[1] queue list, KEYS[2] started registry (zset), KEYS[3] worker executions set,
# then per candidate i (i = 1..n): KEYS[3+2i-1] job hash, KEYS[3+2i] execution hash.
# ARGV[1] worker name, ARGV[2] now as RQ timestamp text, ARGV[3] unused (leases take Redis's TIME),
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
local clock = redis.call('TIME')  -- leases are Redis's clock, never one host's
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local expires = now + ttl
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
      redis.call('HSET', ekey, 'id', eid, 'job_id', jid, 'created_at', now, 'last_heartbeat', now,
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
# ARGV[1] now text, ARGV[2] now (unix s; registry scores take Redis's TIME), ARGV[3] result ttl, ARGV[4] failure ttl,
# ARGV[5] reply ttl of a job whose hash names none ($F_REPLY_TTL, the producer's), ARGV[6] worker name,
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
local clock = redis.call('TIME')  -- registry expiries are Redis's clock, as the pruning compares them
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local rttl, fttl, replyttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- The reply TTL a job carries ($F_REPLY_TTL: its producer's), else the default; never < 1 (an
-- EXPIRE of 0 would delete the reply stream with the results in it).
local function reply_ttl(jkey, default)
  local t = tonumber(redis.pcall('HGET', jkey, '$F_REPLY_TTL'))
  if t and t >= 1 then return t end
  return default
end
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
local live, ekeys, fin, fail, expiring = {}, {}, {}, {}, {}
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
  elseif not expiring[rkey] then
    expiring[rkey] = true
    redis.call('EXPIRE', rkey, reply_ttl(jkey, replyttl))
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
# ARGV[1] now text, ARGV[2] 'now' (members whose lease lapsed by Redis's TIME) or '+inf' (hand back),
# ARGV[3] failure ttl, ARGV[4] reply ttl of a job whose hash names none ($F_REPLY_TTL),
# ARGV[5] max attempts, ARGV[6] unused (Redis's TIME),
# then per execution i: ARGV[6+3i-2] member 'job:exec', ARGV[6+3i-1] job id,
# ARGV[6+3i] SubLLMResult JSON of the error to deliver when attempts are used up.
# Keys a producer can write are written with redis.pcall (as in FINISH).
# Returns {requeued, failed, taken}: taken = {job id, attempt, ...}, the executions taken back and the
# attempt number (from 1) each one ran as.
REAP_LUA = _lua("""
local requeued, failed, taken = 0, 0, {}
local n = (#KEYS - 3) / 5
local clock = redis.call('TIME')  -- a lease has lapsed by Redis's clock, never by the reaper host's
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local cutoff = ARGV[2]
if cutoff ~= '+inf' then cutoff = now end
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
      taken[#taken + 1] = jid
      taken[#taken + 1] = attempts
      if attempts < maxa then
        redis.call('HSET', jkey, 'status', 'queued', 'worker_name', '', 'started_at', '')
        redis.call('LPUSH', KEYS[2], jid)
        requeued = requeued + 1
      else
        local fttl = tonumber(ARGV[3])
        redis.call('HSET', jkey, 'status', 'failed', 'ended_at', ARGV[1])
        redis.call('EXPIRE', jkey, fttl)
        redis.call('ZADD', KEYS[3], now + fttl, jid)
        local x = redis.pcall('XADD', skey, 'MAXLEN', '~', 10, '*', 'type', 2, 'worker_name', '',
                              'exc_string', '', 'execution_ended_at', ARGV[6])
        if not (type(x) == 'table' and x.err) then redis.call('EXPIRE', skey, fttl) end
        local r = redis.pcall('XADD', rkey, '*', '$REPLY_FIELD', ARGV[6 + 3 * i])
        if not (type(r) == 'table' and r.err) then
          local t = tonumber(redis.pcall('HGET', jkey, '$F_REPLY_TTL'))
          if not (t and t >= 1) then t = tonumber(ARGV[4]) end
          redis.call('EXPIRE', rkey, t)
        end
        failed = failed + 1
      end
    end
  end
end
return {requeued, failed, taken}
""")
