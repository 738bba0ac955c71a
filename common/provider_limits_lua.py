"""The Lua scripts of the fleet-wide provider limits (:mod:`rlmq.common.provider_limits`), with their contracts.

"Now" is always Redis's ``TIME``, never a worker's clock: workers on hosts whose clocks differ
count one window. Keys (:meth:`rlmq.common.keys.ProviderKeys.all`, one hash tag): ``KEYS[1]`` the
window's log (sorted set: request id -> grant time), ``KEYS[2]`` the tokens each request counts
(hash, plus ``_sum``), ``KEYS[3]`` the requests in flight (sorted set: id -> lease end),
``KEYS[4]`` the pause (string: until when the upstream is paused after a 429).
"""

from __future__ import annotations

ACQUIRE_LUA = """
-- ARGV: rpm, tpm, max concurrent (0: no limit), window (s, the margin included), lease (s),
-- ttl (s) of the keys, then one (request id, tokens) pair per request, in the order to grant.
-- Grants the requests in order while each fits every limit; stops at the first that does not.
-- Returns {granted, wait_ms, reason}: how many were granted, and for the first one refused how
-- long until it may fit (ms; a poll interval when unknown) and why ('paused', 'concurrent',
-- 'rpm', 'tpm'); reason 'ok' when all were granted. A request whose tokens alone pass tpm is
-- granted when the window holds no tokens (so it never waits for ever).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window, lease, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local poll = 25
local pause = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
if pause > now then
  return {0, math.ceil((pause - now) * 1000), 'paused'}
end
local sum = tonumber(redis.call('HGET', KEYS[2], '_sum') or '0') or 0
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
if #old > 0 then
  for i = 1, #old, 500 do
    local part = {}
    for j = i, math.min(i + 499, #old) do
      sum = sum - (tonumber(redis.call('HGET', KEYS[2], old[j]) or '0') or 0)
      part[#part + 1] = old[j]
    end
    redis.call('HDEL', KEYS[2], unpack(part))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  if sum < 0 then sum = 0 end
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local count = redis.call('ZCARD', KEYS[1])
local running = redis.call('ZCARD', KEYS[3])
local granted, wait, reason = 0, 0, 'ok'
local i = 7
while i < #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  if maxc > 0 and running >= maxc then
    wait, reason = poll, 'concurrent'
    break
  end
  if rpm > 0 and count >= rpm then
    local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    wait, reason = (tonumber(e[2]) + window - now) * 1000, 'rpm'
    break
  end
  if tpm > 0 and sum > 0 and sum + n > tpm then
    local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
    local free, at = tpm - sum, nil
    for j = 1, #entries, 2 do
      free = free + (tonumber(redis.call('HGET', KEYS[2], entries[j]) or '0') or 0)
      if free >= n then
        at = tonumber(entries[j + 1])
        break
      end
    end
    wait, reason = poll, 'tpm'
    if at then wait = (at + window - now) * 1000 end
    break
  end
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('HSET', KEYS[2], id, n)
  redis.call('ZADD', KEYS[3], now + lease, id)
  count, running, sum = count + 1, running + 1, sum + n
  granted = granted + 1
  i = i + 2
end
redis.call('HSET', KEYS[2], '_sum', sum)
for k = 1, 3 do
  redis.call('EXPIRE', KEYS[k], ttl)
end
if wait < 1 and reason ~= 'ok' then wait = 1 end
return {granted, math.ceil(wait), reason}
"""

FINISH_LUA = """
-- ARGV: request id, tokens it spent (< 0: keep what it counts). Ends its lease (it no longer runs)
-- and, while it is still in the window, corrects the tokens it counts. Idempotent. Returns 1.
redis.call('ZREM', KEYS[3], ARGV[1])
local n = tonumber(ARGV[2])
if n >= 0 then
  local old = redis.call('HGET', KEYS[2], ARGV[1])
  if old then
    redis.call('HSET', KEYS[2], ARGV[1], n)
    redis.call('HINCRBY', KEYS[2], '_sum', n - tonumber(old))
  end
end
return 1
"""

PAUSE_LUA = """
-- ARGV: seconds. Pauses the upstream until now + seconds, unless it is already paused longer.
-- Returns the pause's end (Unix seconds, Redis's clock) as a string.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local seconds = tonumber(ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
local untilv = now + seconds
if untilv > cur then
  redis.call('SET', KEYS[4], string.format('%.6f', untilv), 'PX', math.ceil(seconds * 1000) + 1000)
  return string.format('%.6f', untilv)
end
return string.format('%.6f', cur)
"""
