"""The Lua script of the budget ledger (:mod:`rlmq.common.ledger`): its one wire format.

Kept apart from the Python side so each stays readable; :data:`LEDGER_LUA` is re-exported by
:mod:`rlmq.common.ledger`, whose docstring states the policy the script implements.
"""

GRANT_LEASE = 5.0
"""Seconds a leased grant may wait for its call to begin (``sub_llm_budget_grant_lease``): a grant
whose call has not reached the model by then (its job was cancelled, lost its ``START``, or its
worker died before calling) is reclaimed by the ledger's next reservation. Reclaiming never touches
a begun grant, so a short lease costs at most a second reservation, never an overshoot."""

# KEYS[1] budget hash, KEYS[2] reservations hash, KEYS[3] live-open sorted set, KEYS[4] release
# channel, KEYS[5] grant-lease sorted set (one ledger: all share its id's hash tag), then KEYS[6..]
# the node keys of the calling rollout's tree chain (top .. caller; none for a call of a top
# rollout): a reservation is refused with code 6 when the ledger is 'closed' (its top rollout ended)
# and with code 7 when one of those node keys is gone (the caller, or an ancestor, ended or died;
# 'next' = the missing node's position in the chain, from 1). Settles, retires, begins and give-backs
# are never refused: tokens spent are always recorded.
# ARGV[1] the TTL (seconds) of a ledger that
# stores none (opened by an older producer; 0: the budget hash's own remaining TTL): a ledger
# opened now stores its owner's TTL in its 'ttl' field and the script uses that, never the
# caller's (a stored 'ttl' that is not a whole number of seconds from 1 to ten years is ignored:
# an EXPIRE that fails mid-script would leave a grant charged with nobody to settle it). ARGV[2]
# the grant lease (seconds) of a leased reservation ('L' ops; now is Redis's TIME),
# then per operation i four arguments from ARGV[4i-1]: kind ('r' reserve, 'r:<kind>' reserve of
# reservation kind <kind>, 'L' / 'L:<kind>' the same, leased, 's' settle, 'x' retire, 'b' begin,
# 'u' give back), reservation id, n, deadline (both unused by a retire, a begin, a give-back).
# For a reserve n is the caller's cap in tokens (<= 0: none; it can only lower the
# ledger's own cap of the kind: 'cap' for 'r', 'cap:<kind>' for 'r:<kind>', none when unset) and
# deadline the call's deadline (Unix seconds); for a settle
# n is the completion tokens the server reported (>= 0) and deadline is unused.
# The operations are applied in order, each exactly as if it ran alone; the script reads the
# ledger once (HMGET) and writes it once (HSET). Returns one {a, charged, limit, code, next[, need]}
# per operation:
# * reserve: a = grant. code 0 granted (grant > 0); 1 rejected (grant 0: nothing free and no live
#   reservation that could give tokens back); 2 no ledger (budget hash missing: expired, lost, or
#   an unbudgeted rollout); 3 already settled (a retried job asked again for a closed reservation);
#   8 unlimited (a liveness-only ledger, field 'unlimited', no 'limit': a tree without a budget;
#   the chain is alive, call without a grant and settle nothing);
#   4 wait (less than a full grant is free but live reservations may give some back: ask again
#   after a release, or at 'next', in ms, the earliest of the live reservations' deadlines (when
#   one stops counting as live) and the grant leases' ends (when one may be reclaimed), and need,
#   the grant it waits for). An open reservation with the same id returns its grant again (begun
#   or not); an unleased reserve ('r') of a leased grant not begun yet begins it (its caller calls
#   the model at once, without a begin of its own).
#   The grant is min(cap, free), free = limit - charged, cap = min(ledger cap, caller's cap); it is
#   given when free >= need = ceil(min(cap, limit) / 2) (half a full grant; no cap: free > 0), or,
#   when no live reservation is left, whatever is free (the last remainder).
# * leased reserve ('L'): a new grant is also *leased*: it must be begun ('b') within ARGV[2]
#   seconds, i.e. before its call reaches the model. A reserve finds the leases that ended unbegun
#   (KEYS[5], scored by their end) and reclaims them first: their grants go back to the budget
#   and their ids are forgotten (reserving one again is a new grant), as if never reserved: no
#   model call ever ran under them, so the budget stays exact.
# * begin ('b'): the call is about to reach the model: the reservation becomes 'call:<grant>' and
#   its lease ends (it can no longer be reclaimed, only settled). a = grant, code 0; code 2 when the
#   reservation is unknown (its lease was reclaimed: reserve again), 1 when it is settled.
# * give back ('u'): a leased grant not begun goes back now (the call holding it will not run, or
#   runs under a new grant), as a reclaim does. a = tokens given back (0: nothing to give back:
#   begun, settled, unknown, or never leased).
# * retire ('x'): the reservation stops being live (its job was handed to a new attempt: its
#   worker is presumed dead); it stays open and charged, and can still be settled. a = 1 when
#   it was live. Waiters are told, as after a settle.
# * settle: a = released = grant - used (>= 0 with a server that honours max_tokens; a server
#   that returned more than its grant is charged the excess, recorded in 'overrun').
#   code 0 settled now, 1 already settled (nothing changes), 2 unknown reservation.
# A live reservation is an open one whose call's deadline has not passed (KEYS[3], scored by
# deadline): one held by a dead worker stops being live at its deadline but stays charged.
# After any settle, give-back or reclaim, and after a leased grant, once the rollout has had a
# waiter, the script publishes '<free> <live>' on KEYS[4] (free = limit - charged, live = live
# reservations left), followed by ' <lease end>' (Unix seconds) when a grant lease is open:
# waiters wake by it, and ask again when that lease ends.
# The reservations hash gets the ledger's stored TTL with the ledger's first grant, the live set
# and the lease set with every script that adds to them (the owner's key refresh keeps them alive
# with the ledger).
LEDGER_LUA = """
local ttl = tonumber(ARGV[1])
local lease = tonumber(ARGV[2]) or 0
local clock = redis.call('TIME')  -- "now" is Redis's clock, never the calling host's
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local nops = (#ARGV - 2) / 4
local b = redis.call('HMGET', KEYS[1], 'limit', 'charged', 'grants', 'used', 'released', 'overrun', 'rejections',
                     'waits', 'cap', 'ttl', 'closed', 'unlimited', 'reclaimed')
local limit, lcap = tonumber(b[1]), tonumber(b[9] or '0')
local refusal = nil  -- {code, position}: why this ledger refuses every reservation now (computed once)
local function tree_refusal()
  if refusal == nil then
    refusal = false
    if b[11] then
      refusal = {6, 0}
    elseif #KEYS > 5 then
      local nodes = {}
      for k = 6, #KEYS do nodes[#nodes + 1] = KEYS[k] end
      if redis.call('EXISTS', unpack(nodes)) < #nodes then
        for k = 6, #KEYS do
          if redis.call('EXISTS', KEYS[k]) == 0 then
            refusal = {7, k - 5}
            break
          end
        end
      end
    end
  end
  return refusal
end
local stored = tonumber(b[10] or '')
if stored and stored >= 1 and stored <= 315360000 and stored == math.floor(stored) then ttl = stored end
if not (ttl >= 1 and ttl == math.floor(ttl)) then ttl = redis.call('TTL', KEYS[1]) end
local kcaps = {}
local function kind_cap(k)
  if k == '' then return lcap end
  if kcaps[k] == nil then kcaps[k] = tonumber(redis.call('HGET', KEYS[1], 'cap:' .. k) or '0') or 0 end
  return kcaps[k]
end
local f = {charged = tonumber(b[2] or '0'), grants = tonumber(b[3] or '0'), used = tonumber(b[4] or '0'),
           released = tonumber(b[5] or '0'), overrun = tonumber(b[6] or '0'), rejections = tonumber(b[7] or '0'),
           waits = tonumber(b[8] or '0'), reclaimed = tonumber(b[13] or '0')}
local changed, names = {}, {'charged', 'grants', 'used', 'released', 'overrun', 'rejections', 'waits', 'reclaimed'}
local state, writes, order = {}, {}, {}
local ids = {}
for i = 1, nops do ids[i] = ARGV[4 * i] end
for i = 1, nops, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, nops)))
  for j = 1, #part do
    if part[j] then state[ids[i + j - 1]] = part[j] end
  end
end
local function put(id, value)  -- value false: the reservation is forgotten (HDEL)
  if not writes[id] and writes[id] ~= false then order[#order + 1] = id end
  writes[id] = value
  state[id] = value
end
local function held(s)  -- the grant of an open reservation (begun or not), else nil
  if s and (string.sub(s, 1, 5) == 'open:' or string.sub(s, 1, 5) == 'call:') then
    return tonumber(string.sub(s, 6))
  end
  return nil
end
local live = nil
local function live_count()
  if live == nil then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
    live = redis.call('ZCARD', KEYS[3])
  end
  return live
end
local added, settled, first_grant, leased = false, false, false, false
local function give_back(id, grant)  -- a leased grant never begun: back to the budget, id forgotten
  f.charged = f.charged - grant
  f.reclaimed = f.reclaimed + grant
  changed.charged, changed.reclaimed = true, true
  put(id, false)
  redis.call('ZREM', KEYS[3], id)
  live = nil
  settled = true
end
local swept = false
local function reclaim()  -- the leases that ended unbegun (once per script, before the first reserve)
  if swept then return end
  swept = true
  local ended = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 1000)
  if #ended == 0 then return end
  redis.call('ZREM', KEYS[5], unpack(ended))
  local stored_states = redis.call('HMGET', KEYS[2], unpack(ended))
  for j, id in ipairs(ended) do
    local s = state[id]
    if s == nil then s = stored_states[j] or false end
    if s and string.sub(s, 1, 5) == 'open:' then give_back(id, tonumber(string.sub(s, 6))) end
  end
end
local out = {}
for i = 1, nops do
  local kind, id, n, dl = ARGV[4 * i - 1], ARGV[4 * i], tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2])
  local op = string.sub(kind, 1, 1)
  if op == 'r' or op == 'L' then
    if limit and not b[11] then reclaim() end
    local s = state[id]
    if not limit and not b[12] then
      out[i] = {0, 0, 0, 2, 0}
    elseif tree_refusal() then
      out[i] = {0, f.charged, limit or 0, refusal[1], refusal[2]}
    elseif not limit then
      out[i] = {0, 0, 0, 8, 0}
    elseif s then
      if held(s) then
        if op == 'r' and string.sub(s, 1, 5) == 'open:' and redis.call('ZREM', KEYS[5], id) > 0 then
          put(id, 'call:' .. held(s))  -- a leased grant taken over by a call that begins at once
        end
        out[i] = {held(s), f.charged, limit, 0, 0}
      else
        out[i] = {0, f.charged, limit, 3, 0}
      end
    else
      local cap = kind_cap(string.sub(kind, 3))
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
        local nxt = tonumber(first[2])
        local lease_end = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
        if lease_end[2] and tonumber(lease_end[2]) < nxt then nxt = tonumber(lease_end[2]) end
        f.waits = f.waits + 1
        changed.waits = true
        out[i] = {0, f.charged, limit, 4, math.floor(nxt * 1000), full}
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
        if op == 'L' and lease > 0 then
          redis.call('ZADD', KEYS[5], now + lease, id)
          leased = true
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
  elseif kind == 'b' then
    local s = state[id]
    local grant = held(s)
    if grant then
      if string.sub(s, 1, 5) == 'open:' then put(id, 'call:' .. grant) end
      redis.call('ZREM', KEYS[5], id)
      out[i] = {grant, f.charged, limit or 0, 0, 0}
    elseif s then
      out[i] = {0, f.charged, limit or 0, 1, 0}
    else
      out[i] = {0, f.charged, limit or 0, 2, 0}
    end
  elseif kind == 'u' then
    local s = state[id]
    if s and string.sub(s, 1, 5) == 'open:' and redis.call('ZREM', KEYS[5], id) > 0 then
      local grant = tonumber(string.sub(s, 6))
      give_back(id, grant)
      out[i] = {grant, f.charged, limit or 0, 0, 0}
    else
      out[i] = {0, f.charged, limit or 0, 0, 0}
    end
  else
    local lim = limit or 0
    local grant = held(state[id])
    if not state[id] then
      out[i] = {0, f.charged, lim, 2, 0}
    elseif not grant then
      out[i] = {0, f.charged, lim, 1, 0}
    else
      local release = grant - n
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
      redis.call('ZREM', KEYS[5], id)
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
local rargs, forget = {}, {}
for _, id in ipairs(order) do
  if writes[id] then
    rargs[#rargs + 1] = id
    rargs[#rargs + 1] = writes[id]
  else
    forget[#forget + 1] = id
  end
end
for i = 1, #rargs, 1000 do
  redis.call('HSET', KEYS[2], unpack(rargs, i, math.min(i + 999, #rargs)))
end
for i = 1, #forget, 1000 do
  redis.call('HDEL', KEYS[2], unpack(forget, i, math.min(i + 999, #forget)))
end
if first_grant and ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
if added and ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
if leased and ttl > 0 then redis.call('EXPIRE', KEYS[5], ttl) end
if (settled or leased) and f.waits > 0 then
  local msg = (limit or 0) - f.charged .. ' ' .. live_count()
  local lease_end = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  if lease_end[2] then msg = msg .. ' ' .. lease_end[2] end
  redis.call('PUBLISH', KEYS[4], msg)
end
return out
"""

