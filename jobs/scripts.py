"""Lua scripts for the job state changes that touch several keys at once.

Each runs atomically, so status, counters and events never drift apart, and each is idempotent
under redelivery (a chunk or segment applied twice leaves one copy). All keys of one call share the
job's hash tag, so the scripts are legal on Redis Cluster.
"""

# KEYS: job, attempts, events | ARGV: segment, now, maxlen, event data (json)
# An AR worker starts a segment: returns {status, attempt}; attempt 0 (nothing started) if the job is
# gone or ended. The first segment moves the job from 'queued' to 'running'.
# An attempt's number is the milliseconds since the job's creation by this server's clock, and at
# least one more than the segment's last: a counter alone would hand a number out again after Redis
# lost writes (a failover, a restart from the AOF) rolled it back, while the attempt that had it may
# still be sending chunks; the clock has moved past every number given before the loss. (The base
# is the job's created_at, the API host's clock: a host clock ahead of the server's leaves only the
# counter for as long as it is ahead.)
START_SEGMENT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return {status or '', 0} end
local t = redis.call('TIME')
local created = tonumber(redis.call('HGET', KEYS[1], 'created_at')) or 0
local since = math.floor((tonumber(t[1]) - created) * 1000 + tonumber(t[2]) / 1000)
local attempt = math.max((tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0) + 1, since)
redis.call('HSET', KEYS[2], ARGV[1], string.format('%d', attempt))
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[2])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'type', 'started', 'data', ARGV[4])
end
return {'running', attempt}
"""

# KEYS: job, done segments, deltas, scratch, abandoned | ARGV: segment, seq, final (0/1), pcm, attempt
# Returns 'dropped' (job gone or ended), 'finalizing' (all segments are in), 'stale' (segment already
# done, or this attempt was abandoned as a runaway), 'partial' or 'complete'.
ADD_DELTA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'finalizing' then return 'finalizing' end
if status ~= 'queued' and status ~= 'running' then return 'dropped' end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
    or redis.call('SISMEMBER', KEYS[5], ARGV[1] .. ':' .. ARGV[5]) == 1 then
  redis.call('DEL', KEYS[3])  -- a superseded attempt: drop what it sent so far
  redis.call('SREM', KEYS[4], KEYS[3])
  return 'stale'
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
if ARGV[3] == '1' then redis.call('HSET', KEYS[3], 'n', tonumber(ARGV[2]) + 1) end
redis.call('SADD', KEYS[4], KEYS[3])
local n = redis.call('HGET', KEYS[3], 'n')
if n and redis.call('HLEN', KEYS[3]) - 1 == tonumber(n) then return 'complete' end
return 'partial'
"""

# KEYS: job, done segments, events, deltas, scratch
# ARGV: segment, attempt, samples, seconds, now, maxlen, progress events per job
# Returns {applied (0/1), done, total}; when not applied, {0, winning attempt, 0} (-1: the job is
# over). The first attempt to complete a segment wins; later ones only clean up. The last segment
# moves the job to 'finalizing'; a copy of its winning attempt that comes after (two assemblers held
# the same final chunk) still hears that it won, so its caller keeps the part the finalize reads.
SEGMENT_DONE = """
redis.call('DEL', KEYS[4])
redis.call('SREM', KEYS[5], KEYS[4])
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'finalizing' then
  local winner = redis.call('HGET', KEYS[2], ARGV[1])
  return {0, winner and tonumber(string.match(winner, '^(%d+):')) or -1, 0}
end
if status ~= 'queued' and status ~= 'running' then return {0, -1, 0} end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2] .. ':' .. ARGV[3]) == 0 then
  local winner = redis.call('HGET', KEYS[2], ARGV[1])
  return {0, tonumber(string.match(winner, '^(%d+):')), 0}
end
local done = redis.call('HINCRBY', KEYS[1], 'segments_done', 1)
local audio = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'audio_seconds', ARGV[4]))
local total = tonumber(redis.call('HGET', KEYS[1], 'segments_total'))
local now = tonumber(ARGV[5])
local started = tonumber(redis.call('HGET', KEYS[1], 'started_at') or '0')
if started == nil or started <= 0 then started = now end
local eta = (now - started) / done * (total - done)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'type', 'segment', 'data', cjson.encode({
  index = tonumber(ARGV[1]), duration_s = tonumber(ARGV[4]), done = done, total = total}))
local every = math.max(1, math.floor(total / tonumber(ARGV[7])))
if done % every == 0 or done == total then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'type', 'progress', 'data', cjson.encode({
    done = done, total = total, audio_seconds = audio, eta_s = eta}))
end
if done == total then redis.call('HSET', KEYS[1], 'status', 'finalizing') end
return {1, done, total}
"""

