"""The Lua scripts of the budget ledger (:mod:`rlmq.common.budget.ledger`), with their contracts.

Kept apart from the Python side so each stays readable; :data:`LEDGER_LUA` is re-exported by
:mod:`rlmq.common.budget.ledger`, whose docstring states the policy the script implements. The
ledger's field names, result codes, operations, keys and reply are spliced in from
:mod:`rlmq.common.budget.wire` (``$GRANTED`` -> ``0``, ``$HASH_FIELDS`` -> ``'limit', 'charged', ...``),
so each is spelled once and the script reads no field, and answers no code, by a bare number.
"""

from __future__ import annotations

from string import Template

from rlmq.common.budget.wire import CLOSE_WIRE, COUNT_REJECTIONS_WIRE, OPEN_UNLIMITED_WIRE, ScriptWire, lua_names


def _lua(text: str) -> str:
    """A script with the ledger's wire names spliced in (:func:`rlmq.common.budget.wire.lua_names`)."""
    return Template(text).substitute(lua_names())


def _small(wire: ScriptWire, body: str) -> str:
    """A small script on its named wire: its keys and arguments read into their Lua locals first."""
    head = "local $KEY_LOCALS = unpack(KEYS, 1, $KEY_COUNT)\nlocal $ARG_LOCALS = unpack(ARGV, 1, $ARG_COUNT)\n"
    return Template(head + body).substitute(wire.lua_names())


