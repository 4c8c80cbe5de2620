-- Registers one daemon's definition of one cluster rule.
-- KEYS[1]: the rule's hash of node -> "<definition>:<unix ms>"
-- KEYS[2]: the same rule's hash of node -> its ttl in ms (hosts with
--          another sync_interval renew at another pace; a hash of its
--          own, so that a host of an older rl reads KEYS[1] as before)
-- ARGV: node, definition, ttl_ms
-- Returns nil when registered, else the node that defines the rule
-- differently (and is alive: renewed within its own ttl).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local node, v = all[i], all[i + 1]
  if node ~= ARGV[1] then
    local sep = string.find(v, ':', 1, true)
    local def, at = string.sub(v, 1, sep - 1), tonumber(string.sub(v, sep + 1))
    local its = tonumber(redis.call('HGET', KEYS[2], node)) or ttl
    if now - at > its then
      redis.call('HDEL', KEYS[1], node)
      redis.call('HDEL', KEYS[2], node)
    elseif def ~= ARGV[2] then
      return node
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now)
redis.call('HSET', KEYS[2], ARGV[1], ttl)
-- Only ever longer: a host with a short ttl must not expire the entries
-- of hosts that renew less often.
for _, k in ipairs(KEYS) do
  if redis.call('PTTL', k) < ttl then
    redis.call('PEXPIRE', k, ttl)
  end
end
return false
