"""Lua scripts for the job state changes that touch several keys at once.

Each runs atomically, so status, counters and events never drift apart, and each is idempotent
under redelivery (a chunk or segment applied twice leaves one copy). All keys of one call share the
job's hash tag, so the scripts are legal on Redis Cluster.
"""

# KEYS: job, attempts, events | ARGV: segment, now, maxlen, event data (json)
# An AR worker starts a segment: returns {status, attempt}; attempt 0 (nothing started) if the job is
# gone or ended. The first segment moves the job from 'queued' to 'running'.
START_SEGMENT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return {status or '', 0} end
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
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
# moves the job to 'finalizing'.
SEGMENT_DONE = """
redis.call('DEL', KEYS[4])
redis.call('SREM', KEYS[5], KEYS[4])
local status = redis.call('HGET', KEYS[1], 'status')
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
# Ends the job (done, failed or cancelled) unless it already ended. Returns its tenant if it changed
# ('' if not). A job that is gone (deleted) is never re-created.
END_JOB = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled' then return '' end
if ARGV[8] ~= '' and status ~= ARGV[8] then return '' end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[4], 'error', ARGV[5])
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'type', ARGV[2], 'data', ARGV[3])
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return redis.call('HGET', KEYS[1], 'tenant') or 'default'
"""

# KEYS: the tenant's active-jobs set | ARGV: job id, the tenant's concurrent-jobs limit
# Takes one of the tenant's job slots for the job (1), or refuses (0) when all are taken. Idempotent.
RESERVE_JOB_SLOT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""
