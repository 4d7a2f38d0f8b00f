"""Every Redis key, stream and consumer group of the fleet, in one place.

Per-job keys carry the job id as a hash tag (``...:{<job_id>}...``) so that a job's keys live in one
Redis Cluster slot and the Lua scripts that change several of them stay legal on a cluster.
Stage streams are per model (but the audio stream, every model's) so that a worker serves only what
it loaded, and in ``task_shards`` shards, each its own hash tag: a job's entries go to its shard
(``jobs.scheduler.shard_of``), so on a Redis Cluster the stages' traffic spreads over the primaries.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Consumer group of AR workers on a model's task stream.
AR_GROUP = "ar"
#: Consumer group of decoder workers on a model's code-chunk stream.
DECODER_GROUP = "decoder"
#: Consumer group of assemblers on the audio stream.
ASSEMBLER_GROUP = "assembler"
#: Consumer group of speech workers (single-stage models) on a model's task stream.
SPEECH_GROUP = "speech"
#: Parts of the fleet-wide counters hash (``Names.counters``).
COUNTER_PARTS = 8


@dataclass(frozen=True)
class Names:
    prefix: str

    # --- stage streams -------------------------------------------------------------------------
    def tasks(self, model: str, shard: int = 0) -> str:
        """Stream of SegmentTask: segments of ``model`` admitted for an engine (jobs/scheduler.py),
        one per shard; read by AR or speech workers."""
        return f"{self.prefix}:tasks:{{{model}.{shard}}}"

    def queues(self, model: str, shard: int = 0) -> str:
        """Base name of a shard's admission keys (same hash tag as its task stream): ``:job:<id>``
        (list: a job's queued tasks, JSON headers, in book order), ``:jobs:<class>:<tenant>`` (zset:
        the tenant's ready jobs -> pass), ``:tenants:<class>`` (zset: ready tenants -> pass), ``:vt:<class>``
        (the class's virtual time), ``:weights`` (hash: tenant -> weight), ``:queued:<class>`` (count)."""
        return f"{self.prefix}:q:{{{model}.{shard}}}"

    def codes(self, model: str, shard: int = 0) -> str:
        """Stream of CodeChunk from AR workers to the decoders of ``model``'s codec, one per shard
        (the task shard's hash tag: a job's codes go to its task stream's slot)."""
        return f"{self.prefix}:codes:{{{model}.{shard}}}"

    def audio(self, shard: int = 0) -> str:
        """Stream of AudioChunk (delta PCM) from decoders and speech workers to assemblers, one per
        shard, every model's (a tag of its own: no model's)."""
        return f"{self.prefix}:audio:{{{self.prefix}.a{shard}}}"

    def stage_streams(self, models: list[str], shards: int) -> list[str]:
        """Every stage stream of these models (task, codes, audio) in every shard; a codes stream
        even for a single-stage model, which never has one (what deletes and sweeps go over)."""
        tasks = [self.tasks(m, s) for m in models for s in range(shards)]
        codes = [self.codes(m, s) for m in models for s in range(shards)]
        return [*tasks, *codes, *(self.audio(s) for s in range(shards))]

    def dead_letters(self) -> str:
        """Stream of messages that failed permanently or too often, with their error."""
        return f"{self.prefix}:dead"

    # --- readiness -----------------------------------------------------------------------------
    def live_workers(self, kind: str, model: str) -> str:
        """Sorted set: worker (consumer name) -> unix time of its last heartbeat, per worker kind
        ("ar", "decoder", "speech") and model. Members older than 3 heartbeats are dead."""
        return f"{self.prefix}:live:{kind}:{model}"

    # --- tenants and keys ------------------------------------------------------------------------
    def api_keys(self) -> str:
        """Hash: SHA-256 of an API key -> JSON {tenant, admin, label, created_at} (jobs/tenants.py)."""
        return f"{self.prefix}:keys"

    def api_keys_made(self) -> str:
        """String: set when the first key is made and never unset, so that revoking the last key
        does not open an "auto" API to everyone (jobs/tenants.py)."""
        return f"{self.prefix}:keys-made"

    def tenants(self) -> str:
        """Set of tenant names."""
        return f"{self.prefix}:tenants"

    def tenant(self, tenant: str) -> str:
        """Hash: a tenant's limits (jobs.tenants.Limits fields; absent: the fleet's default), created_at."""
        return f"{self.prefix}:tenant:{{{tenant}}}"

    def segment_cache(self, scope: str) -> str:
        """Hash: a segment cache's keys -> samples (jobs/segcache.py); scope: "t-<tenant>" or "shared"."""
        return f"{self.prefix}:segcache:{{{scope}}}"

    def segment_cache_used(self, scope: str) -> str:
        """Sorted set: a segment cache's keys -> last use (its retention)."""
        return f"{self.segment_cache(scope)}:used"

    def lexicons(self, tenant: str) -> str:
        """Hash: a tenant's pronunciation lexicons, name -> JSON entries (jobs/lexicon.py)."""
        return f"{self.tenant(tenant)}:lexicons"

    def tenant_jobs(self, tenant: str) -> str:
        """Sorted set: the tenant's job ids -> creation time (GET /v1/jobs)."""
        return f"{self.tenant(tenant)}:jobs"

    def tenant_active(self, tenant: str) -> str:
        """Set: the tenant's jobs not yet ended (its concurrent-jobs limit)."""
        return f"{self.tenant(tenant)}:active"

    def idempotency(self, tenant: str, key_digest: str) -> str:
        """String (24 h): what an Idempotency-Key of the tenant created: "pending:<body hash>" or
        "job:<job id>:<body hash>"."""
        return f"{self.tenant(tenant)}:idem:{key_digest}"

    def rate_limits(self) -> str:
        """Key prefix of the rate limiter's counters (the ``limits`` library keeps its own keys under it)."""
        return f"{self.prefix}:limits"

    def link_secret(self) -> str:
        """String: the secret that signs short-lived links (events, audio) when none is configured."""
        return f"{self.prefix}:link-secret"

    # --- jobs ----------------------------------------------------------------------------------
    def jobs_index(self) -> str:
        """Sorted set: job id -> creation time (unix seconds)."""
        return f"{self.prefix}:jobs"

    def finalizing(self) -> str:
        """Sorted set: job id -> unix time its last segment was assembled (its finalize was queued);
        left when the finalize ends the job. The sweep (jobs/sweep.py) looks here for lost finalizes."""
        return f"{self.prefix}:finalizing"

    def counters(self, part: int = 0) -> str:
        """Hash: fleet-wide counters that Prometheus reads through the API's /metrics (jobs/metrics.py):
        ``jobs_ended:<state>`` -> jobs that ended so (done, failed, cancelled). Kept in
        ``COUNTER_PARTS`` parts (a job counts in the part of its id), summed when read: on a Redis
        Cluster each part is its own slot, so no one slot takes every job's end."""
        if part == 0:
            return f"{self.prefix}:counters"  # the name from before the parts
        return f"{self.prefix}:counters:{{{self.prefix}.c{part}}}"

    def sweep_lock(self) -> str:
        """String with a TTL of one sweep interval: the worker that set it runs this interval's sweep."""
        return f"{self.prefix}:sweep"

    def server_runs(self) -> str:
        """String: JSON list of the run ids of the servers holding the keys when the sweep last looked;
        one it has not seen means a restart or failover that may have lost writes (jobs/recovery.py)."""
        return f"{self.prefix}:server-runs"

    def job(self, job_id: str) -> str:
        """Hash: the job's request, status and counters (see jobs.model.Job)."""
        return f"{self.prefix}:job:{{{job_id}}}"

    def plan(self, job_id: str) -> str:
        """String: JSON of the segment plan (segments, paragraphs, chapters)."""
        return f"{self.job(job_id)}:plan"

    def done_segments(self, job_id: str) -> str:
        """Hash: segment index -> "<attempt>:<samples>" of the attempt that completed it first."""
        return f"{self.job(job_id)}:segs"

    def attempts(self, job_id: str) -> str:
        """Hash: segment index -> the number of its latest attempt (unique, increasing: the ms since the
        job's creation when it started, jobs/scripts.py START_SEGMENT)."""
        return f"{self.job(job_id)}:attempts"

    def events(self, job_id: str) -> str:
        """Capped stream of progress events; entry ids are the SSE event ids."""
        return f"{self.job(job_id)}:events"

    def deltas(self, job_id: str, segment: int, attempt: int) -> str:
        """Hash: chunk seq -> delta PCM of one attempt at one segment, until it is assembled."""
        return f"{self.job(job_id)}:deltas:{segment}:{attempt}"

    def abandoned(self, job_id: str) -> str:
        """Set of "<segment>:<attempt>" given up as runaways: their late audio is dropped, never assembled."""
        return f"{self.job(job_id)}:abandoned"

    def flags(self, job_id: str) -> str:
        """Hash: segment index -> JSON of the runaway it kept after its last retry (kind, detail, retries)."""
        return f"{self.job(job_id)}:flags"

    def scratch_keys(self, job_id: str) -> str:
        """Set of the job's transient keys (delta hashes), deleted when the job ends."""
        return f"{self.job(job_id)}:scratch"

    def job_keys(self, job_id: str) -> list[str]:
        """The job's long-lived keys (what a result TTL or a delete must cover)."""
        return [
            self.job(job_id),
            self.plan(job_id),
            self.done_segments(job_id),
            self.attempts(job_id),
            self.events(job_id),
            self.scratch_keys(job_id),
            self.abandoned(job_id),
            self.flags(job_id),
        ]


# --- storage object keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JobObjects:
    """Storage keys of one job's objects, under its tenant's prefix: ``tenants/<tenant>/...``."""

    tenant: str
    job_id: str

    @property
    def root(self) -> str:
        return f"tenants/{self.tenant}/"

    def part(self, segment: int, attempt: int) -> str:
        """One assembled segment (raw PCM int16 mono at the model's rate)."""
        return f"{self.parts_prefix}{segment:06d}-{attempt}.pcm"

    @property
    def parts_prefix(self) -> str:
        return f"{self.root}parts/{self.job_id}/"

    @property
    def outputs_prefix(self) -> str:
        """What every finished output of the job starts with (its file and manifest)."""
        return f"{self.root}audio/{self.job_id}."

    def audio(self, fmt: str) -> str:
        """The finished file."""
        return f"{self.outputs_prefix}{fmt}"

    def chapter(self, name: str) -> str:
        """One chapter's file (``name``: jobs.audio.chapter_file_name)."""
        return f"{self.outputs_prefix}{name}"

    @property
    def chapters_zip(self) -> str:
        """Every chapter's file in one zip."""
        return f"{self.outputs_prefix}chapters.zip"

    @property
    def cover(self) -> str:
        """The cover picture a job uploaded (deleted with its outputs)."""
        return f"{self.outputs_prefix}cover"

    @property
    def manifest(self) -> str:
        """The finished file's manifest (chapters, segment timestamps)."""
        return f"{self.outputs_prefix}json"

    @property
    def prefixes(self) -> tuple[str, str]:
        """Everything the job has in storage."""
        return self.parts_prefix, self.outputs_prefix
