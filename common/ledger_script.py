"""The Lua script of the budget ledger (:mod:`rlmq.common.ledger`): its one wire format.

Kept apart from the Python side so each stays readable; :data:`LEDGER_LUA` is re-exported by
:mod:`rlmq.common.ledger`, whose docstring states the policy the script implements.
"""

# KEYS[1] budget hash, KEYS[2] reservations hash, KEYS[3] live-open sorted set, KEYS[4] release
# channel (one rollout: all share its hash tag). ARGV[1] TTL seconds, ARGV[2] now (Unix seconds),
# then per operation i four arguments from ARGV[4i-1]: kind ('r' reserve, 's' settle, 'x' retire),
# reservation id, n, deadline (both unused by a retire). For a reserve n is the caller's cap in
# tokens (<= 0: none; it can only lower the ledger's own 'cap') and deadline the call's deadline
# (Unix seconds); for a settle
# n is the completion tokens the server reported (>= 0) and deadline is unused.
# The operations are applied in order, each exactly as if it ran alone; the script reads the
# ledger once (HMGET) and writes it once (HSET). Returns one {a, charged, limit, code, next[, need]}
# per operation:
# * reserve: a = grant. code 0 granted (grant > 0); 1 rejected (grant 0: nothing free and no live
#   reservation that could give tokens back); 2 no ledger (budget hash missing: expired, lost, or
#   an unbudgeted rollout); 3 already settled (a retried job asked again for a closed reservation);
#   4 wait (less than a full grant is free but live reservations may give some back: ask again
#   after a release, or at 'next', the earliest live reservation's deadline in ms, when it stops
#   counting as live, and need, the grant it waits for). An open reservation with the same id
#   returns its grant again.
#   The grant is min(cap, free), free = limit - charged, cap = min(ledger cap, caller's cap); it is
#   given when free >= need = ceil(min(cap, limit) / 2) (half a full grant; no cap: free > 0), or,
#   when no live reservation is left, whatever is free (the last remainder).
# * retire ('x'): the reservation stops being live (its job was handed to a new attempt: its
#   worker is presumed dead); it stays open and charged, and can still be settled. a = 1 when
#   it was live. Waiters are told, as after a settle.
# * settle: a = released = grant - used (>= 0 with a server that honours max_tokens; a server
#   that returned more than its grant is charged the excess, recorded in 'overrun').
#   code 0 settled now, 1 already settled (nothing changes), 2 unknown reservation.
# A live reservation is an open one whose call's deadline has not passed (KEYS[3], scored by
# deadline): one held by a dead worker stops being live at its deadline but stays charged.
# After any settle, once the rollout has had a waiter, the script publishes '<free> <live>' on
# KEYS[4] (free = limit - charged, live = live reservations left): waiters wake by it.
# The reservations hash gets its TTL with the rollout's first grant, the live set with every
# script that adds to it (the producer's key refresh keeps both alive with the ledger).
LEDGER_LUA = """
local ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local nops = (#ARGV - 2) / 4
local b = redis.call('HMGET', KEYS[1], 'limit', 'charged', 'grants', 'used', 'released', 'overrun', 'rejections',
                     'waits', 'cap')
local limit, lcap = tonumber(b[1]), tonumber(b[9] or '0')
local f = {charged = tonumber(b[2] or '0'), grants = tonumber(b[3] or '0'), used = tonumber(b[4] or '0'),
           released = tonumber(b[5] or '0'), overrun = tonumber(b[6] or '0'), rejections = tonumber(b[7] or '0'),
           waits = tonumber(b[8] or '0')}
local changed, names = {}, {'charged', 'grants', 'used', 'released', 'overrun', 'rejections', 'waits'}
local state, writes, order = {}, {}, {}
local ids = {}
for i = 1, nops do ids[i] = ARGV[4 * i] end
for i = 1, nops, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, nops)))
  for j = 1, #part do
    if part[j] then state[ids[i + j - 1]] = part[j] end
  end
end
local function put(id, value)
  if not writes[id] then order[#order + 1] = id end
  writes[id] = value
  state[id] = value
end
local live = nil
local function live_count()
  if live == nil then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
    live = redis.call('ZCARD', KEYS[3])
  end
  return live
end
local added, settled, first_grant = false, false, false
local out = {}
for i = 1, nops do
  local kind, id, n, dl = ARGV[4 * i - 1], ARGV[4 * i], tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2])
  local s = state[id]
  if kind == 'r' then
    if not limit then
      out[i] = {0, 0, 0, 2, 0}
    elseif s then
      if string.sub(s, 1, 5) == 'open:' then
        out[i] = {tonumber(string.sub(s, 6)), f.charged, limit, 0, 0}
      else
        out[i] = {0, f.charged, limit, 3, 0}
      end
    else
      local cap = lcap
      if n > 0 and (cap <= 0 or n < cap) then cap = n end
      local free = limit - f.charged
      local full = 1
      if cap > 0 then full = math.ceil(math.min(cap, limit) / 2) end
      local grant = 0
      if free >= full then
        grant = free
        if cap > 0 and cap < grant then grant = cap end
      elseif live_count() > 0 then
        local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
        f.waits = f.waits + 1
        changed.waits = true
        out[i] = {0, f.charged, limit, 4, math.floor(tonumber(first[2]) * 1000), full}
      elseif free > 0 then
        grant = free
      end
      if grant > 0 then
        if f.grants == 0 then first_grant = true end
        f.charged = f.charged + grant
        f.grants = f.grants + 1
        changed.charged, changed.grants = true, true
        put(id, 'open:' .. grant)
        if dl > now then
          redis.call('ZADD', KEYS[3], dl, id)
          if live ~= nil then live = live + 1 end
          added = true
        end
        out[i] = {grant, f.charged, limit, 0, 0}
      elseif not out[i] then
        f.rejections = f.rejections + 1
        changed.rejections = true
        out[i] = {0, f.charged, limit, 1, 0}
      end
    end
  elseif kind == 'x' then
    local removed = redis.call('ZREM', KEYS[3], id)
    if removed > 0 then
      live = nil
      settled = true
    end
    out[i] = {removed, f.charged, limit or 0, 0, 0}
  else
    local lim = limit or 0
    if not s then
      out[i] = {0, f.charged, lim, 2, 0}
    elseif string.sub(s, 1, 5) ~= 'open:' then
      out[i] = {0, f.charged, lim, 1, 0}
    else
      local release = tonumber(string.sub(s, 6)) - n
      f.charged = f.charged - release
      f.used = f.used + n
      changed.charged, changed.used = true, true
      if release > 0 then
        f.released = f.released + release
        changed.released = true
      elseif release < 0 then
        f.overrun = f.overrun - release
        changed.overrun = true
      end
      put(id, 'settled:' .. n)
      if live ~= nil then live = nil end
      redis.call('ZREM', KEYS[3], id)
      settled = true
      out[i] = {release, f.charged, lim, 0, 0}
    end
  end
end
local hset = {}
for _, name in ipairs(names) do
  if changed[name] then
    hset[#hset + 1] = name
    hset[#hset + 1] = f[name]
  end
end
if #hset > 0 and limit then redis.call('HSET', KEYS[1], unpack(hset)) end  -- never re-create a lost ledger
local rargs = {}
for _, id in ipairs(order) do
  rargs[#rargs + 1] = id
  rargs[#rargs + 1] = writes[id]
end
for i = 1, #rargs, 1000 do
  redis.call('HSET', KEYS[2], unpack(rargs, i, math.min(i + 999, #rargs)))
end
if first_grant then redis.call('EXPIRE', KEYS[2], ttl) end
if added then redis.call('EXPIRE', KEYS[3], ttl) end
if settled and f.waits > 0 then
  redis.call('PUBLISH', KEYS[4], (limit or 0) - f.charged .. ' ' .. live_count())
end
return out
"""
