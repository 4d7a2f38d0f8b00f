"""Load check of one API process on loopback (issue 16), with keys required:

1. ``--sse-clients`` (500) EventSource clients follow one job: does every client get every event?
2. ``--submitters`` (50) clients submit small jobs at once: submit latency p50/p95 with auth on
   (and 1 client, for the unloaded figure), the speech workers paused meanwhile.
3. The API's RSS before and after hostile bodies (a 300 MB chunked body, maximum-size texts).
4. /health latency while a maximum-size text (``--max-text-chars``) is submitted.

A fleet of its own: a private Valkey (embedded), the API, eSpeak NG speech workers, an assembler
and a finalizer, as ``narrate fleet`` runs them. Prints RESULT lines and writes ``--out`` (JSON).

    python bench/api_load.py --out bench/results/2026-12-01-api-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402

from narrate.embedded import EmbeddedValkey  # noqa: E402
from testing.fleetkit import espeak_settings, make_keys, start_fleet  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def sse_fanout(base: str, key: str, clients: int, sentences: int) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300, limits=limits) as c:
        text = " ".join(f"Sentence number {i} is here." for i in range(sentences))
        job = (await c.post("/v1/jobs", json={"text": text})).json()

        reconnects: list[str] = []

        async def follow() -> list[str]:
            """As an EventSource does: a dropped stream is resumed with Last-Event-ID (counted)."""
            ids: list[str] = []
            for _ in range(5):
                resume = {"Last-Event-ID": ids[-1]} if ids else {}
                try:
                    async with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=resume) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("id: "):
                                ids.append(line[4:])
                    return ids
                except httpx.TransportError as exc:
                    reconnects.append(repr(exc)[:200])
            raise RuntimeError(f"dropped 5 times: {reconnects[-1]}")

        started = time.monotonic()
        streams = await asyncio.gather(*(follow() for _ in range(clients)), return_exceptions=True)
        took = time.monotonic() - started
        reference = max((s for s in streams if isinstance(s, list)), key=len)
        complete = sum(1 for s in streams if isinstance(s, list) and s == reference)
        errors = [repr(s)[:200] for s in streams if isinstance(s, BaseException)]
        return {
            "clients": clients,
            "events_per_client": len(reference),
            "clients_with_every_event": complete,
            "errors": errors[:5],
            "error_count": len(errors),
            "reconnects": len(reconnects),
            "reconnect_reasons": reconnects[:5],
            "wall_s": round(took, 2),
        }


async def submit_latency(base: str, key: str, clients: int, per_client: int) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=clients + 10)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60, limits=limits) as c:

        async def one(i: int) -> None:
            for j in range(per_client):
                t = time.perf_counter()
                r = await c.post("/v1/jobs", json={"text": f"Client {i} job {j}. A second sentence."})
                latencies.append(time.perf_counter() - t)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(clients)))
        took = time.monotonic() - started
    return {
        "clients": clients,
        "submits": len(latencies),
        "statuses": statuses,
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * pct(latencies, 0.95), 1),
        "max_ms": round(1000 * max(latencies), 1),
        "submits_per_s": round(len(latencies) / took, 1),
    }


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, '{"text": "Job ' .. counter .. '. A second sentence."}')
end
done = function(summary, latency, requests)
  io.write(string.format("WRK %%d %%d %%.1f %%.1f %%.1f %%.1f\\n", summary.requests, summary.errors.status,
    latency:percentile(50) / 1000, latency:percentile(95) / 1000, latency:percentile(99) / 1000,
    summary.requests / (summary.duration / 1e6)))
end
"""


def submit_latency_wrk(base: str, key: str, clients: int, seconds: int) -> dict | None:
    """The same with wrk (a load generator in C, so the client's own CPU does not count)."""
    import shutil
    import subprocess

    if shutil.which("wrk") is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT % key)
    out = subprocess.run(
        ["wrk", "-t2", f"-c{clients}", f"-d{seconds}s", "-s", f.name, f"{base}/v1/jobs"],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("WRK "))
    requests, bad, p50, p95, p99, rate = line.split()[1:]
    return {
        "clients": clients,
        "submits": int(requests),
        "non_2xx": int(bad),
        "p50_ms": float(p50),
        "p95_ms": float(p95),
        "p99_ms": float(p99),
        "submits_per_s": float(rate),
    }