# KEYS: the script's own keys (wire.SCRIPT_KEYS): the budget hash, the reservations hash,
# the live-open sorted set, the release channel and the grant-lease sorted set (one ledger: all
# share its id's hash tag), then the node keys of the calling rollout's tree chain (top .. caller;
# none for a call of a top rollout): a reservation is refused with TREE_CLOSED when the ledger is
# 'closed' (its top rollout ended) and with NODE_GONE when one of those node keys is gone (the
# caller, or an ancestor, ended or died; 'detail' = the missing node's position in the chain, from
# 1). Settles, retires, begins and give-backs are never refused: tokens spent are always recorded.
# ARGV (wire.HEAD_ARGS): ARGV_TTL the TTL (seconds) of a ledger that stores none (opened by
# an older producer; 0: the budget hash's own remaining TTL): a ledger opened now stores its
# owner's TTL in its 'ttl' field and the script uses that, never the caller's (a stored 'ttl' that
# is not a whole number of seconds from 1 to ten years is ignored: an EXPIRE that fails mid-script
# would leave a grant charged with nobody to settle it); ARGV_LEASE the grant lease (seconds) of a
# leased reserve. "Now" is Redis's TIME.
# Then per operation i the four arguments of wire.OP_ARGS: op (wire.Op: 'r' reserve,
# 'r:<kind>' reserve of reservation kind <kind>, 'L' / 'L:<kind>' the same, leased, 's' settle,
# 'x' retire, 'b' begin, 'u' give back), reservation id, n, deadline (both unused by a retire, a
# begin, a give-back). For a reserve n is the caller's cap in tokens (<= 0: none; it can only lower
# the ledger's own cap of the kind: 'cap' for 'r', 'cap:<kind>' for 'r:<kind>', none when unset)
# and deadline the call's deadline (Unix seconds); for a settle n is the completion tokens the
# server reported (>= 0) and deadline is unused.
# The operations are applied in order, each exactly as if it ran alone; the script reads the
# ledger once (HMGET) and writes it once (HSET), and so the running answers (the answers hash: read
# with the first segment that needs them, written once at the end). Returns one reply (wire.REPLY_FIELDS) per
# operation, read by wire.Reply.of:
# * reserve: value = grant. GRANTED (grant > 0); REJECTED (grant 0: nothing free and no live
#   reservation that could give tokens back); NO_LEDGER (budget hash missing: expired, lost, or
#   an unbudgeted rollout); ALREADY_SETTLED (a retried job asked again for a closed reservation);
#   UNLIMITED (a liveness-only ledger, field 'unlimited', no 'limit': a tree without a budget;
#   the chain is alive, call without a grant and settle nothing);
#   WAIT (less than a full grant is free but live reservations may give some back: ask again
#   after a release, or at 'detail', in ms, the earliest of the live reservations' deadlines (when
#   one stops counting as live) and the grant leases' ends (when one may be reclaimed), and need,
#   the grant it waits for). An open reservation with the same id returns its grant again (begun
#   or not); an unleased reserve ('r') of a leased grant not begun yet begins it (its caller calls
#   the model at once, without a begin of its own).
#   The grant is a whole cap: min(cap, limit) (a full grant), given when free >= that, free = limit -
#   charged, cap = min(ledger cap, caller's cap) (no cap: whatever is free, when free > 0); or, when
#   no live reservation is left, whatever is free (the last remainder, which may cut its answer). A
#   grant's reply carries the full grant in 'need': a grant below it is a cut remainder.
# * leased reserve ('L'): a new grant is also *leased*: it must be begun ('b') within ARGV_LEASE
#   seconds, i.e. before its call reaches the model. A reserve finds the leases that ended unbegun
#   (the lease set, scored by their end) and reclaims them first: their grants go back to the
#   budget (counted in 'reclaimed') and their ids are forgotten (reserving one again is a new
#   grant), as if never reserved: no model call ever ran under them, so the budget stays exact.
# * begin ('b'): the call is about to reach the model: the reservation becomes 'call:<grant>' and
#   its lease ends (it can no longer be reclaimed, only settled). value = grant, BEGIN_BEGUN;
#   BEGIN_UNKNOWN when the reservation is unknown (its lease was reclaimed: reserve again),
#   BEGIN_SETTLED when it is settled.
# * give back ('u'): a leased grant not begun goes back now (the call holding it will not run, or
#   runs under a new grant), as a reclaim does. value = tokens given back (0: nothing to give back:
#   begun, settled, unknown, or never leased); code SETTLE_SETTLED, as a retire's.
# * retire ('x'): the reservation stops being live (its job was handed to a new attempt: its
#   worker is presumed dead); it stays open and charged, and can still be settled. value = 1 when
#   it was live. Waiters are told, as after a settle.
# * settle: value = released = grant - used (>= 0 with a server that honours max_tokens; a server
#   that returned more than its grant is charged the excess, recorded in 'overrun').
#   SETTLE_SETTLED now, SETTLE_ALREADY (nothing changes), SETTLE_UNKNOWN reservation.
# A live reservation is an open one whose call's deadline has not passed (the live set, scored by
# deadline): one held by a dead worker stops being live at its deadline but stays charged.
# After any settle, retire, give-back or reclaim, and after a leased grant, once the rollout has had
# a waiter, the script publishes wire.RELEASE_FIELDS on the channel: '<free> <live>' (free =
# limit - charged, live = live reservations left), followed by ' <lease end>' (Unix seconds) when a
# grant lease is open: waiters wake by it, and ask again when that lease ends.
# The reservations hash gets the ledger's stored TTL with the ledger's first grant, the live set
# and the lease set with every script that adds to them (the owner's key refresh keeps them alive
# with the ledger).
LEDGER_LUA = _lua("""
local $KEY_LOCALS = unpack(KEYS, 1, $KEY_COUNT)
local chain_from = $KEY_COUNT + 1  -- KEYS[chain_from ..]: the caller's tree chain
local ttl = tonumber(ARGV[$ARGV_TTL])
local lease = tonumber(ARGV[$ARGV_LEASE]) or 0
local clock = redis.call('TIME')  -- "now" is Redis's clock, never the calling host's
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local nops = (#ARGV - $HEAD_ARGS) / $OP_ARGS
local $HASH_LOCALS = unpack(redis.call('HMGET', budget, $HASH_FIELDS))
local limit, lcap = tonumber(h_limit), tonumber(h_cap or '0')
local function reply($REPLY_FIELDS)
  return {$REPLY_FIELDS}
end
local refusal_code, refusal_at = nil, 0  -- why this ledger refuses every reservation now (computed once)
local function tree_refusal()
  if refusal_code == nil then
    refusal_code = false
    if h_closed then
      refusal_code = $TREE_CLOSED
    elseif #KEYS >= chain_from then
      local nodes = {}
      for k = chain_from, #KEYS do nodes[#nodes + 1] = KEYS[k] end
      if redis.call('EXISTS', unpack(nodes)) < #nodes then
        for k = chain_from, #KEYS do
          if redis.call('EXISTS', KEYS[k]) == 0 then
            refusal_code, refusal_at = $NODE_GONE, k - chain_from + 1
            break
          end
        end
      end
    end
  end
  return refusal_code
end
local stored = tonumber(h_ttl or '')
if stored and stored >= 1 and stored <= 315360000 and stored == math.floor(stored) then ttl = stored end
if not (ttl >= 1 and ttl == math.floor(ttl)) then ttl = redis.call('TTL', budget) end
local kcaps = {}
local function kind_cap(k)
  if k == '' then return lcap end
  if kcaps[k] == nil then kcaps[k] = tonumber(redis.call('HGET', budget, 'cap:' .. k) or '0') or 0 end
  return kcaps[k]
end
local f = {$COUNTER_TABLE}
local changed, names = {}, {$COUNTERS}
local state, writes, order = {}, {}, {}
local ids = {}
for i = 1, nops do ids[i] = ARGV[$HEAD_ARGS + $OP_ARGS * (i - 1) + 2] end
for i = 1, nops, 500 do
  local part = redis.call('HMGET', reservations, unpack(ids, i, math.min(i + 499, nops)))
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
    redis.call('ZREMRANGEBYSCORE', live_set, '-inf', now)
    live = redis.call('ZCARD', live_set)
  end
  return live
end
local added, settled, first_grant, leased = false, false, false, false
local function answer_of(id)  -- an answer's id: its first segment's reservation id
  return (string.gsub(id, ':s%d+$$', ''))
end
local running = nil  -- answer id -> {spent, reach, whole, kind}: the running answers, read once
local answer_writes, answer_order = {}, {}  -- answer id -> its new entry, or false (ended): written once, at the end
local ended_longest = {}  -- per kind: the longest answer that ended (tokens; the hash's, read once)
ended_longest[''] = tonumber(h_longest or '0') or 0
local longest_changed = {}  -- kinds whose longest answer that ended changed (written with the counters)
local answered = {}  -- per kind: the answers that ended on their own (the hash's, read once)
answered[''] = tonumber(h_answered or '0') or 0
local answered_changed = {}  -- kinds whose count of ended answers changed (written with the counters)
local longest = {}  -- per kind: the longest answer, ended or running (derived: reset by every change)
local pledge = nil  -- what the running answers are estimated to need past what they hold (derived, as longest)
local on_estimate = {}  -- per kind: running answers that started below their cap (derived, as longest)
local function parse_answer(value)  -- a running answer's entry, or nil when its call's deadline passed
  local dl, sp, rc, wh, k = string.match(value, '^(%S+) (%d+) (%d+) (%d+) ?([a-z_]*)$$')
  if dl and tonumber(dl) > now then return {tonumber(sp), tonumber(rc), tonumber(wh), k} end
  return nil
end
local function answer_put(aid, value, keep)  -- value false: the answer ended (or will not go on)
  if answer_writes[aid] == nil then answer_order[#answer_order + 1] = aid end
  answer_writes[aid] = value
  if running ~= nil then running[aid] = value and parse_answer(value) or nil end
  if not keep then longest, pledge, on_estimate = {}, nil, {} end  -- keep: the caller updates pledge itself
end
local function give_back(id, grant)  -- a leased grant never begun: back to the budget, id forgotten
  f.charged = f.charged - grant
  f.reclaimed = f.reclaimed + grant
  changed.charged, changed.reclaimed = true, true
  put(id, false)
  redis.call('ZREM', live_set, id)
  answer_put(answer_of(id), false)  -- its answer does not go on under it
  live = nil
  settled = true
end
local swept = false
local function reclaim()  -- the leases that ended unbegun (once per script, before the first reserve)
  if swept then return end
  swept = true
  local ended = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 1000)
  if #ended == 0 then return end
  redis.call('ZREM', leases, unpack(ended))
  local stored_states = redis.call('HMGET', reservations, unpack(ended))
  for j, id in ipairs(ended) do
    local s = state[id]
    if s == nil then s = stored_states[j] or false end
    if s and string.sub(s, 1, 5) == 'open:' then give_back(id, tonumber(string.sub(s, 6))) end
  end
end
local function first_score(key)  -- the lowest score of a sorted set, or nil when it is empty
  local _, score = unpack(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES'))
  if score == nil then return nil end
  return tonumber(score)
end
local function running_answers()
  if running == nil then
    local flat, stale = redis.call('HGETALL', answers), {}
    running = {}
    for j = 1, #flat, 2 do
      if answer_writes[flat[j]] == nil then  -- (one this script wrote is taken below)
        running[flat[j]] = parse_answer(flat[j + 1])
        if running[flat[j]] == nil then stale[#stale + 1] = flat[j] end
      end
    end
    for _, aid in ipairs(stale) do answer_put(aid, false) end
    for aid, value in pairs(answer_writes) do
      if value then running[aid] = parse_answer(value) end
    end
  end
  return running
end
local function per_kind(cache, field, k)  -- the budget hash's <field>:<k> (a number; read once)
  if cache[k] == nil then cache[k] = tonumber(redis.call('HGET', budget, field .. ':' .. k) or '0') or 0 end
  return cache[k]
end
local function longest_ended(k)  -- the longest answer of kind k that ended (tokens)
  return per_kind(ended_longest, 'longest', k)
end
local function answered_count(k)  -- the answers of kind k that ended on their own
  return per_kind(answered, 'answered', k)
end
local function learned(k, whole)  -- an estimate of an answer of kind k from the longest so far (tokens)
  if longest[k] == nil then
    longest[k] = longest_ended(k)
    for _, a in pairs(running_answers()) do  -- an answer still running grows the estimate as it goes
      if a[4] == k and a[1] > longest[k] then longest[k] = a[1] end
    end
  end
  if longest[k] <= 0 then return whole end  -- no answer has ended yet: a whole cap, as without segments
  return math.min(whole, math.max($SEGMENT_MIN, math.ceil(longest[k] * 1.25)))
end
local function started_on_estimate(k)  -- running answers of kind k that started below their cap
  if on_estimate[k] == nil then
    local n = 0
    for _, a in pairs(running_answers()) do  -- (one that goes on outran a first segment below its cap)
      if a[4] == k and (a[1] > 0 or a[2] < a[3]) then n = n + 1 end
    end
    on_estimate[k] = n
  end
  return on_estimate[k]
end
local function estimate(k, whole)  -- the segment an answer of kind k starts with (tokens)
  -- the first answers to end are the shortest: until enough of them tell the longest, no more
  -- answers run on an estimate than answers have ended; the others start with (and pledge) a whole cap
  local n = answered_count(k)
  if n < $ESTIMATE_SAMPLES and started_on_estimate(k) >= n then return whole end
  return learned(k, whole)
end
local function pledged()  -- what the running answers are estimated to need past what they hold
  if pledge == nil then
    local sum = 0
    for _, a in pairs(running_answers()) do
      local goal = estimate(a[4], a[3])  -- an answer within its first segment: an estimate of an answer
      if a[1] > 0 then goal = a[3] end  -- one that outran its first segment: up to its whole cap
      if goal > a[2] then sum = sum + goal - a[2] end
    end
    pledge = sum
  end
  return pledge
end
local out = {}
for i = 1, nops do
  local o = $HEAD_ARGS + $OP_ARGS * (i - 1)
  local kind, id, n, dl = ARGV[o + 1], ARGV[o + 2], tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4])
  local op = string.sub(kind, 1, 1)
  local seg = op == '$OP_SEGMENT' or op == '$OP_SEGMENT_LEASED'
  if op == '$OP_RESERVE' or op == '$OP_LEASED' or seg then
    if limit and not h_closed then reclaim() end
    local s = state[id]
    if not limit and not h_unlimited then
      out[i] = reply(0, 0, 0, $NO_LEDGER, 0, 0)
    elseif tree_refusal() then
      out[i] = reply(0, f.charged, limit or 0, refusal_code, refusal_at, 0)
    elseif not limit then
      out[i] = reply(0, 0, 0, $UNLIMITED, 0, 0)
    elseif s then
      if held(s) then
        local unleased = op == '$OP_RESERVE' or op == '$OP_SEGMENT'
        if unleased and string.sub(s, 1, 5) == 'open:' and redis.call('ZREM', leases, id) > 0 then
          put(id, 'call:' .. held(s))  -- a leased grant taken over by a call that begins at once
        end
        out[i] = reply(held(s), f.charged, limit, $GRANTED, 0, 0)
      else
        out[i] = reply(0, f.charged, limit, $ALREADY_SETTLED, 0, 0)
      end
    else
      local kname, spent = string.sub(kind, 3), 0
      if seg then
        local k, sp = string.match(kind, '^.:([a-z_]*):(%d+)')
        kname, spent = k or '', tonumber(sp or '0')
      end
      local cap = kind_cap(kname)
      if n > 0 and (cap <= 0 or n < cap) then cap = n end
      local free = limit - f.charged
      local full = 1
      if cap > 0 then full = math.min(cap, limit) end
      local grant, need, wait_need, whole = 0, full, full, limit
      if seg then
        if cap > 0 then whole = math.min(cap, limit) end
        local left = whole - spent
        local p = estimate(kname, whole)
        if spent == 0 then
          need = math.min(left, p)  -- a new answer: reserves what an answer is estimated to take, and
          -- starts only while what stays free covers what the running answers are estimated to need
          -- (and at least another estimate, but for a whole cap)
          if free >= need + math.max(pledged(), math.min(need, whole - need)) then grant = need end
        else  -- a running answer goes on first, with at least 1.25 x what it has spent
          need = math.min(left, math.max($SEGMENT_MIN, p, math.ceil(spent * 1.25)))
          if free >= math.min(need, $SEGMENT_MIN) then grant = math.min(need, free) end
        end
        wait_need = need
        if spent > 0 then wait_need = math.min(need, $SEGMENT_MIN) end
        if left <= 0 then
          need = 0
        elseif grant == 0 and live_count() == 0 and free > 0 then
          grant = math.min(need, free)  -- the budget's last remainder
        end
        full = need
      elseif free >= full then
        grant = free
        if cap > 0 and cap < grant then grant = cap end
      end
      if grant > 0 or need <= 0 then
        -- granted above (or an answer at its cap: refused below)
      elseif live_count() > 0 then
        local nxt = first_score(live_set)
        local lease_end = first_score(leases)
        if lease_end and lease_end < nxt then nxt = lease_end end
        f.waits = f.waits + 1
        changed.waits = true
        out[i] = reply(0, f.charged, limit, $WAIT, math.floor(nxt * 1000), wait_need)
      elseif free > 0 and not seg then
        grant = free
        -- a child root turn's last remainder is usable down to an estimate of a root turn (1.25 x
        -- the longest that ended; a whole cap before any ended), not only down to its whole cap
        if kname == 'root' then full = math.min(full, learned(kname, full)) end
      end
      if grant > 0 then
        if f.grants == 0 then first_grant = true end
        f.charged = f.charged + grant
        f.grants = f.grants + 1
        changed.charged, changed.grants = true, true
        put(id, 'open:' .. grant)
        if seg then
          f.segments = f.segments + 1
          changed.segments = true
          if need > 0 and dl > now then
            local aid = answer_of(id)
            -- a new answer within its first segment changes no estimate: its own pledge is added
            local fresh = spent == 0 and pledge ~= nil and longest[kname] ~= nil and running[aid] == nil
            fresh = fresh and answered_count(kname) >= $ESTIMATE_SAMPLES  -- (below it, the estimate may change)
            answer_put(aid, dl .. ' ' .. spent .. ' ' .. (spent + grant) .. ' ' .. whole .. ' ' .. kname, fresh)
            if fresh and estimate(kname, whole) > grant then pledge = pledge + estimate(kname, whole) - grant end
          end
        end
        if dl > now then
          redis.call('ZADD', live_set, dl, id)
          if live ~= nil then live = live + 1 end
          added = true
        end
        if (op == '$OP_LEASED' or op == '$OP_SEGMENT_LEASED') and lease > 0 then
          redis.call('ZADD', leases, now + lease, id)
          leased = true
        end
        out[i] = reply(grant, f.charged, limit, $GRANTED, 0, full)
      elseif not out[i] then
        if spent == 0 and need > 0 then  -- a refused continuation cuts an answer; it refuses no call
          f.rejections = f.rejections + 1
          changed.rejections = true
        end
        out[i] = reply(0, f.charged, limit, $REJECTED, 0, 0)
      end
    end
  elseif op == '$OP_ANSWERED' then
    local k, total = string.match(kind, '^.:([a-z_]*):(%d+)')
    total, k = tonumber(total or '0'), k or ''
    if limit and total > longest_ended(k) then
      ended_longest[k] = total
      longest_changed[k] = true
      longest[k], pledge = nil, nil
    end
    if limit and total > 0 then
      answered[k] = answered_count(k) + 1
      answered_changed[k] = true
      if answered[k] <= $ESTIMATE_SAMPLES then pledge = nil end  -- more answers may run on the estimate
    end
    if id ~= '' then answer_put(id, false) end  -- the answer ended: it pledges no more
    out[i] = reply(0, f.charged, limit or 0, $SETTLE_SETTLED, 0, 0)
  elseif kind == '$OP_RETIRE' then
    local removed = redis.call('ZREM', live_set, id)
    answer_put(answer_of(id), false)  -- a dead worker's answer will not go on
    if removed > 0 then
      live = nil
      settled = true
    end
    out[i] = reply(removed, f.charged, limit or 0, $SETTLE_SETTLED, 0, 0)
  elseif kind == '$OP_BEGIN' then
    local s = state[id]
    local grant = held(s)
    if grant then
      if string.sub(s, 1, 5) == 'open:' then put(id, 'call:' .. grant) end
      redis.call('ZREM', leases, id)
      out[i] = reply(grant, f.charged, limit or 0, $BEGIN_BEGUN, 0, 0)
    elseif s then
      out[i] = reply(0, f.charged, limit or 0, $BEGIN_SETTLED, 0, 0)
    else
      out[i] = reply(0, f.charged, limit or 0, $BEGIN_UNKNOWN, 0, 0)
    end
  elseif kind == '$OP_GIVE_BACK' then
    local s = state[id]
    if s and string.sub(s, 1, 5) == 'open:' and redis.call('ZREM', leases, id) > 0 then
      local grant = tonumber(string.sub(s, 6))
      give_back(id, grant)
      out[i] = reply(grant, f.charged, limit or 0, $SETTLE_SETTLED, 0, 0)
    else
      out[i] = reply(0, f.charged, limit or 0, $SETTLE_SETTLED, 0, 0)
    end
  else
    local lim = limit or 0
    local grant = held(state[id])
    if not state[id] then
      out[i] = reply(0, f.charged, lim, $SETTLE_UNKNOWN, 0, 0)
    elseif not grant then
      out[i] = reply(0, f.charged, lim, $SETTLE_ALREADY, 0, 0)
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
      redis.call('ZREM', live_set, id)
      redis.call('ZREM', leases, id)
      settled = true
      out[i] = reply(release, f.charged, lim, $SETTLE_SETTLED, 0, 0)
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
for field, kinds in pairs({longest = {longest_changed, ended_longest}, answered = {answered_changed, answered}}) do
  for k in pairs(kinds[1]) do  -- the per-kind fields that changed: <field> (the sub-LLM's), <field>:<kind>
    hset[#hset + 1] = k == '' and field or field .. ':' .. k
    hset[#hset + 1] = kinds[2][k]
  end
end
if #hset > 0 and limit then redis.call('HSET', budget, unpack(hset)) end  -- never re-create a lost ledger
local function write_hash(key, ids, values)  -- each id's value, or HDEL where false; 1,000 args a call
  local set, del = {}, {}
  for _, id in ipairs(ids) do
    if values[id] then
      set[#set + 1] = id
      set[#set + 1] = values[id]
    else
      del[#del + 1] = id
    end
  end
  for i = 1, #del, 1000 do redis.call('HDEL', key, unpack(del, i, math.min(i + 999, #del))) end
  for i = 1, #set, 1000 do redis.call('HSET', key, unpack(set, i, math.min(i + 999, #set))) end
  return #set
end
if write_hash(answers, answer_order, answer_writes) > 0 and ttl > 0 then redis.call('EXPIRE', answers, ttl) end
write_hash(reservations, order, writes)
if first_grant and ttl > 0 then redis.call('EXPIRE', reservations, ttl) end
if added and ttl > 0 then redis.call('EXPIRE', live_set, ttl) end
if leased and ttl > 0 then redis.call('EXPIRE', leases, ttl) end
if (settled or leased) and f.waits > 0 then
  local msg = (limit or 0) - f.charged .. ' ' .. live_count()
  local _, lease_end = unpack(redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES'))
  if lease_end then msg = msg .. ' ' .. lease_end end
  redis.call('PUBLISH', channel, msg)
end
return out
""")