# KEYS: job, abandoned, deltas, scratch, events | ARGV: segment, attempt, maxlen, event data (json)
# A runaway attempt is given up (its retry is queued by the caller): its audio so far is deleted and
# any that arrives later is dropped by ADD_DELTA. Emits a 'runaway' event once per attempt.
ABANDON_ATTEMPT = """
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], KEYS[3])
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return 0 end
if redis.call('SADD', KEYS[2], ARGV[1] .. ':' .. ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'type', 'runaway', 'data', ARGV[4])
return 1
"""

# KEYS: job, flags, events | ARGV: segment, flag (json), maxlen, event data (json)
# A segment kept after its last runaway retry is flagged once: the flag (for the manifest), the job's
# counter and a 'warning' event.
FLAG_SEGMENT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'segments_flagged', 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'type', 'warning', 'data', ARGV[4])
return 1
"""

# KEYS: job, events, then every key to expire | ARGV: new status, event type, event data, now,
#       error, maxlen, ttl, required current status ('' = any non-terminal), then field/value pairs
#       to set on the job with the change (the finished file's key)
# Ends the job (done, failed or cancelled) unless it already ended; its keys, and the delta hashes its
# scratch set lists (all in the job's slot), expire after ARGV[7]. Returns {tenant, model, priority,
# shard} if it changed (what its caller needs to release its job slot and drop its queued tasks), {} if
# not. A job that is gone (deleted) is never re-created.
END_JOB = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled' then return {} end
if ARGV[8] ~= '' and status ~= ARGV[8] then return {} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[4], 'error', ARGV[5])
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'type', ARGV[2], 'data', ARGV[3])
for i = 1, #KEYS do
  redis.call('EXPIRE', KEYS[i], ARGV[7])
  -- the delta hashes the scratch set lists go too, if its caller dies before clear_scratch
  if string.sub(KEYS[i], -8) == ':scratch' then
    for _, key in ipairs(redis.call('SMEMBERS', KEYS[i])) do redis.call('EXPIRE', key, ARGV[7]) end
  end
end
local owner = redis.call('HMGET', KEYS[1], 'tenant', 'model', 'priority', 'shard')
return {owner[1] or 'default', owner[2] or '', owner[3] or 'batch', owner[4] or '0'}
"""

# KEYS: the tenant's active-jobs set | ARGV: job id, the tenant's concurrent-jobs limit
# Takes one of the tenant's job slots for the job (1), or refuses (0) when all are taken. Idempotent.
RESERVE_JOB_SLOT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""


# --- fair admission (jobs/scheduler.py) ----------------------------------------------------------
# The keys of one shard share its hash tag: KEYS name the shard's work stream and its queue base
# (a name with the tag); the scripts derive the others from the base, all in the shard's slot.

# KEYS: queue base | ARGV: job, tenant, class, weight, front (1: before its queued tasks), tasks...
# Queues a job's tasks (each the JSON header of a SegmentTask) and makes the job and its tenant ready.
# A job joins its tenant's round at the tenant's current turn; a tenant that was idle starts at the
# class's current virtual time (no burst for having waited, no wait behind the others' history).
ENQUEUE = """
local base, job, tenant, class, front = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local queue = base .. ':job:' .. job
if front == '1' then
  for i = #ARGV, 6, -1 do redis.call('LPUSH', queue, ARGV[i]) end
else
  for i = 6, #ARGV do redis.call('RPUSH', queue, ARGV[i]) end
end
redis.call('INCRBY', base .. ':queued:' .. class, #ARGV - 5)
redis.call('HSET', base .. ':weights', tenant, ARGV[4])
local jobs = base .. ':jobs:' .. class .. ':' .. tenant
if not redis.call('ZSCORE', jobs, job) then
  local first = redis.call('ZRANGE', jobs, 0, 0, 'WITHSCORES')
  redis.call('ZADD', jobs, first[2] or 0, job)
end
local tenants = base .. ':tenants:' .. class
if not redis.call('ZSCORE', tenants, tenant) then
  redis.call('ZADD', tenants, redis.call('GET', base .. ':vt:' .. class) or 0, tenant)
end
return redis.call('LLEN', queue)
"""