def hostile_rss(base: str, key: str, api_pid: int, max_chars: int) -> dict:
    process = psutil.Process(api_pid)
    before = process.memory_info().rss
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}

    def chunked():
        yield b'{"text": "'
        for _ in range(300):
            yield b"a" * (1024 * 1024)

    results = {}
    with httpx.Client(base_url=base, timeout=120) as c:
        try:
            results["300MB_chunked"] = c.post("/v1/jobs", content=chunked(), headers=headers).status_code
        except httpx.HTTPError as exc:
            results["300MB_chunked"] = f"closed by the server ({type(exc).__name__})"
        peak = process.memory_info().rss
        for i in range(3):
            text = "word " * (max_chars // 5 - 1)
            r = c.post("/v1/jobs", json={"text": text}, headers={"Authorization": f"Bearer {key}"})
            results[f"max_text_{i}"] = r.status_code
            if r.status_code == 202:
                c.delete(f"/v1/jobs/{r.json()['id']}", headers={"Authorization": f"Bearer {key}"})
    after = process.memory_info().rss
    return {
        "rss_before_mib": round(before / 2**20, 1),
        "rss_after_300MB_body_mib": round(peak / 2**20, 1),
        "rss_after_max_texts_mib": round(after / 2**20, 1),
        "answers": results,
    }


def health_during_submit(base: str, key: str, max_chars: int) -> dict:
    text = "word " * (max_chars // 5 - 1)
    latencies: list[float] = []
    done = threading.Event()

    def probe():
        with httpx.Client(base_url=base, timeout=30) as h:
            while not done.is_set():
                t = time.perf_counter()
                h.get("/health")
                latencies.append(time.perf_counter() - t)
                time.sleep(0.005)

    thread = threading.Thread(target=probe)
    thread.start()
    with httpx.Client(base_url=base, timeout=120, headers={"Authorization": f"Bearer {key}"}) as c:
        t = time.perf_counter()
        r = c.post("/v1/jobs", json={"text": text})
        took = time.perf_counter() - t
        done.set()
        thread.join()
        if r.status_code == 202:
            c.delete(f"/v1/jobs/{r.json()['id']}")
    return {
        "text_chars": len(text),
        "submit_ms": round(1000 * took, 1),
        "status": r.status_code,
        "health_probes": len(latencies),
        "health_p50_ms": round(1000 * statistics.median(latencies), 1),
        "health_max_ms": round(1000 * max(latencies), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sse-clients", type=int, default=500)
    parser.add_argument("--sentences", type=int, default=40, help="segments of the job the SSE clients follow")
    parser.add_argument("--submitters", type=int, default=50)
    parser.add_argument("--submits-each", type=int, default=10)
    parser.add_argument("--max-text-chars", type=int, default=2_000_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = Path(tempfile.mkdtemp(prefix="narrate-api-load-"))
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    prefix = "apiload"
    settings = espeak_settings(url, prefix, data, max_text_chars=args.max_text_chars)
    big = 10**9
    limits = {"admin": True, "concurrent_jobs": 100_000, "chars_per_day": big, "requests_per_minute": 10**7}
    key = make_keys(url, prefix, {"bench": limits})["bench"]
    fleet = start_fleet(settings, data / "logs", speech_workers=1)
    report: dict = {"cpu": psutil.cpu_count(), "load_before": psutil.getloadavg()}
    try:
        api = next(c for c in fleet.supervisor.children if c.name == "api")
        report["hostile_rss"] = hostile_rss(fleet.base_url, key, api.process.pid, args.max_text_chars)
        print("RESULT hostile_rss", json.dumps(report["hostile_rss"]), flush=True)
        report["health_during_max_submit"] = health_during_submit(fleet.base_url, key, args.max_text_chars)
        print("RESULT health_during_max_submit", json.dumps(report["health_during_max_submit"]), flush=True)
        report["sse_fanout"] = asyncio.run(sse_fanout(fleet.base_url, key, args.sse_clients, args.sentences))
        print("RESULT sse_fanout", json.dumps(report["sse_fanout"]), flush=True)
        # the API alone: the speech workers would narrate every submitted job on the same cores
        speech = [c.process for c in fleet.supervisor.children if c.name.startswith("speech-")]
        for proc in speech:
            proc.send_signal(signal.SIGSTOP)
        try:
            for clients in (1, args.submitters):
                report[f"submit_latency_{clients}"] = result = asyncio.run(
                    submit_latency(fleet.base_url, key, clients, args.submits_each)
                )
                print(f"RESULT submit_latency_{clients}_clients", json.dumps(result), flush=True)
            if (wrk := submit_latency_wrk(fleet.base_url, key, args.submitters, 10)) is not None:
                report["submit_latency_wrk"] = wrk
                print("RESULT submit_latency_wrk", json.dumps(wrk), flush=True)
        finally:
            for proc in speech:
                proc.send_signal(signal.SIGCONT)
        report["api_rss_end_mib"] = round(psutil.Process(api.process.pid).memory_info().rss / 2**20, 1)
    finally:
        fleet.stop()
        valkey.stop()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