# Count calls refused outside the script (the producer's up-front refusal, a waiter giving up):
# wire.COUNT_REJECTIONS_WIRE (the budget hash; n, how many). Only an existing ledger is counted (never
# re-created), and its TTL is left as its owner set it. Returns 1 when counted.
COUNT_REJECTIONS_LUA = _small(
    COUNT_REJECTIONS_WIRE,
    """
if redis.call('EXISTS', budget) == 0 then return 0 end
redis.call('HINCRBY', budget, 'rejections', n)
return 1
""",
)

# Close a ledger (its top rollout ended, timed out or was cancelled) or end some of its nodes:
# wire.CLOSE_WIRE (the budget hash, its release channel, then the node keys to delete; close '1' to
# close the ledger, '0' to only delete the nodes). Closing sets 'closed' on an existing ledger (never
# re-creates a lost one; its TTL is left as it is) so every later reservation is refused, whatever
# chain it names. Publishes 'closed' on the channel (not a '<free> <live>' pair: every parked call of
# the ledger wakes and asks again, so calls under what ended are refused now, not at their
# deadline). Returns 1 when a ledger was closed.
CLOSE_LEDGER_LUA = _small(
    CLOSE_WIRE,
    """
local nodes = {unpack(KEYS, $KEY_COUNT + 1)}
if #nodes > 0 then redis.call('DEL', unpack(nodes)) end
local closed = 0
if close == '1' and redis.call('EXISTS', budget) == 1 then
  redis.call('HSET', budget, 'closed', 1)
  closed = 1
end
redis.call('PUBLISH', channel, 'closed')
return closed
""",
)

# Open a liveness-only ledger (a tree without a sub-LLM budget): wire.OPEN_UNLIMITED_WIRE (the budget
# hash; ttl, seconds). Keeps an existing ledger (budgeted or not) as it is, only pushing its TTL.
OPEN_UNLIMITED_LUA = _small(
    OPEN_UNLIMITED_WIRE,
    """
if redis.call('EXISTS', budget) == 0 then
  redis.call('HSET', budget, 'unlimited', 1, 'ttl', ttl)
end
redis.call('EXPIRE', budget, ttl)
return 1
""",
)
