"""Every knob of the fleet, in one place.

Values come from the environment (prefix ``NARRATE_``; ``REDIS_URL`` and the usual ``AWS_*`` variables
without it), each with a default that works on a laptop. Worker processes started by the fleet
inherit the parent's environment, so one ``Settings`` describes the whole process tree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "narrate"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of them where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="NARRATE_", extra="ignore", frozen=True, populate_by_name=True
    )

    # --- connections -------------------------------------------------------------------------
    #: Redis/Valkey URL. Unset: the fleet commands start a private Valkey in ``data_dir``.
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("REDIS_URL", "NARRATE_REDIS_URL")
    )
    #: Connections per process (callers wait for a free one beyond this).
    redis_max_connections: int = 64
    #: Prefix of every key and stream name; lets several fleets (or test runs) share one Redis.
    key_prefix: str = "narr"
    #: Local state: embedded Valkey's data, built tiny checkpoints, local storage.
    data_dir: Path = Field(default_factory=_default_data_dir)

    # --- storage -----------------------------------------------------------------------------
    #: S3 bucket for results; unset means local disk under ``data_dir/storage``.
    s3_bucket: str | None = None
    s3_endpoint_url: str | None = None
    s3_prefix: str = ""
    s3_region: str | None = None
    #: Lifetime of presigned download URLs, seconds.
    presign_ttl_s: int = 3600
    #: Files at least this large are uploaded in parts (bytes).
    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunksize: int = 16 * 1024 * 1024

    # --- input limits and segmentation -------------------------------------------------------
    max_text_chars: int = 2_000_000
    #: The largest request body the API reads, bytes; 0: what a text of max_text_chars or an uploaded
    #: file of max_upload_bytes (base64 in JSON) can need.
    max_body_bytes: int = Field(default=0, ge=0)
    #: A job's cover picture (PNG or JPEG), bytes.
    max_cover_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    #: An uploaded book (EPUB, .txt, .md), bytes; what an EPUB may unpack to (jobs/epub.py: zip bombs).
    max_upload_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    epub_max_files: int = Field(default=10_000, gt=0)
    epub_max_unpacked_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    epub_max_ratio: int = Field(default=200, gt=1)
    #: Sentences longer than this are split at clause boundaries (characters).
    max_segment_chars: int = 300

    # --- models and engines ------------------------------------------------------------------
    default_model: str = "tiny"
    #: Models this fleet serves (comma separated); AR/decoder workers load these.
    models: str = "tiny"
    #: AR engine: "reference" (plain PyTorch) or "vllm".
    engine: str = "reference"
    #: Sequences decoded together by one AR engine, and the longest one (prompt + codes), in tokens.
    max_num_seqs: int = 32
    max_model_len: int = 4096
    #: Torch intra-op threads per worker process (0 = torch's default).
    torch_threads: int = 1
    #: Device for the reference engine and decoders ("cpu", "cuda").
    device: str = "cpu"
    #: vLLM engine: weights dtype, GPU memory share, weight loading ("dummy": random
    #: weights of the checkpoint's shape, for benchmarks), eager mode (no CUDA graphs / compile).
    vllm_dtype: str = "auto"
    vllm_gpu_memory_utilization: float = 0.85
    #: GiB of KV cache per engine, given instead of measured (vLLM's ``kv_cache_memory_bytes``): the
    #: engine skips its memory profile, which another process allocating beside it would upset, so
    #: the engines of one GPU start together instead of one at a time (no engine-start lock).
    #: ``vllm_gpu_memory_utilization`` is then only vLLM's check of free memory at start. Unset: each
    #: engine profiles, under the lock. H200, 2 engines at 0.37: ~43 is what the profile leaves.
    vllm_kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    vllm_load_format: str = "auto"
    vllm_enforce_eager: bool = False
    #: Opt-in weight quantization: "fp8" is vLLM's dynamic FP8 of the bf16 checkpoint (per-tensor
    #: scales computed at load; Hopper-class GPUs). Never the default: its audio has not been judged
    #: on real weights, and the bench labels its figures apart (docs/benchmarks.md).
    vllm_quantization: Literal["fp8"] | None = None
    #: KV cache dtype: "auto" (the weights') or "fp8" (half the cache memory per token). Opt-in too.
    vllm_kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    #: Logits for the codec's codes and stop ids only (models/engines/vllm_codes_only.py): the LM
    #: head multiplies by ~28.7k of Orpheus' 156,940 embedding rows each step. The engine then takes
    #: frame-constrained requests only (every AR request is one). Unset: on for Llama checkpoints
    #: (the class it stands in for), off for others; true: required; false: the full head. The same
    #: codes token for token (tests), 1.18x the tokens/s offline on an H100 (docs/benchmarks.md).
    vllm_codes_only_logits: bool | None = None
    #: Tokens vLLM accumulates per request before streaming them out: one Orpheus frame (7) cuts the
    #: per-token Python work of the AR worker sevenfold and delays a chunk by at most 6 tokens.
    vllm_stream_interval: int = 7
    #: Seconds between vLLM's own statistics log lines; 0 (default): vLLM collects no statistics,
    #: which its CPU-bound engine core needs on a GPU (the AR worker logs its own throughput line).
    vllm_log_stats_s: float = 0.0
    #: Local checkpoint directory of the "orpheus" model (LM + tokenizer; codec under snac/).
    orpheus_dir: Path | None = None
    #: Speech worker processes (single-stage models such as espeak; one engine, one segment at a
    #: time each) that the fleet commands start; 0: one per core when Piper is served (one onnxruntime
    #: thread each), else half the CPU cores, 1 to 4 (``speech_worker_count``).
    speech_workers: int = 0
    #: A speech worker publishes an AudioChunk per this much audio (its first as soon as eSpeak NG
    #: hands over its first piece, for a fast first audio), milliseconds.
    speech_chunk_ms: int = 1000
    #: Piper voices (models/piper.py) from a directory of ``<voice>.onnx`` + ``<voice>.onnx.json``,
    #: beside those of installed voice packages; a broken or missing ``.onnx.json`` is a start-up error.
    piper_voices_dir: Path | None = None
    #: Piper's noise (its VITS sampling noise, and the noise of phoneme lengths) for every voice;
    #: unset: each voice's own, from its ``.onnx.json`` (0.667 and 0.8 for most).
    piper_noise_scale: float | None = Field(default=None, ge=0, le=2)
    piper_noise_w: float | None = Field(default=None, ge=0, le=2)
    #: onnxruntime threads per speech worker; 0: the CPU cores shared out among the speech workers
    #: (N processes x threads = the cores: no oversubscription).
    piper_threads: int = Field(default=0, ge=0)

    # --- GPUs -----------------------------------------------------------------------------------
    #: GPUs of this host that ``narrate fleet`` places AR workers and decoders on, comma separated as
    #: CUDA_VISIBLE_DEVICES names them ("0,1", or GPU UUIDs): each such child gets
    #: ``CUDA_VISIBLE_DEVICES=<its GPU>`` (it sees that GPU alone, as ``cuda``), and ``--ar-workers``
    #: counts per GPU (narrate/supervisor.py ``fleet_children``). Empty (default): no pinning, every
    #: child sees the GPUs the fleet command sees.
    gpus: str = Field(default="", pattern=r"^[\sA-Za-z0-9_.:,-]*$")
    #: With ``gpus``: where ``narrate fleet`` puts its decoders: "each" (``--decoders`` on every GPU,
    #: beside its engines), "first" (all on the first GPU of ``gpus``) or one GPU of ``gpus``. Which is
    #: faster depends on the GPUs and the model (docs/architecture.md "Several GPUs and hosts").
    decoder_placement: str = "each"
    #: The fleet command runs a private CUDA MPS daemon and makes its GPU children its clients, so
    #: the processes sharing a GPU (several AR engines, a decoder) run their kernels side by side
    #: instead of taking turns (narrate/mps.py). Needs NVIDIA's nvidia-cuda-mps-control.
    cuda_mps: bool = False

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """``gpus`` as a tuple, in order (empty: no pinning)."""
        return tuple(g.strip() for g in self.gpus.split(",") if g.strip())

    # --- streaming (I1) ------------------------------------------------------------------------
    #: Frames of new audio per code chunk.
    chunk_frames: int = 25
    #: Frames in the first chunk of a job's first segment: small, for a fast first audio (1 Orpheus
    #: frame = 85 ms of audio, 7 tokens + 21 of look-ahead: under a full GPU's ~22 ms steps the
    #: first audio waits for 28 steps, not 42 as with 3); its later chunks double up to chunk_frames.
    #: Other segments start at chunk_frames (they are ready before they are played).
    first_chunk_frames: int = Field(default=1, ge=1)
    #: Frames of left context sent with every chunk (>= the decoder's receptive field); unset: the
    #: model family's measured value (SNAC 24 kHz: 4; the 16 kHz single-codebook codec: 10).
    left_context_frames: int | None = None
    #: Frames of look-ahead held back until known (the decoder's right receptive field); unset: the
    #: family's (SNAC 24 kHz: 3; the 16 kHz single-codebook codec: 10).
    lookahead_frames: int | None = None
    #: Cut every window of a segment (but a job's first segment's ramp) to one length,
    #: left + chunk + look-ahead frames (models/streaming.py): a decoder decodes windows of one length
    #: in one batched pass, and a segment's first and final windows otherwise come in ~30 lengths.
    uniform_windows: bool = False

    # --- runaway segments (models/runaway.py) ----------------------------------------------------
    #: Retries, each with a new seed, of a segment that never stops, repeats or is near-silent; after
    #: the last one its audio is kept and the segment flagged (warning event, manifest, job counter).
    runaway_retries: int = 2

    # --- consumers -----------------------------------------------------------------------------
    #: XREADGROUP BLOCK timeout, milliseconds.
    block_ms: int = 1000
    #: A pending entry idle this long is reclaimed by another consumer (XAUTOCLAIM), ms.
    reclaim_idle_ms: int = 60_000
    #: Deliveries of a message before it is dead-lettered and its job failed (workers/errors.py).
    max_deliveries: int = Field(default=5, ge=1)
    #: A retryable failure comes back after this long, doubling with each delivery up to the
    #: maximum (with jitter: between half and all of it), ms.
    retry_backoff_ms: int = Field(default=1000, ge=0)
    retry_backoff_max_ms: int = Field(default=30_000, ge=0)
    #: Shards of each model's task stream, admission queues (jobs/scheduler.py) and code-chunk stream,
    #: and of the audio stream: each one hash tag, i.e. one Redis Cluster slot; a job's entries go to
    #: its shard, workers take from every shard.
    task_shards: int = Field(default=1, ge=1)
    #: Jobs of at most this many segments are "interactive" unless they say otherwise: their segments
    #: go before every batch job's.
    interactive_max_segments: int = Field(default=20, ge=0)
    #: Engine slots of each AR worker beyond max_num_seqs that only interactive segments take: a
    #: short job starts at once on an engine full of books (no wait for a slot, no admission group).
    interactive_slots: int = Field(default=4, ge=0)
    #: Admission policy (jobs/scheduler.py): "fair", or "fifo": every task straight into the stage
    #: stream at submission, in arrival order (the policy before fair scheduling; a baseline for
    #: bench/ that gives up fairness and O(1) cancels: workers skip an ended job's tasks).
    scheduling: Literal["fair", "fifo"] = "fair"
    #: A job's segments are queued in book order, except that within each run of this many after its
    #: first, the longest (by text) go first: the last ones an engine takes are short, so a job does
    #: not end on a few long segments decoding alone (its first stays first: the first audio is not
    #: delayed). The price: a segment waits at most for the rest of its run, so audio you listen to
    #: while it renders (issue 20) can stall up to that many segments. 0 or 1: book order.
    longest_first_window: int = Field(default=0, ge=0)
    #: Workers refresh their readiness entry this often; one silent for 3 heartbeats is dead (s).
    heartbeat_s: float = 5.0
    #: Code chunks decoded together by one decoder.
    decode_batch: int = 32
    #: A decoder holding fewer than decode_batch chunks waits this long once for more (none of a
    #: job's first segment: those go at once): bigger batches, fewer GPU launches and fewer switches
    #: between the decoder's and the AR engine's work on a shared GPU (the H200 runs measured 1.5
    #: chunks per batch without it). Unset: 150 ms on a GPU, 0 on the CPU (which decodes windows one
    #: at a time anyway).
    decode_linger_ms: int | None = None
    #: Decoders run the SNAC decoder under torch.compile (dynamic shapes; compiles on the first
    #: windows, tens of seconds). H200, bench/decoder_speed.py: 1.3x (8 windows) to 1.5x (64) the
    #: eager speed; in the fleet 600-960x real time while busy against 540-625x eager. Off by default
    #: (~35 s more start-up); docker-compose.yml switches it on beside two AR engines per GPU.
    decoder_compile: bool = False
    #: The decoder's weights and activations in bfloat16 instead of float32 (GPU decoders: the decoder
    #: shares the card with the AR engines and its GPU time is what the fleet spends beyond them).
    #: Not bit-identical to float32 (the int16 samples move by up to ~1e-2 of full scale on random
    #: weights); off by default.
    decoder_bf16: bool = False
    #: Past its first block the SNAC decoder runs on the frames a window keeps (and a margin wider
    #: than what the rest of it sees), not the whole window: the same samples to float rounding, for
    #: ~20 % less work on a steady window (models/snac_codec.py). Off: whole windows, to compare.
    decoder_cut_windows: bool = True
    #: What one GPU pass through the decoder's later blocks costs beyond its frames, in frames: a
    #: decoder groups cut windows into the passes of least frames + passes x this. ~1.6 ms a pass
    #: against ~20 us a frame on an H100 (compiled, bfloat16, bench/decoder_speed.py --windows, session
    #: 27; models/snac_codec.py PASS_COST_FRAMES, the codec's own default); 0 groups for the fewest
    #: frames, whatever the passes. A CPU decoder decodes one window a pass.
    decode_pass_cost_frames: float = Field(default=78.0, ge=0)
    #: Frames of codes one decoder forward pass takes at most: windows of equal length beyond it go
    #: in several passes. SNAC 24 kHz holds ~2.5 MiB of float32 activations per frame decoded
    #: (bench/decoder_speed.py --memory), so 2,048 frames (64 windows of 4 + 25 + 3) peak at ~5 GiB
    #: whatever ``decode_batch`` and ``task_shards`` let a decoder read at once.
    decode_max_frames: int = Field(default=2048, ge=1)
    #: GiB of GPU memory a decoder's PyTorch allocator may hold (unset: no limit). The allocator keeps
    #: freed blocks of every shape it has seen, and windows come in many batch sizes and lengths: the
    #: H200 and H100 fleets' decoders held 16-19 GiB for batches that need ~5, memory the AR engines'
    #: KV caches could use on an 80 GB card. With a limit it hands back old unused blocks once 80 % of
    #: the limit is in use (PyTorch's garbage_collection_threshold) and frees its cache rather than fail.
    #: Give it ~1.6x a pass's peak (8 GiB for the default 2,048 frames), or it reclaims at every pass.
    decoder_gpu_memory_gb: float | None = Field(default=None, gt=0)
    #: Back-pressure: AR workers start no new segment while the code-chunk or the audio stream holds
    #: more than this many entries in all its shards (decoders or assemblers behind), so Redis memory
    #: stays bounded whatever ``task_shards``.
    max_stream_backlog: int = 2000
    #: An AR worker with segments in flight starts new ones only once this many engine slots are free
    #: (or ``ar_admit_wait_ms`` after the first one freed): fewer engine steps then carry new prompts
    #: beside the decoding ones. 1: start each as soon as its slot frees (docker-compose.yml: 16).
    ar_admit_batch: int = Field(default=1, ge=1)
    ar_admit_wait_ms: int = Field(default=500, ge=0)

    # --- output --------------------------------------------------------------------------------
    sentence_pause_ms: int = 300
    paragraph_pause_ms: int = 700
    chapter_pause_ms: int = 1500
    #: After a scene break (a rule: ***, * * *, ---; an EPUB's <hr>).
    scene_pause_ms: int = 2000
    #: Rendered segments kept for reuse (jobs/segcache.py): per tenant, shared by all, or off.
    segment_cache: Literal["tenant", "shared", "off"] = "tenant"
    #: A kept segment is released this long after its last use, seconds (default 7 days).
    segment_cache_retention_s: int = Field(default=7 * 24 * 3600, gt=0)
    #: Job keys live this long after the job ends, seconds.
    result_ttl_s: int = 7 * 24 * 3600
    #: Progress events kept per job (capped stream).
    events_maxlen: int = 20_000
    #: RQ finalize job timeout, seconds.
    finalize_timeout_s: int = 3600
    #: RQ retries of a finalize that failed, and the waits before them (comma separated seconds;
    #: the last repeats); after the last one the job fails.
    finalize_retries: int = Field(default=3, ge=0)
    finalize_retry_intervals_s: str = "5,30,120"
    #: The sweep (jobs/sweep.py, run by assemblers) looks for stuck finalizes and expired jobs this often.
    sweep_interval_s: float = Field(default=30.0, gt=0)
    #: The sweep deletes a stream consumer that holds nothing and has not read for this long (a
    #: dead worker's name), seconds.
    consumer_forget_s: float = Field(default=3600.0, gt=0)

    # --- tenants, keys, limits (api/auth.py, jobs/tenants.py) ------------------------------------
    #: "auto": API keys are required once any exists (before that, requests without one act as the
    #: tenant "default", and the API refuses to listen beyond loopback); "required": always; "off":
    #: never (everyone is "default": say so explicitly to serve beyond loopback without keys).
    auth: Literal["auto", "required", "off"] = "auto"
    #: Secret that signs short-lived links (events and audio for browsers); unset: one made once and
    #: kept in Redis, shared by every API process.
    link_secret: str | None = None
    #: Lifetime of a signed link, seconds.
    link_ttl_s: int = Field(default=3600, gt=0)
    #: Per-tenant limits, unless the tenant has its own (narrate tenants set).
    tenant_concurrent_jobs: int = Field(default=20, gt=0)
    tenant_chars_per_day: int = Field(default=20_000_000, gt=0)
    tenant_requests_per_minute: int = Field(default=600, gt=0)

    # --- api -----------------------------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    #: SSE keep-alive ping interval, seconds.
    sse_ping_s: int = 15
    #: Live streams (jobs/live.py, api/broadcast.py): how often a listener waiting for audio looks
    #: again, seconds; how far a stream's encode runs ahead of its fastest listener, and how much of
    #: it is kept for listeners who join later, bytes.
    live_poll_s: float = Field(default=0.04, gt=0)
    live_ahead_bytes: int = Field(default=1 << 20, gt=0)
    live_buffer_bytes: int = Field(default=32 << 20, gt=0)
    #: POST /v1/audio/speech: the longest input (OpenAI's limit).
    speech_max_chars: int = Field(default=4096, gt=0)

    # --- metrics (docs/metrics.md) ----------------------------------------------------------------
    #: Port of a worker process's own Prometheus endpoint (``/metrics``: its counters, histograms and
    #: process metrics); 0: none. ``narrate fleet`` gives its worker children this port and the next
    #: ones, one each in order. The API serves ``/metrics`` on its own port whatever this says.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: Address the worker endpoints listen on (0.0.0.0 in containers, for Prometheus to reach them).
    metrics_host: str = "127.0.0.1"

    # --- Redis Cluster ---
    #: RQ's Redis (the finalize queue) when REDIS_URL names a cluster (``redis+cluster://``): RQ does
    #: not support Redis Cluster, so it needs a standalone server. Unset: the fleet's own Redis, which
    #: must then not be a cluster (fleet/redis.py refuses to start).
    rq_redis_url: str | None = None
    #: Replicas that must hold a job's keys before its creation is answered (Redis WAIT): 1 on a
    #: cluster whose primaries have replicas, and an accepted job survives its primary's failover
    #: (docs/reliability.md). 0: answered as soon as the primary has it.
    durable_replicas: int = Field(default=0, ge=0)
    #: How long a creation waits for them before it is refused (503, nothing kept), ms.
    durable_timeout_ms: int = Field(default=1000, ge=1)

    @property
    def engine_slots(self) -> int:
        """Sequences an AR engine holds: ``max_num_seqs`` batch slots and the ``interactive_slots``
        reserved beside them (a batch task already in the stream may take a reserved one)."""
        return self.max_num_seqs + self.interactive_slots

    def decode_linger_s(self) -> float:
        if self.decode_linger_ms is not None:
            return self.decode_linger_ms / 1000
        return 0.15 if self.device.startswith("cuda") else 0.0

    def to_env(self) -> dict[str, str]:
        """These settings as environment variables, for child processes."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            key = "REDIS_URL" if name == "redis_url" else f"NARRATE_{name.upper()}"
            env[key] = str(value)
        return env

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.models.split(",") if m.strip())

    @property
    def speech_worker_count(self) -> int:
        """``speech_workers``, else one per core when Piper is served (one onnxruntime thread each:
        2 workers x 1 thread made 16.2x real time on 2 cores, 1 x 2 threads 7.3x, docs/benchmarks.md),
        else half the cores, 1 to 4 (eSpeak NG is fast: the rest of the cores assemble and encode)."""
        if self.speech_workers > 0:
            return self.speech_workers
        cores = usable_cores()
        if "piper" in (self.default_model, *self.model_names):
            return max(1, min(16, cores))
        return max(1, min(4, cores // 2))

    @property
    def storage_dir(self) -> Path:
        return self.data_dir / "storage"

    @property
    def finalize_retry_intervals(self) -> list[int]:
        return [int(x) for x in self.finalize_retry_intervals_s.split(",") if x.strip()] or [0]

    @property
    def finalize_queue(self) -> str:
        return f"{self.key_prefix}-finalize"