# Count calls refused outside the script (the producer's up-front refusal, a waiter giving up):
# KEYS[1] budget hash, ARGV[1] how many. Only an existing ledger is counted (never re-created), and
# its TTL is left as its owner set it. Returns 1 when counted.
COUNT_REJECTIONS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'rejections', ARGV[1])
return 1
"""

# Close a ledger (its top rollout ended, timed out or was cancelled) or end some of its nodes:
# KEYS[1] the budget hash, KEYS[2] its release channel, KEYS[3..] node keys to delete; ARGV[1] '1' to
# close the ledger, '0' to only delete the nodes. Closing sets 'closed' on an existing ledger (never
# re-creates a lost one; its TTL is left as it is) so every later reservation is refused, whatever
# chain it names. Publishes 'closed' on the channel (not a '<free> <live>' pair: every parked call of
# the ledger wakes and asks again, so calls under what ended are refused now, not at their
# deadline). Returns 1 when a ledger was closed.
CLOSE_LEDGER_LUA = """
for k = 3, #KEYS do redis.call('DEL', KEYS[k]) end
local closed = 0
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'closed', 1)
  closed = 1
end
redis.call('PUBLISH', KEYS[2], 'closed')
return closed
"""

# Open a liveness-only ledger (a tree without a sub-LLM budget): KEYS[1] the budget hash, ARGV[1]
# its TTL (seconds). Keeps an existing ledger (budgeted or not) as it is, only pushing its TTL.
OPEN_UNLIMITED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'unlimited', 1, 'ttl', ARGV[1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
