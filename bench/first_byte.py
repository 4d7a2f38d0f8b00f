"""Time from POST to the first audio byte at an HTTP client (issue 20): the live stream of a job
(POST /v1/jobs, then GET its links.stream) and OpenAI's POST /v1/audio/speech, on an idle fleet and
while books render (``--books`` of ``--book-sentences``, other tenants' work). Interleaved runs.

CPU (this file's main): an eSpeak NG fleet on a private Valkey, real processes, real HTTP.

    python bench/first_byte.py --out bench/results/2026-12-01-first-byte-cpu.json

The GPU (Orpheus-shaped engines on vLLM): bench/fleet_vs_vllm.py --first-byte-runs N uses the
measurements below (``stream_first_byte``, ``speech_first_byte``) on its own fleet.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402


def _first_byte(response: httpx.Response, t0: float) -> float:
    for piece in response.iter_raw():
        if piece:
            return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a byte")


def stream_first_byte(client: httpx.Client, body: dict) -> tuple[str, float]:
    """POST the job, GET its stream at once: seconds from the POST to the first audio byte."""
    t0 = time.perf_counter()
    r = client.post("/v1/jobs", json=body)
    r.raise_for_status()
    job = r.json()
    with client.stream("GET", job["links"]["stream"]) as response:
        response.raise_for_status()
        return job["id"], _first_byte(response, t0)


def speech_first_byte(client: httpx.Client, body: dict) -> float:
    """POST /v1/audio/speech: seconds to the first byte of the response's audio (the request's job
    is deleted when the client leaves)."""
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        return _first_byte(response, t0)


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"n": len(values), "p50_ms": round(statistics.median(values) * 1000, 1), "p95_ms": round(p95 * 1000, 1),
            "max_ms": round(max(values) * 1000, 1), "all_ms": [round(v * 1000, 1) for v in values]}  # fmt: skip


def measure(client: httpx.Client, model: str, voice: str, runs: int, tag: str, settle_s: float = 0.5) -> dict:
    """``runs`` of each, interleaved; a different sentence each time (no segment cache in the way).
    Each measured job is deleted after its first byte (a speech request's goes with its response)
    and the next starts ``settle_s`` later: runs do not queue behind each other's rendering, so on an
    otherwise idle fleet each one meets an idle fleet."""
    streams, speech = [], []
    for k in range(runs):
        text = f"Run {k} {tag}: the keeper lit the lamp, and the harbour went quiet."
        job_id, seconds = stream_first_byte(client, {"text": text, "model": model, "priority": "interactive"})
        streams.append(seconds)
        client.delete(f"/v1/jobs/{job_id}")
        time.sleep(settle_s)
        speech.append(speech_first_byte(client, {"model": model, "voice": voice, "input": text + " Again."}))
        time.sleep(settle_s)
    return {"stream": percentiles(streams), "speech": percentiles(speech)}


def book(seed: int, sentences: int) -> str:
    return " ".join(f"Book {seed}, sentence {i}, goes on for a while as sentences do." for i in range(sentences))


def main() -> int:
    from narrate.embedded import EmbeddedValkey
    from testing.fleetkit import espeak_settings, make_keys, start_fleet

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--books", type=int, default=4)
    parser.add_argument("--book-sentences", type=int, default=1500)
    parser.add_argument("--speech-workers", type=int, default=0, help="0: the fleet's default")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = Path(tempfile.mkdtemp(prefix="narrate-first-byte-"))
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    settings = espeak_settings(url, "fb", data, tenant_chars_per_day=10**9, tenant_concurrent_jobs=10**4)
    keys = make_keys(url, "fb", {name: {"requests_per_minute": 10**6} for name in ("listener", "library")})
    workers = args.speech_workers or settings.speech_worker_count
    fleet = start_fleet(settings, data / "logs", speech_workers=workers)
    report: dict = {"model": "espeak", "speech_workers": workers, "books": args.books, "book_sentences": args.book_sentences}
    try:
        listener = httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {keys['listener']}"}, timeout=120)
        library = httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {keys['library']}"}, timeout=120)
        (model,) = listener.get("/v1/models").json()
        measure(listener, "espeak", model["default_voice"], 2, "warm-up")
        report["idle"] = measure(listener, "espeak", model["default_voice"], args.runs, "idle")
        books = [library.post("/v1/jobs", json={"text": book(i, args.book_sentences)}).json()["id"] for i in range(args.books)]
        time.sleep(2)  # the books have the engines
        report["while_books_render"] = measure(listener, "espeak", model["default_voice"], args.runs, "loaded")
        states = [library.get(f"/v1/jobs/{b}").json() for b in books]
        report["books_still_rendering"] = sum(s["status"] in ("queued", "running") for s in states)
        for b in books:
            library.delete(f"/v1/jobs/{b}")
        print("RESULT first byte", json.dumps(report), flush=True)
    finally:
        fleet.stop()
        valkey.stop()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
