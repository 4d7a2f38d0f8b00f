"""Accepting a job (validate the request, plan its segments, store it, enqueue its tasks) and deleting one.

Shared by the HTTP API and the ``narrate file`` command, so both accept and refuse the same things.
Validation happens entirely before anything is written: a refused request leaves no trace.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from fleet.messages import SegmentTask
from fleet.settings import Settings
from fleet.storage import Storage
from jobs.audio import SAMPLE_RATES
from jobs.books import Book, layout, select
from jobs.encoding import CoverError, format_named, format_names, read_cover
from jobs.errors import QUOTE_LIMIT, InvalidRequest, JobNotFound, QuotaExceeded, TooLarge, quoted
from jobs.finalize import delete_outputs, forget_finalize
from jobs.lexicon import Entry, Lexicon
from jobs.model import Job, JobStatus
from jobs.normalize import SUPPORTED as NORMALIZED_LANGUAGES
from jobs.normalize import normalize as normalize_text
from jobs.scheduler import BATCH, CLASSES, INTERACTIVE, shard_of
from jobs.segcache import SegmentCache, keys_of, scope_of
from jobs.segmentation import Block, Plan, Segment, plain, plan_blocks, plan_text
from jobs.store import JobStore
from jobs.tenants import DEFAULT_TENANT, Principal
from models.registry import MODELS, UnknownModelError, get_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobRequest:
    text: str
    title: str | None = None
    voice: str | None = None
    model: str | None = None
    format: str = "wav"
    sample_rate: int | None = None
    seed: int = 0
    markdown: bool = True
    #: Speaking rate (words per minute) and pitch (0-100): single-stage models only; None: default.
    rate: int | None = None
    pitch: int | None = None
    #: Who submits it (jobs/tenants.py).
    tenant: str = DEFAULT_TENANT
    #: "interactive" or "batch" (jobs/scheduler.py); None: interactive if it is short.
    priority: str | None = None
    #: Compressed formats: the bitrate in kb/s (None: the format's speech default).
    bitrate_kbps: int | None = None
    #: Tags of the file; narrator None: the voice's name.
    author: str = ""
    narrator: str | None = None
    year: int | None = None
    language: str = ""
    #: Loudness normalisation: None follows the format (on for m4b/m4a/mp3/opus, off for wav/flac).
    normalize: bool | None = None
    loudness_lufs: float = -18.0
    true_peak_dbtp: float = -3.0
    #: A cover picture (PNG or JPEG bytes) for the formats that carry one.
    cover: bytes | None = None
    #: Also one file per chapter (and a zip of them).
    chapter_files: bool = False
    #: The paragraphs and headings of ``text`` when they are known (a book's, ``from_book``).
    blocks: list[Block] | None = None
    #: Pronunciations, applied to what is said (the job's own entries, then its named lexicons').
    lexicon: list[Entry] = field(default_factory=list)
    #: Numbers, dates, currencies... as words (jobs/normalize.py); None: as the model's family says.
    normalize_text: bool | None = None


def from_book(request: JobRequest, book: Book, chapters: list[int | str] | None = None) -> JobRequest:
    """The request for narrating ``book`` (the ``chapters`` chosen, else its body): its text laid
    out with its chapters, and the book's title, author, language and cover where the request gives
    none (a cover only for formats that carry one, and only if it is a usable picture)."""
    text, blocks = layout(select(book, chapters))
    cover = request.cover
    fmt = format_named(request.format)
    if cover is None and book.cover and fmt is not None and fmt.cover:
        try:
            read_cover(book.cover, 2**31)
            cover = book.cover
        except CoverError:
            pass  # a book whose cover is not a PNG or JPEG is still narrated, without it
    return replace(
        request,
        text=text,
        blocks=blocks,
        markdown=False,
        title=request.title or book.title or None,
        author=request.author or book.author,
        language=request.language or book.language,
        cover=cover,
    )


def segment_seed(job_seed: int, voice: str, text: str) -> int:
    """The sampling seed of a segment: the same sentence in the same voice sounds the same anywhere,
    and a retried segment reproduces its codes."""
    digest = hashlib.blake2b(f"{job_seed}\x1f{voice}\x1f{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def validate(request: JobRequest, settings: Settings, max_text_chars: int | None = None) -> tuple[Job, Plan]:
    """The job and its plan, or the reason it is refused (nothing is written either way).
    ``max_text_chars``: the submitting tenant's limit, if lower than the fleet's."""
    limit = min(max_text_chars or settings.max_text_chars, settings.max_text_chars)
    if not request.text or not request.text.strip():
        raise InvalidRequest("text is empty: send the text to narrate")
    try:
        request.text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"text is not valid Unicode: a lone surrogate (U+{ord(request.text[exc.start]):04X}) at character "
            f"{exc.start:,}"
        ) from None
    if len(request.text) > limit:
        raise TooLarge(f"text has {len(request.text):,} characters; this fleet accepts at most {limit:,}")
    for name in ("voice", "model", "format"):
        value = getattr(request, name)
        if value is not None and len(value) > QUOTE_LIMIT:
            raise InvalidRequest(f"{name} {quoted(value)} is not a {name} of this fleet (see GET /v1/models)")
    try:
        spec = get_model(request.model or settings.default_model, settings)
    except UnknownModelError as exc:
        raise InvalidRequest(str(exc)) from exc
    family = spec.family
    voice = request.voice or family.default_voice
    speech_rate, pitch = _prosody(spec, request)
    if spec.single_stage:
        if problem := family.voice_problem(voice):
            raise InvalidRequest(f"{problem} (model {spec.name!r})")
        voice = family.canonical_voice(voice)
    elif voice not in family.voices:
        raise InvalidRequest(
            f"unknown voice {voice!r} for model {spec.name!r}; voices: {', '.join(family.voices)}"
        )
    fmt = format_named(request.format)
    if fmt is None:
        raise InvalidRequest(f"unsupported format {quoted(request.format)}; supported: {', '.join(format_names())}")
    rates = [r for r in SAMPLE_RATES if fmt.rates is None or r in fmt.rates]
    rate = request.sample_rate
    if rate is None:
        rate = family.sample_rate if family.sample_rate in rates else fmt.preferred_rate or max(rates)
    if rate not in rates:
        raise InvalidRequest(
            f"unsupported sample rate {rate} for {fmt.name}; supported: {', '.join(map(str, rates))}"
        )
    kbps = 0
    if request.bitrate_kbps is not None:
        low, high = fmt.kbps_range
        if not fmt.lossy:
            raise InvalidRequest(f"{fmt.name} is lossless: it takes no bitrate")
        if not low <= request.bitrate_kbps <= high:
            raise InvalidRequest(f"bitrate {request.bitrate_kbps} kb/s is out of range for {fmt.name}: {low}-{high}")
        kbps = request.bitrate_kbps
    normalize = fmt.lossy if request.normalize is None else request.normalize
    if not -40 <= request.loudness_lufs <= -5:
        raise InvalidRequest(f"loudness_lufs {request.loudness_lufs} is out of range: -40 to -5 LUFS")
    if not -12 <= request.true_peak_dbtp <= 0:
        raise InvalidRequest(f"true_peak_dbtp {request.true_peak_dbtp} is out of range: -12 to 0 dBTP")
    cover = ""
    if request.cover is not None:
        if not fmt.cover:
            raise InvalidRequest(f"{fmt.name} carries no cover picture (m4b, m4a, mp3 and opus do)")
        try:
            cover = read_cover(request.cover, settings.max_cover_bytes).mime
        except CoverError as exc:
            raise InvalidRequest(str(exc)) from None
    if request.language and not (len(request.language) == 3 and request.language.isascii() and request.language.isalpha()):
        raise InvalidRequest(f"language {quoted(request.language)} is not an ISO 639-2 code (three letters, e.g. eng)")
    if request.year is not None and not 0 < request.year <= 9999:
        raise InvalidRequest(f"year {request.year} is not a year (1-9999)")
    if request.blocks is not None:
        plan = plan_blocks(request.text, request.blocks, max_chars=settings.max_segment_chars)
    else:
        plan = plan_text(request.text, markdown=request.markdown, max_chars=settings.max_segment_chars)
    if family.reads_phonemes:  # "[[" in the text is not the voice's phoneme markup: only a lexicon's is
        plan = replace(
            plan,
            segments=[
                replace(s, say=s.spoken_text.replace("[[", "[ [")) if "[[" in s.spoken_text else s
                for s in plan.segments
            ],
        )
    if request.lexicon:
        if not family.reads_phonemes and (e := next((e for e in request.lexicon if e.phonemes), None)):
            raise InvalidRequest(
                f"the lexicon entry for {e.key()} gives phonemes, which model {spec.name!r} cannot read: give say (words)"
            )
        plan = _pronounce(plan, Lexicon(request.lexicon))
    wants = family.normalizes_text if request.normalize_text is None else request.normalize_text
    if wants and (request.language or "eng") in NORMALIZED_LANGUAGES:
        plan = _normalized(plan, request.language or "eng")
    if not plan.segments:
        raise InvalidRequest(
            "text has nothing to narrate: no letter or digit outside markup and code "
            "(only punctuation, control or invisible characters)"
        )
    job = Job(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        model=spec.name,
        voice=voice,
        format=fmt.name,
        sample_rate=rate,
        bitrate_kbps=kbps,
        author=request.author[:500],
        narrator=(voice if request.narrator is None else request.narrator)[:500],
        year=request.year or 0,
        language=request.language.lower(),
        loudness_lufs=request.loudness_lufs if normalize else 0.0,
        true_peak_dbtp=request.true_peak_dbtp,
        cover=cover,
        chapter_files=int(request.chapter_files),
        seed=request.seed,
        title=(request.title or (plan.chapters[0].title if plan.chapters else ""))[:500],
        text_chars=len(request.text),
        segments_total=len(plan.segments),
        chapters=len(plan.chapters),
        created_at=time.time(),
        rate=speech_rate,
        pitch=pitch,
        tenant=request.tenant,
    )
    job.priority = _priority(request, len(plan.segments), settings)
    job.shard = shard_of(job.id, settings.task_shards)
    if scope := scope_of(settings, job.tenant):  # the segment cache's keys: what would reuse them
        plan.cache_keys, plan.cache_scope = keys_of(job, plan, settings), scope
    return job, plan


def _pronounce(plan: Plan, lexicon: Lexicon) -> Plan:
    """The plan with the lexicon applied to what each segment says; a segment left with nothing to
    say (every word replaced by "") is a 422."""
    segments = []
    for segment in plan.segments:
        said = lexicon.apply(segment.spoken_text)
        if said != segment.spoken_text:
            if not said.strip():
                raise InvalidRequest(f"the lexicon leaves segment {segment.index} ({segment.text[:60]!r}) with nothing to say")
            segment = replace(segment, say=" ".join(said.split()))
        segments.append(segment)
    return replace(plan, segments=segments, lexicon=lexicon.report())


def _normalized(plan: Plan, language: str) -> Plan:
    """Numbers, dates, currencies... as words in what each segment says (after the lexicon: the
    user's own pronunciations win). The map back to the written text is kept where the lexicon
    left the segment as written."""
    segments = []
    for segment in plan.segments:
        said, spans = normalize_text(segment.spoken_text, language)
        if said != segment.spoken_text:
            segment = replace(segment, say=said, say_map=spans if not segment.say else [])
        segments.append(segment)
    return replace(plan, segments=segments, normalized=language)


def _priority(request: JobRequest, segments: int, settings: Settings) -> str:
    if request.priority is None:
        return INTERACTIVE if segments <= settings.interactive_max_segments else BATCH
    if request.priority not in CLASSES:
        raise InvalidRequest(f"priority {quoted(request.priority)} is not one of {', '.join(CLASSES)}")
    return request.priority


def _prosody(spec, request: JobRequest) -> tuple[int, int]:
    """The job's (rate, pitch): the single-stage family's defaults, or (0, 0) for a model without them."""
    if not spec.single_stage:
        if request.rate is not None or request.pitch is not None:
            raise InvalidRequest(f"model {spec.name!r} has no rate or pitch settings")
        return 0, 0
    family = spec.family
    rate = family.default_rate if request.rate is None else request.rate
    pitch = family.default_pitch if request.pitch is None else request.pitch
    if problem := family.prosody_problem(rate, pitch):
        raise InvalidRequest(problem)
    return rate, pitch


def segment_task(job: Job, segment: Segment, retry: int = 0) -> SegmentTask:
    said = segment.spoken_text
    if not MODELS[job.model].family.reads_emphasis:
        said = plain(said)  # emphasis marks only for voices that can stress words
    return SegmentTask(
        job_id=job.id,
        segment=segment.index,
        text=said,
        model=job.model,
        voice=job.voice,
        seed=segment_seed(job.seed, job.voice, said),
        rate=job.rate,
        pitch=job.pitch,
        retry=retry,
        interactive=job.priority == INTERACTIVE,
    )


def tasks_for(job: Job, plan: Plan, longest_first_window: int = 0) -> list[SegmentTask]:
    """The tasks of the segments to render (not those taken from the segment cache), in the order
    they are queued (``queue_order``)."""
    tasks = [segment_task(job, s) for s in plan.segments if s.index not in plan.reused]
    return [tasks[i] for i in queue_order([len(t.text) for t in tasks], longest_first_window)]


def queue_order(lengths: list[int], window: int) -> list[int]:
    """Positions in book order, except that within each run of ``window`` after the first, the
    longest go first (ties in book order); the first stays first (settings.longest_first_window)."""
    if window <= 1 or len(lengths) <= 2:
        return list(range(len(lengths)))
    order = [0]
    for start in range(1, len(lengths), window):
        order += sorted(range(start, min(start + window, len(lengths))), key=lambda i: -lengths[i])
    return order


@dataclass(frozen=True)
class Encoded:
    """A validated job's plan and tasks as they are stored (its JSON, their headers)."""

    plan: str
    tasks: list[bytes]


def encode(job: Job, plan: Plan, longest_first_window: int = 0) -> Encoded:
    """What ``enqueue`` writes, made ahead (the API makes it in a thread, with the validation)."""
    return Encoded(plan.to_json(), [t.header() for t in tasks_for(job, plan, longest_first_window)])


async def submit(
    store: JobStore, settings: Settings, request: JobRequest, concurrent_jobs: int | None = None
) -> Job:
    """Validate, then store and queue the job. ``concurrent_jobs``: the tenant's limit of jobs not
    yet ended (``QuotaExceeded`` when all are taken)."""
    job, plan = validate(request, settings)
    await enqueue(store, job, plan, concurrent_jobs)
    return job


async def reserve_slot(store: JobStore, job: Job, concurrent_jobs: int) -> None:
    """Take one of the tenant's ``concurrent_jobs`` slots for the job, or ``QuotaExceeded``
    (idempotent; ``store.release_job_slot`` gives it back if the job is not stored after all)."""
    if not await store.reserve_job_slot(job.tenant, job.id, concurrent_jobs):
        raise QuotaExceeded(
            f"tenant {job.tenant} has {concurrent_jobs} jobs still going, its limit: "
            "wait for one to end (or delete one)",
            retry_after_s=30,
        )


async def store_cover(storage: Storage, job: Job, data: bytes | None) -> None:
    """Keep a validated job's cover picture for its finalize (before the job is queued)."""
    if job.cover and data is not None:
        await asyncio.to_thread(storage.put_bytes, job.objects.cover, data)


async def enqueue(
    store: JobStore,
    job: Job,
    plan: Plan,
    concurrent_jobs: int | None = None,
    weight: int = 1,
    encoded: Encoded | None = None,
    reuse: Reuse | None = None,
) -> None:
    """Store a validated job and queue its segments (all or nothing); it is created now. ``weight``:
    its tenant's share of the engines (jobs/scheduler.py). ``reuse``: the segment cache to take
    already rendered segments from (they are recorded done at once, never queued). The queue's
    order is the store's ``longest_first_window`` (``encoded`` was made with the same)."""
    if concurrent_jobs is not None:
        await reserve_slot(store, job, concurrent_jobs)
    job.created_at = time.time()
    try:
        if reuse is not None and plan.cache_scope and (hits := await reuse.cache.lookup(plan.cache_scope, plan.cache_keys)):
            plan.reused = {i: [key, samples] for i, (key, samples) in hits.items()}
            job.segments_reused = len(hits)
            encoded = await asyncio.to_thread(encode, job, plan, store.longest_first_window)
        if encoded is None:
            await store.create(job, plan, tasks_for(job, plan, store.longest_first_window), weight)
        else:
            await store.create(job, encoded.plan, encoded.tasks, weight)
    except BaseException:
        await store.release_job_slot(job.tenant, job.id)
        raise
    if plan.reused:
        # the job is stored, so accepted (a 500 would undo its slot, cover and key): the sweep queues
        # a finalize whose mark landed and whose queueing did not; a lost mark leaves it finalizing
        try:
            await record_reused(store, job, plan, reuse.finalize)
        except Exception:
            log.exception("job %s: recording its reused segments or queueing its finalize failed", job.id)


@dataclass(frozen=True)
class Reuse:
    """Where a job's already rendered segments may come from (jobs/segcache.py)."""

    cache: SegmentCache
    #: Queues the finalize when every segment was already rendered.
    finalize: Callable[[str], Awaitable[None]]


async def record_reused(store: JobStore, job: Job, plan: Plan, finalize, only: set[int] | None = None) -> None:
    """The reused segments (``only`` those, if given) are done now: their 'segment' events go out like
    rendered ones'; the one that completes the job queues its finalize."""
    rate = MODELS[job.model].family.sample_rate
    for index, (_, samples) in sorted(plan.reused.items()):
        if only is not None and index not in only:
            continue
        result = await store.segment_done(job.id, index, 0, samples, samples / rate)
        if result.job_complete:
            await store.mark_finalizing(job.id)
            await finalize(job.id)


async def get(store: JobStore, job_id: str, principal: Principal | None = None) -> Job:
    """The job, or ``JobNotFound`` (also for a job ``principal`` may not see: another tenant's job
    is not forbidden, it does not exist for them)."""
    job = await store.get(job_id) if len(job_id) <= 64 else None
    if job is None or (principal is not None and not principal.may_see(job.tenant, job.id)):
        raise JobNotFound(f"no job {quoted(job_id)}")
    return job


async def place(store: JobStore, job: Job) -> tuple[int, int] | None:
    """(queued segments, segments ahead) of a job still waiting for engines; None once it is not."""
    if job.status.terminal:
        return None
    return await store.scheduler.place(job.model, job.shard, job.id, job.tenant, job.priority)


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    #: Where the next page starts (None: this is the last).
    next_cursor: str | None


async def list_jobs(
    store: JobStore,
    principal: Principal,
    *,
    status: JobStatus | None = None,
    tenant: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> JobPage:
    """The principal's jobs (an admin's: every tenant's, or ``tenant``'s), newest first, ``limit``
    at a time; ``status`` filters (a page may then come short of ``limit``: follow the cursor)."""
    if tenant is not None and not principal.admin and tenant != principal.tenant:
        return JobPage([], None)
    index = store.names.tenant_jobs(tenant or principal.tenant)
    if principal.admin and tenant is None:
        index = store.names.jobs_index()
    after = _parse_cursor(cursor)
    jobs: list[Job] = []
    scanned = 0
    while len(jobs) < limit and scanned < 20 * limit:
        ids = await store.page(index, after, limit)
        if not ids:
            return JobPage(jobs, None)
        scanned += len(ids)
        found = await store.get_many([job_id for job_id, _ in ids])
        for entry, job in zip(ids, found, strict=True):
            after = entry
            if job is not None and (status is None or job.status == status):
                jobs.append(job)
                if len(jobs) == limit:
                    break  # full: the next page starts right after this job, not after the rest of this batch
        if len(ids) < limit and after == ids[-1]:
            return JobPage(jobs, None)  # the index has nothing after this batch
    return JobPage(jobs, f"{after[1]!r}:{after[0]}")


def _parse_cursor(cursor: str | None) -> tuple[str, float] | None:
    if cursor is None:
        return None
    score, _, job_id = cursor.partition(":")
    try:
        value = float(score)
        if not math.isfinite(value):  # float() takes nan and inf: no job was made then (Redis refuses nan)
            raise ValueError(score)
    except ValueError:
        raise InvalidRequest(
            f"cursor {quoted(cursor)} is not a cursor of this API (use next_cursor)"
        ) from None
    return job_id, value


async def delete(store: JobStore, storage: Storage, settings: Settings, job: Job, rq_connection=None) -> bool:
    """Release everything a job holds: a job still going is cancelled first (from then on every worker
    drops its work, and a worker caught mid-write removes what it wrote), then its objects leave
    storage, RQ forgets its finalize, and its keys leave Redis. Storage goes before the keys, so a
    failure part-way leaves the job visible and the DELETE can be repeated. Returns whether it cancelled.
    ``rq_connection``: RQ's Redis client (a sync one; default: a new client for the settings' Redis).
    """
    cancelled = await store.cancel(job.id)
    await asyncio.to_thread(delete_outputs, storage, job.objects)
    await asyncio.to_thread(forget_finalize, settings, job.id, rq_connection)
    await store.purge(job)
    return cancelled
