"""Prometheus metrics of one worker process, and the HTTP endpoint that serves them (docs/metrics.md).

Every worker process (AR, decoder, speech, assembler, finalize) counts what it did in the metrics
below, in prometheus-client's default registry, and serves them with the process's own ``process_*``
and ``python_*`` metrics at ``http://<metrics_host>:<metrics_port>/metrics`` (``serve``;
``metrics_port`` 0, the default: no endpoint). The fleet-wide state that lives in Redis (jobs by
state, stream depths, dead letters, live workers) is read at scrape time by the API's /metrics
(jobs/metrics.py), so it is right whichever process answers.

Why an endpoint per process and not prometheus-client's multiprocess mode (one registry in files
under PROMETHEUS_MULTIPROC_DIR, served by the API): the fleet's processes do not share a host or a
pid namespace. In docker-compose every worker is a container of its own and each is pid 1 there, so
their files would collide in a shared directory, and the API would serve only what its own host
runs. An endpoint per process is what Prometheus expects: one target per worker (its own ``up``,
``instance`` label and process metrics), found by DNS however far a service is scaled. Locally,
``narrate fleet`` gives each worker child its own port (``metrics_port`` + its index).

Hot loops stay cheap: nothing here talks to Redis; the stages observe times they already take and
counts they already have (an observation is a lock and an addition).
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from fleet.settings import Settings

log = logging.getLogger(__name__)

# ``*_created`` samples (a counter's creation time) only double the series of every counter here.
disable_created_metrics()

#: Seconds: from a few milliseconds (a decoder's batch, an assembler's chunk) to minutes (a long AR
#: segment on a busy engine, a book's finalize).
WORK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Seconds from a job's submission to its first audio (the ramp is built for well under a second).
FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
#: Chunks a decoder decodes together (``decode_batch``: 32 by default, 64 in docker-compose.yml).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

STAGE_WORK = Histogram(
    "narrate_stage_work_seconds",
    "Time a stage took for one unit of work that succeeded: a segment (ar: from its start to its final "
    "window published; speech), a batch of chunks (decoder), an audio chunk (assembler: a segment's "
    "last one includes writing the segment to storage), a finalize (finalize).",
    ["stage"],
    buckets=WORK_BUCKETS,
)
STAGE_WAIT = Histogram(
    "narrate_stage_wait_seconds",
    "Time an entry waited in a stage's stream, from being added (its id's time, Redis's clock) to this "
    "worker accepting it; first deliveries only. Tasks count from their admission (jobs/scheduler.py).",
    ["stage"],
    buckets=WORK_BUCKETS,
)
RETRIES = Counter(
    "narrate_retries_total",
    "Deliveries that failed and were released to be retried after a backoff (finalize: RQ retries).",
    ["stage"],
)
DEAD_LETTERS = Counter(
    "narrate_dead_letters_total",
    "Entries this process moved to the dead-letter stream (their jobs failed).",
    ["stage"],
)
RUNAWAYS = Counter(
    "narrate_runaways_total",
    "Runaway tries of a segment (models/runaway.py), by kind (never_stops, repeats, silence) and what "
    "was done: retry (with the next seed) or flag (kept after the last retry).",
    ["stage", "kind", "action"],
)
SEGMENTS = Counter(
    "narrate_segments_total",
    "Segments assembled and recorded (each segment of a job once; reused segments are not rendered "
    "and not counted).",
    ["model"],
)
AUDIO_SECONDS = Counter(
    "narrate_audio_seconds_total",
    "Seconds of audio in the segments assembled and recorded; its rate is the fleet's real-time factor.",
    ["model"],
)
AUDIO_PRODUCED = Counter(
    "narrate_audio_produced_seconds_total",
    "Seconds of audio a stage produced (decoder: decoded windows; speech: synthesized), attempts that "
    "were later abandoned included.",
    ["stage", "model"],
)
FIRST_AUDIO = Histogram(
    "narrate_time_to_first_audio_seconds",
    "From a job's creation to its first audio (segment 0, chunk 0) being stored by an assembler, where "
    "a listener can play it; once per job (jobs whose first segment is rendered).",
    ["model"],
    buckets=FIRST_AUDIO_BUCKETS,
)
SLOTS_IN_USE = Gauge(
    "narrate_engine_slots_in_use",
    "Segments this worker's engine is working on now.",
    ["stage", "model"],
)
SLOTS = Gauge(
    "narrate_engine_slots",
    "Segments this worker's engine can work on at once (ar: max_num_seqs, interactive slots included).",
    ["stage", "model"],
)
AR_FRAMES = Counter(
    "narrate_ar_frames_total",
    "Codec frames an AR worker generated and published (new frames of its windows).",
    ["model"],
)
DECODER_BATCH = Histogram(
    "narrate_decoder_batch_chunks",
    "Code chunks a decoder decoded as one batch.",
    buckets=BATCH_BUCKETS,
)
FINALIZES = Counter(
    "narrate_finalizes_total",
    "Finalize runs, by the job's state after the run: done, failed, retry (RQ runs it again), other.",
    ["outcome"],
)


def observe_wait(stage: str, entry_id: bytes, now_s: float) -> None:
    """Observe how long a stream entry waited, from its id (``<ms>-<seq>``: when Redis added it)."""
    try:
        added_s = int(entry_id.split(b"-", 1)[0]) / 1000
    except ValueError:
        return
    waited = now_s - added_s
    if -1.0 < waited < 0:  # the worker's clock a little behind Redis's
        waited = 0.0
    if 0 <= waited < 86_400:  # ids that are not times (in-memory transports) say nothing
        STAGE_WAIT.labels(stage).observe(waited)


def serve(settings: Settings, what: str) -> int | None:
    """Serve this process's metrics on ``metrics_host:metrics_port`` (nothing if the port is 0); the port,
    or None. A port that cannot be bound is logged, not fatal: the worker works on without metrics."""
    port = settings.metrics_port
    if not port:
        return None
    try:
        start_http_server(port, addr=settings.metrics_host, registry=REGISTRY)
    except OSError as exc:
        log.error(
            "%s: cannot serve metrics on %s:%d (%s); running without", what, settings.metrics_host, port, exc
        )
        return None
    log.info("%s: metrics on http://%s:%d/metrics", what, settings.metrics_host, port)
    return port
