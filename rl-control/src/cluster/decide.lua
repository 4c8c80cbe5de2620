-- One request decision of a cluster rule, atomic in Redis, on Redis' clock.
--
-- KEYS[1]: the bucket's hash (state words, and a sequence for members);
-- KEYS[2..]: sorted sets, one per limit (sliding log) or one (concurrency).
-- Every key carries the same hash tag: one slot.
-- ARGV: algorithm (gcra | fixed | sliding | log | sem), hits (negative: a
-- refund), n, deadline (Redis µs; 0: none), then per limit: amount, period
-- in µs, burst (sem: max, lease in µs, 0).
-- Returns {ok (1|0), index of the limit that speaks (0-based), remaining,
-- reset ms, retry-after ms}.
--
-- Times are µs since the Unix epoch (below 2^53: exact in Lua's numbers).
-- GCRA keeps its theoretical arrival time as whole µs plus a remainder in
-- 1/amount µs, so the arithmetic is exact in integers.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local algo, hits, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local deadline = tonumber(ARGV[4])
local K = KEYS[1]
-- A charge that reaches Redis after its caller gave up (a Redis paused or
-- hung past `timeout`, its commands run when it resumes) is not applied:
-- the caller already answered from on_failure, and a charge nobody saw
-- would deny the key later (a semaphore's permit, held until its lease).
-- Refunds are applied whenever they arrive: their hits were given back.
if hits > 0 and deadline > 0 and now > deadline then
  return redis.error_reply('LATE the decision reached Redis ' .. math.ceil((now - deadline) / 1000) ..
    ' ms after its caller gave up (timeout); not applied')
end
-- A check (0 hits) or a refund for a key without state reads a fresh
-- bucket and writes nothing, as the local path keeps no bucket for it:
-- checks of random values must not grow Redis.
local stateless = hits <= 0 and redis.call('EXISTS', K) == 0
local function ms(us)
  if us <= 0 then return 0 end
  return math.ceil(us / 1000)
end

-- Adds the members seq - hits + 1 .. seq at `score` to sorted set `z`,
-- 1,000 a call (one ZADD a hit held Redis for about a second at a million).
local function add(z, score, seq, hits)
  local args = {}
  for j = 1, hits do
    args[#args + 1] = score
    args[#args + 1] = seq - hits + j
    if #args >= 2000 or j == hits then
      redis.call('ZADD', z, unpack(args))
      args = {}
    end
  end
end

local function limit(i)
  local b = 5 + 3 * i
  return tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
end

-- Per limit, after the decision: `remaining`, `reset` (µs until full) and
-- `wait(k)` (µs until k more fit under it; k at most what it ever holds).
-- The request fits if every limit has room for it; then all are charged,
-- else none. A refund (hits < 0) gives the hits back to every limit: a
-- token bucket never past full, a window's count never below 0 (of the
-- window the refund arrives in), a log's oldest entries, the permits that
-- expire first (which hits come back is not known).
local ok = true
local states = {}
local life = 1

-- The first time in [from, to) at which `fits(t)` (monotone), or nil.
local function first(from, to, fits)
  if from >= to or not fits(to - 1) then return nil end
  if fits(from) then return from end
  local lo, hi = from, to - 1
  while lo + 1 < hi do
    local mid = math.floor((lo + hi) / 2)
    if fits(mid) then hi = mid else lo = mid end
  end
  return hi
end

-- A log's or semaphore's wait for k more under `cap`, its entries leaving
-- at their score + `after` µs: when the entry that makes room leaves.
local function entries_wait(z, count, cap, k, after)
  local leave = count + math.min(k, cap) - cap
  if leave <= 0 then return 0 end
  local e = redis.call('ZRANGE', z, leave - 1, leave - 1, 'WITHSCORES')
  return e[2] and math.max(tonumber(e[2]) + after - now, 0) or 0
end

if algo == 'gcra' then
  for i = 0, n - 1 do
    local amount, per, burst = limit(i)
    local v = redis.call('HMGET', K, 't' .. i, 'f' .. i)
    local tat, f = tonumber(v[1] or now), tonumber(v[2] or 0)
    -- How far ahead of now the bucket is, in 1/amount µs.
    local ahead = math.max((tat - now) * amount + f, 0)
    local span = burst * per
    local s = { ahead = ahead }
    if hits > 0 then ok = ok and ahead + hits * per <= span end
    s.settle = function(charged)
      if hits < 0 then s.ahead = math.max(ahead + hits * per, 0)
      elseif charged then s.ahead = ahead + hits * per end
      s.remaining = math.max(math.floor((span - s.ahead) / per), 0)
      s.reset = s.ahead / amount
      s.wait = function(k) return math.max(s.ahead + math.min(k, burst) * per - span, 0) / amount end
      local whole = math.floor(s.ahead / amount)
      if not stateless then
        redis.call('HSET', K, 't' .. i, now + whole, 'f' .. i, s.ahead - whole * amount)
      end
      life = math.max(life, ms(s.reset) + 1)
    end
    states[i] = s
  end
elseif algo == 'fixed' or algo == 'sliding' then
  for i = 0, n - 1 do
    local amount, per = limit(i)
    local w = math.floor(now / per)
    local v = redis.call('HMGET', K, 'w' .. i, 'c' .. i, 'p' .. i)
    local sw, c, p = tonumber(v[1] or -1), tonumber(v[2] or 0), tonumber(v[3] or 0)
    local prev, cur = 0, 0
    if sw == w then prev, cur = p, c elseif sw == w - 1 then prev, cur = c, 0 end
    -- A window already opened on a clock ahead of this one (Redis failed
    -- over to a replica whose clock is behind): charged as it stands, as
    -- rl-common does, never opened a second time.
    if sw > w then w, prev, cur = sw, p, c end
    -- rl-common's weighting: the previous count times the share of the
    -- window still ahead at t, in 1/65536, rounded up. A time before the
    -- window (the clock behind it) reads as its start: the previous
    -- count weighs in full, as in rl-common.
    local function weighted(count, t)
      if algo == 'fixed' or count == 0 then return 0 end
      t = math.max(t, w * per)
      local left = math.floor((per - (t - math.floor(t / per) * per)) * 65536 / per)
      return math.floor((count * left + 65535) / 65536)
    end
    local s = {}
    if hits > 0 then ok = ok and weighted(prev, now) + cur + hits <= amount end
    s.settle = function(charged)
      if hits < 0 then cur = math.max(cur + hits, 0) elseif charged then cur = cur + hits end
      s.remaining = math.max(amount - weighted(prev, now) - cur, 0)
      s.reset = (w + 1) * per - now
      if algo == 'sliding' then s.reset = s.reset + per end
      -- Room at t: this window's, the next one's (this count then weighs
      -- as the previous), or the whole limit after that.
      local function room(t)
        t = math.max(t, w * per)
        local wt = math.floor(t / per)
        if wt == w then return amount - weighted(prev, t) - cur end
        if wt == w + 1 then return amount - weighted(cur, t) end
        return amount
      end
      s.wait = function(k)
        k = math.min(k, amount)
        local fits = function(t) return room(t) >= k end
        local t = first(now, (w + 1) * per, fits) or first((w + 1) * per, (w + 2) * per, fits) or (w + 2) * per
        return t - now
      end
      if not stateless then
        redis.call('HSET', K, 'w' .. i, w, 'c' .. i, cur, 'p' .. i, prev)
      end
      life = math.max(life, ms(s.reset) + 1)
    end
    states[i] = s
  end
elseif algo == 'log' then
  for i = 0, n - 1 do
    local amount, per = limit(i)
    local z = KEYS[2 + i]
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - per)
    if hits < 0 then redis.call('ZPOPMIN', z, -hits) end
    local s = { count = redis.call('ZCARD', z), z = z, per = per, amount = amount }
    if hits > 0 then ok = ok and s.count + hits <= amount end
    states[i] = s
  end
  local seq = 0
  if ok and hits > 0 then seq = redis.call('HINCRBY', K, 'seq', hits) end
  for i = 0, n - 1 do
    local s = states[i]
    s.settle = function(charged)
      if charged and hits > 0 then
        add(s.z, now, seq, hits)
        s.count = s.count + hits
      end
      local newest = redis.call('ZRANGE', s.z, -1, -1, 'WITHSCORES')
      s.remaining = math.max(s.amount - s.count, 0)
      s.reset = newest[2] and (tonumber(newest[2]) + s.per - now) or 0
      s.wait = function(k) return entries_wait(s.z, s.count, s.amount, k, s.per) end
      redis.call('PEXPIRE', s.z, ms(s.per) + 1)
      life = math.max(life, ms(s.per) + 1)
    end
  end
elseif algo == 'sem' then
  local max, lease = limit(0)
  local z = KEYS[2]
  redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  if hits < 0 then redis.call('ZPOPMIN', z, -hits) end
  local count = redis.call('ZCARD', z)
  if hits > 0 then ok = count + hits <= max end
  local s = {}
  s.settle = function(charged)
    if charged and hits > 0 then
      local seq = redis.call('HINCRBY', K, 'seq', hits)
      add(z, now + lease, seq, hits)
      count = count + hits
    end
    local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
    s.remaining = math.max(max - count, 0)
    s.reset = last[2] and (tonumber(last[2]) - now) or 0
    s.wait = function(k) return entries_wait(z, count, max, k, 0) end
    redis.call('PEXPIRE', z, ms(lease) + 1)
    life = ms(lease) + 1
  end
  states[0] = s
  n = 1
else
  return redis.error_reply('unknown algorithm ' .. algo)
end

for i = 0, n - 1 do states[i].settle(ok) end
redis.call('PEXPIRE', K, life)

-- The tightest limit speaks; the retry time is when the request (denied)
-- or one more (none left) fits under every limit.
local best = 0
for i = 1, n - 1 do
  if states[i].remaining < states[best].remaining then best = i end
end
local s = states[best]
local retry = 0
if not ok or s.remaining == 0 then
  local k = ok and 1 or math.max(hits, 1)
  for i = 0, n - 1 do retry = math.max(retry, ms(states[i].wait(k))) end
end
return { ok and 1 or 0, best, s.remaining, ms(s.reset), retry }
