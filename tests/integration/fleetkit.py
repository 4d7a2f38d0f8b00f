"""Helpers for tests that run the real fleet: processes, HTTP, SSE, and an offline reference."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from fleet.settings import Settings
from fleet.supervisor import Supervisor, child_env, fleet_children, free_port

# A Markdown book: 3 chapters, 51 segments (3 headings, 48 sentences), abbreviations, quotes, ellipses.
BOOK = """# Chapter One: The Harbour

The harbour woke before the town did. Gulls argued over the nets while Mr. Hale counted crates. \
He had counted them for thirty years, e.g. every morning at 5 a.m. sharp. "Forty-two," he said. \
Nobody answered him... The fog did not care.

A boat came in late. Its hull was painted a tired blue. The skipper, Dr. Moreau, waved once. \
She had been away for 3.5 weeks. Her crew looked thin!

Why had she come back? Hale wondered. He put down his pencil. The gulls went quiet. \
Somewhere a bell rang twice.

# Chapter Two: The Letter

The letter arrived on Tuesday. It was sealed with green wax. Inside were two lines of ink. \
"Come to the lighthouse," it said. "Bring the key." Hale did not own a key.

He searched the shed anyway. Behind the paint tins he found a tin box. In the box lay a brass key. \
It was warm, as if someone had just held it. He shivered.

The walk took an hour. The path was steep; the wind was cold. Rain came and went. \
At the top, the door stood open.

# Chapter Three: The Light

Inside, the stairs wound upward. He climbed slowly, counting steps as he counted crates. \
At step ninety he stopped. Someone was singing above him.

It was Dr. Moreau. She stood by the great lens. "You found it," she said. He held out the key. \
She smiled and turned it in the lamp. Light poured across the water.

Far below, the town began to wake. The gulls fell silent. Hale sat down on the top step. \
For once, he did not count anything. The light turned. It kept turning all night. \
By morning, the fog had gone.
"""


@dataclass
class RunningFleet:
    settings: Settings
    base_url: str
    supervisor: Supervisor
    log_dir: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", 30), **kw)

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        self.supervisor.stop()


def start_fleet(
    settings: Settings,
    log_dir: Path,
    *,
    ar_workers=1,
    decoders=1,
    assemblers=1,
    finalizers=1,
    speech_workers=1,
) -> RunningFleet:
    port = free_port()
    children = fleet_children(
        api=True,
        ar_workers=ar_workers,
        decoders=decoders,
        assemblers=assemblers,
        finalizers=finalizers,
        models=list(settings.model_names),
        api_port=port,
        speech_workers=speech_workers,
    )
    supervisor = Supervisor(children, child_env(settings), log_dir=log_dir)
    supervisor.start()
    fleet = RunningFleet(settings, f"http://127.0.0.1:{port}", supervisor, log_dir)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{fleet.base_url}/health", timeout=2).status_code == 200:
                return fleet
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            fleet.stop()
            raise RuntimeError(f"the API did not come up\n{fleet.logs()}")
        time.sleep(0.2)


@dataclass
class SSE:
    id: str | None
    event: str
    data: str


@dataclass
class SSEStream:
    events: list[SSE] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


def read_sse(
    client: httpx.Client,
    url: str,
    *,
    last_event_id: str | None = None,
    stop_after: int | None = None,
    timeout: float = 300,
    record: SSEStream | None = None,
) -> Iterator[SSE]:
    """Yield the events of an SSE response (a minimal parser of the text/event-stream format)."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    record = record if record is not None else SSEStream()
    seen = 0
    with client.stream("GET", url, headers=headers, timeout=timeout) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line == "":
                if "data" in fields or "event" in fields:
                    event = SSE(fields.get("id"), fields.get("event", "message"), fields.get("data", ""))
                    record.events.append(event)
                    yield event
                    seen += 1
                    if stop_after is not None and seen >= stop_after:
                        return
                fields = {}
            elif line.startswith(":"):
                record.comments.append(line)
                assert not fields, "a comment inside an event"
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                fields[name] = fields[name] + "\n" + value if name == "data" and name in fields else value


def submit(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def wait_done(client: httpx.Client, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {job_id} did not finish")


def download(client: httpx.Client, job_id: str) -> tuple[np.ndarray, int]:
    response = client.get(f"/v1/jobs/{job_id}/audio", follow_redirects=True)
    assert response.status_code == 200, response.text
    audio, rate = sf.read(io.BytesIO(response.content), dtype="int16")
    return audio, rate


def offline_segment_audio(
    settings: Settings, texts: list[str], voice: str, job_seed: int = 0, model: str = "tiny", retry: int = 0
) -> list[np.ndarray]:
    """Each segment's audio computed here, without the fleet: whole-segment generation and one decode
    (of the segment's ``retry``-th runaway retry, whose seed derives from the segment's)."""
    from jobs.service import segment_seed
    from models.engines.reference import ReferenceEngine
    from models.registry import get_model, load_codec, load_tokenizer
    from models.snac_codec import to_pcm16
    from workers.ar import SegmentSynthesizer, StreamingConfig

    spec = get_model(model, settings)
    engine = ReferenceEngine(spec.checkpoint(settings), max_num_seqs=32)
    synth = SegmentSynthesizer(
        spec.family,
        load_tokenizer(spec, settings),
        engine,
        StreamingConfig.from_settings(settings, spec.family),
    )
    codec = load_codec(spec, settings)
    layout = spec.family.layout

    async def tokens(i: int, text: str) -> list[int]:
        from fleet.messages import SegmentTask

        task = SegmentTask("offline", i, text, model, voice, segment_seed(job_seed, voice, text), retry=retry)
        prompt = spec.family.build_prompt(synth.tokenizer, text, voice)
        out: list[int] = []
        async for delta in engine.generate(f"offline-{i}", prompt, synth.sampling_params(task)):
            out += delta.token_ids
        return out

    async def all_tokens():
        try:
            return await asyncio.gather(*(tokens(i, t) for i, t in enumerate(texts)))
        finally:
            await engine.shutdown()

    result = []
    for toks in asyncio.run(all_tokens()):
        toks = [t for t in toks if t not in layout.stop_token_ids]
        frames = layout.tokens_to_frames(toks[: len(toks) - len(toks) % layout.codes_per_frame])
        audio = codec.decode_frames(frames[None])[0] if len(frames) else np.zeros(0, np.float32)
        result.append(np.frombuffer(to_pcm16(audio), "<i2"))
    return result