#: Lua: the entries of a stream not yet delivered to any consumer (in it, minus those pending).
_UNDELIVERED = """
local function undelivered(stream)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return 0 end
  local pending = 0
  for _, group in ipairs(groups) do
    for i = 1, #group, 2 do if group[i] == 'pending' then pending = pending + group[i + 1] end end
  end
  return redis.call('XLEN', stream) - pending
end
"""

# KEYS: work stream, queue base | ARGV: wanted, schema version, interactive extra
# Moves tasks from the queues to the work stream until it holds ``wanted`` entries not yet delivered,
# or ``wanted`` + ``interactive extra`` while interactive tasks are queued (slots only they take):
# interactive before batch; between tenants the one with the lowest pass, which then advances by
# 1/weight (stride scheduling); within a tenant its job with the lowest pass (round robin); within a
# job, book order. Returns how many it moved.
ADMIT = _UNDELIVERED + """
local base = KEYS[2]
local want = tonumber(ARGV[1]) - undelivered(KEYS[1])
local want_interactive = want + tonumber(ARGV[3] or '0')
local moved = 0
local guard = 0
while moved < want_interactive and guard < 10 * want_interactive + 100 do
  guard = guard + 1
  local class = nil
  if redis.call('ZCARD', base .. ':tenants:interactive') > 0 then
    class = 'interactive'
  elseif moved < want and redis.call('ZCARD', base .. ':tenants:batch') > 0 then
    class = 'batch'
  end
  if not class then break end
  local tenants = base .. ':tenants:' .. class
  local top = redis.call('ZRANGE', tenants, 0, 0, 'WITHSCORES')
  local tenant, pass = top[1], tonumber(top[2])
  local jobs = base .. ':jobs:' .. class .. ':' .. tenant
  local first = redis.call('ZRANGE', jobs, 0, 0)
  if #first == 0 then
    redis.call('ZREM', tenants, tenant)
  else
    local job = first[1]
    local queue = base .. ':job:' .. job
    local task = redis.call('LPOP', queue)
    if task then
      redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'h', task)
      redis.call('DECR', base .. ':queued:' .. class)
      moved = moved + 1
    end
    local weight = tonumber(redis.call('HGET', base .. ':weights', tenant) or '1')
    redis.call('SET', base .. ':vt:' .. class, pass)
    redis.call('ZADD', tenants, pass + 1 / weight, tenant)
    redis.call('ZINCRBY', jobs, 1, job)
    if redis.call('LLEN', queue) == 0 then
      redis.call('ZREM', jobs, job)
      if redis.call('ZCARD', jobs) == 0 then redis.call('ZREM', tenants, tenant) end
    end
  end
end
return moved
"""

# KEYS: queue base | ARGV: job, tenant, class
# Drops a job's queued tasks (it ended): O(1) for any number of them (UNLINK frees them in the
# background). Returns how many there were.
DROP = """
local base, job, tenant, class = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local queue = base .. ':job:' .. job
local n = redis.call('LLEN', queue)
redis.call('UNLINK', queue)
if n > 0 then redis.call('DECRBY', base .. ':queued:' .. class, n) end
local jobs = base .. ':jobs:' .. class .. ':' .. tenant
redis.call('ZREM', jobs, job)
if redis.call('ZCARD', jobs) == 0 then redis.call('ZREM', base .. ':tenants:' .. class, tenant) end
return n
"""

# KEYS: work stream, queue base | ARGV: job, tenant, class
# Where a job stands: {its queued tasks, an estimate of the tasks that go before its next one (what
# the stream holds undelivered, everything queued in a higher class, a turn of each tenant whose
# pass is lower than its tenant's and of each of its tenant's jobs before it)}.
PLACE = _UNDELIVERED + """
local base, job, tenant, class = KEYS[2], ARGV[1], ARGV[2], ARGV[3]
local ahead = undelivered(KEYS[1])
if class == 'batch' then ahead = ahead + tonumber(redis.call('GET', base .. ':queued:interactive') or '0') end
local tenants = base .. ':tenants:' .. class
local pass = redis.call('ZSCORE', tenants, tenant)
if pass then ahead = ahead + redis.call('ZCOUNT', tenants, '-inf', '(' .. pass) end
local jobs = base .. ':jobs:' .. class .. ':' .. tenant
local mine = redis.call('ZSCORE', jobs, job)
if mine then ahead = ahead + redis.call('ZCOUNT', jobs, '-inf', '(' .. mine) end
return {redis.call('LLEN', base .. ':job:' .. job), ahead}
"""
