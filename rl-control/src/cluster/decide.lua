-- One request decision of a cluster rule, atomic in Redis, on Redis' clock.
--
-- KEYS[1]: the bucket's hash (state words, and a sequence for members);
-- KEYS[2..]: sorted sets, one per limit (sliding log) or one (concurrency).
-- Every key carries the same hash tag: one slot.
-- ARGV: algorithm (gcra | fixed | sliding | log | sem), hits (negative: a
-- refund, sem only), n, then per limit: amount, period in µs, burst
-- (sem: max, lease in µs, 0).
-- Returns {ok (1|0), index of the limit that speaks (0-based), remaining,
-- reset ms, retry-after ms}.
--
-- Times are µs since the Unix epoch (below 2^53: exact in Lua's numbers).
-- GCRA keeps its theoretical arrival time as whole µs plus a remainder in
-- 1/amount µs, so the arithmetic is exact in integers.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local algo, hits, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local K = KEYS[1]
-- Only the semaphore takes refunds here: elsewhere a negative charge is
-- read as 0 (this host's own buckets take refunds; Redis's do not yet).
if algo ~= 'sem' and hits < 0 then hits = 0 end

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
  local b = 4 + 3 * i
  return tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
end

-- Per limit: the state it reads, whether `hits` fit, the state to write.
local ok = true
local states = {}
local life = 1
if algo == 'gcra' or algo == 'fixed' or algo == 'sliding' then
  for i = 0, n - 1 do
    local amount, per, burst = limit(i)
    local s = {}
    if algo == 'gcra' then
      local v = redis.call('HMGET', K, 't' .. i, 'f' .. i)
      local tat, f = tonumber(v[1] or now), tonumber(v[2] or 0)
      -- How far ahead of now the bucket is, in 1/amount µs.
      local ahead = (tat - now) * amount + f
      if ahead < 0 then ahead = 0 end
      local span, inc = burst * per, hits * per
      s.fits = ahead + inc <= span
      s.after = s.fits and ahead + inc or ahead
      s.remaining = math.floor((span - s.after) / per)
      s.reset = s.after / amount
      s.retry = (s.after + inc - span) / amount
      s.write = function()
        local whole = math.floor(s.after / amount)
        redis.call('HSET', K, 't' .. i, now + whole, 'f' .. i, s.after - whole * amount)
      end
      life = math.max(life, ms(s.reset) + 1)
    else
      local w = math.floor(now / per)
      local v = redis.call('HMGET', K, 'w' .. i, 'c' .. i, 'p' .. i)
      local sw, c, p = tonumber(v[1] or -1), tonumber(v[2] or 0), tonumber(v[3] or 0)
      local prev, cur = 0, 0
      if sw == w then prev, cur = p, c elseif sw == w - 1 then prev, cur = c, 0 end
      local weighted = 0
      if algo == 'sliding' then
        -- rl-common's weighting: the share of the window still ahead, in 1/65536.
        local left = math.floor((per - (now - w * per)) * 65536 / per)
        weighted = math.floor((prev * left + 65535) / 65536)
      end
      s.fits = weighted + cur + hits <= amount
      local used = weighted + cur + (s.fits and hits or 0)
      s.remaining = math.max(amount - used, 0)
      s.reset = (w + 1) * per - now
      if algo == 'sliding' then s.reset = s.reset + per end
      s.retry = (w + 1) * per - now
      s.write = function()
        redis.call('HSET', K, 'w' .. i, w, 'c' .. i, cur + hits, 'p' .. i, prev)
      end
      life = math.max(life, ms(s.reset) + 1)
    end
    ok = ok and s.fits
    states[i] = s
  end
  if ok then
    for i = 0, n - 1 do states[i].write() end
  end
  redis.call('PEXPIRE', K, life)
elseif algo == 'log' then
  for i = 0, n - 1 do
    local amount, per = limit(i)
    local z = KEYS[2 + i]
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - per)
    local s = { count = redis.call('ZCARD', z), z = z, per = per, amount = amount }
    s.fits = s.count + hits <= amount
    ok = ok and s.fits
    states[i] = s
  end
  local seq = 0
  if ok and hits > 0 then seq = redis.call('HINCRBY', K, 'seq', hits) end
  for i = 0, n - 1 do
    local s = states[i]
    if ok then
      add(s.z, now, seq, hits)
      s.count = s.count + hits
    end
    local oldest = redis.call('ZRANGE', s.z, 0, 0, 'WITHSCORES')
    local newest = redis.call('ZRANGE', s.z, -1, -1, 'WITHSCORES')
    s.remaining = math.max(s.amount - s.count, 0)
    s.reset = newest[2] and (tonumber(newest[2]) + s.per - now) or 0
    s.retry = oldest[2] and (tonumber(oldest[2]) + s.per - now) or 0
    redis.call('PEXPIRE', s.z, ms(s.per) + 1)
    life = math.max(life, ms(s.per) + 1)
  end
  redis.call('PEXPIRE', K, life)
elseif algo == 'sem' then
  local max, lease = limit(0)
  local z = KEYS[2]
  redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  local count = redis.call('ZCARD', z)
  if hits < 0 then
    -- A refund releases the permits that expire first.
    if count > 0 then redis.call('ZPOPMIN', z, math.min(-hits, count)) end
  elseif count + hits <= max then
    local seq = redis.call('HINCRBY', K, 'seq', hits)
    add(z, now + lease, seq, hits)
  else
    ok = false
  end
  count = redis.call('ZCARD', z)
  local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  local s = { remaining = math.max(max - count, 0) }
  s.reset = last[2] and (tonumber(last[2]) - now) or 0
  s.retry = first[2] and (tonumber(first[2]) - now) or 0
  states[0] = s
  n = 1
  redis.call('PEXPIRE', z, ms(lease) + 1)
  redis.call('PEXPIRE', K, ms(lease) + 1)
else
  return redis.error_reply('unknown algorithm ' .. algo)
end

-- The tightest limit speaks.
local best = 0
for i = 1, n - 1 do
  if states[i].remaining < states[best].remaining then best = i end
end
local s = states[best]
local retry = 0
if not ok or s.remaining == 0 then retry = ms(s.retry) end
return { ok and 1 or 0, best, s.remaining, ms(s.reset), retry }
