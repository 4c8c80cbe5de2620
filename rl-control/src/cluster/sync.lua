-- One host's report of packet-rule usage for a batch of buckets in one
-- hash slot, charged to each bucket's cluster-wide token bucket on Redis'
-- clock; answers how far ahead of now each cluster bucket is.
--
-- KEYS[i]: one bucket of a cluster packet rule, a hash:
--   t            the cluster bucket's theoretical arrival time (µs, Redis'
--                clock), charged with every host's reported packets
--   c:<reporter> packets this daemon run reported in total (idempotent:
--                a report that timed out but was applied later, or arrives
--                twice, is charged once)
--   a:<reporter> when it last reported (µs): a reporter silent for
--                keep-alive is dropped from the hash once it holds many
-- ARGV[1]: this daemon run's name (node:boot); ARGV[2]: µs per packet;
-- ARGV[3]: the sync interval in µs (reported packets passed within it);
-- ARGV[4]: keep-alive in ms; then per key: cumulative, delta (packets since
-- the last acknowledged report, charged when the key's ledger is gone:
-- expired, or Redis restarted empty).
-- Returns, per key, µs the cluster bucket is ahead of now (0: not ahead).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local me, cost, span, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i, K in ipairs(KEYS) do
  local cum, delta = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
  local v = redis.call('HMGET', K, 't', 'c:' .. me)
  local tat = tonumber(v[1] or 0)
  local reported = tonumber(v[2] or -1)
  -- What the ledger says is new, never more than the sender's own count
  -- of packets not acknowledged: a ledger older than the sender's (Redis
  -- back from a snapshot, a lagging replica) charges no packet twice. A
  -- sender counts a bucket it tracks anew (never reported, or forgotten
  -- while other hosts kept the hash alive) on from all it reported, above
  -- its old count: all its delta is charged. A count below the ledger's
  -- is a stale report (applied after a newer one): charged nothing.
  local charge = delta
  if reported >= 0 then charge = math.max(math.min(cum - reported, delta), 0) end
  local ledger = math.max(cum, reported)
  -- The packets passed during the last interval, not all at this instant.
  if tat < now - span then tat = now - span end
  tat = tat + charge * cost
  redis.call('HSET', K, 't', tat, 'c:' .. me, ledger, 'a:' .. me, now)
  if redis.call('HLEN', K) > 129 then
    -- Past 64 runs (t, and c: and a: per run). Each daemon run reports
    -- under a name of its own: drop the runs gone quiet for keep-alive
    -- (restarted hosts), or a key some host keeps hot gains a field per
    -- restart for ever.
    local f = redis.call('HGETALL', K)
    for j = 1, #f, 2 do
      local name = f[j]
      if string.sub(name, 1, 2) == 'a:' and tonumber(f[j + 1]) < now - keep * 1000 then
        redis.call('HDEL', K, name, 'c:' .. string.sub(name, 3))
      end
    end
  end
  -- Kept while it carries other hosts' charges (a slow rule's bucket may
  -- be ahead of now for far longer than keep-alive: forgotten, every host
  -- would pass its full rate again), then keep-alive more.
  redis.call('PEXPIRE', K, keep + math.max(math.ceil((tat - now) / 1000), 0))
  out[i] = math.max(math.floor(tat - now), 0)
end
return out
