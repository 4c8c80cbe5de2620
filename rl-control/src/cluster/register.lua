-- Registers one daemon's definition of one cluster rule.
-- KEYS[1]: the rule's hash of node -> "<definition>:<unix ms>"
-- ARGV: node, definition, ttl_ms
-- Returns nil when registered, else the node that defines the rule
-- differently (and is alive: renewed within ttl_ms).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local node, v = all[i], all[i + 1]
  if node ~= ARGV[1] then
    local sep = string.find(v, ':', 1, true)
    local def, at = string.sub(v, 1, sep - 1), tonumber(string.sub(v, sep + 1))
    if now - at > ttl then
      redis.call('HDEL', KEYS[1], node)
    elseif def ~= ARGV[2] then
      return node
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now)
redis.call('PEXPIRE', KEYS[1], ttl)
return false
