"""``narrate``: every process of the fleet is a subcommand.

narrate file book.md -o book.wav     narrate a text file on embedded defaults (no Redis/S3/GPU needed)
narrate fleet                        API + all workers as child processes (embedded Valkey if no REDIS_URL)
narrate api | ar-worker | decoder-worker | speech-worker | assembler | finalize-worker
                                     one stage alone, against the Redis in REDIS_URL
narrate models                       the models and voices this fleet serves
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from fleet.settings import Settings
from jobs.audio import FORMATS

log = logging.getLogger("narrate")


def _settings_with_redis(settings: Settings, stack: ExitStack) -> Settings:
    """The settings, with an embedded Valkey started (and stopped with ``stack``) if REDIS_URL is unset."""
    if settings.redis_url:
        return settings
    from narrate.embedded import EmbeddedValkey

    url = stack.enter_context(EmbeddedValkey(settings.data_dir))
    return settings.model_copy(update={"redis_url": url})


# --- single stages -------------------------------------------------------------------------------


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from api.app import create_app

    uvicorn.run(
        create_app(settings),
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        log_level="info",
    )
    return 0


def cmd_ar_worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.ar import run_ar_worker
    from workers.runtime import run_worker

    model = args.model or settings.model_names[0]
    return run_worker(settings, lambda ctx: run_ar_worker(ctx, model))


def cmd_decoder_worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.decoder import run_decoder_worker
    from workers.runtime import run_worker

    models = [m for m in (args.models or settings.models).split(",") if m]
    return run_worker(settings, lambda ctx: run_decoder_worker(ctx, models))


def cmd_speech_worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.runtime import run_worker
    from workers.speech import run_speech_worker

    models = [m for m in (args.models or settings.models).split(",") if m]
    return run_worker(settings, lambda ctx: run_speech_worker(ctx, models))


def cmd_assembler(args: argparse.Namespace, settings: Settings) -> int:
    from workers.assembler import run_assembler
    from workers.runtime import run_worker

    return run_worker(settings, run_assembler)


def cmd_finalize_worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.finalizer import run_finalize_worker

    return run_finalize_worker(settings, burst=args.burst)


def cmd_models(args: argparse.Namespace, settings: Settings) -> int:
    from models.registry import served_models

    for spec in served_models(settings).values():
        default = " (default)" if spec.name == settings.default_model else ""
        print(f"{spec.name}{default}: {spec.description}")
        print(f"  voices: {', '.join(spec.family.voices)}; {spec.family.sample_rate} Hz")
        if spec.single_stage:
            f = spec.family
            print(f"  variants (<voice>+<variant>): {', '.join(f.variants)}")
            print(f"  rate {f.rate_range[0]}-{f.rate_range[1]} wpm (default {f.default_rate}); pitch "
                  f"{f.pitch_range[0]}-{f.pitch_range[1]} (default {f.default_pitch})")  # fmt: skip
    return 0


# --- the whole fleet -----------------------------------------------------------------------------


def cmd_fleet(args: argparse.Namespace, settings: Settings) -> int:
    from narrate.supervisor import Supervisor, child_env, fleet_children

    with ExitStack() as stack:
        settings = _settings_with_redis(settings, stack)
        children = fleet_children(
            api=not args.no_api,
            ar_workers=args.ar_workers,
            decoders=args.decoders,
            assemblers=args.assemblers,
            finalizers=args.finalizers,
            models=list(settings.model_names),
            api_port=args.port,
            speech_workers=args.speech_workers or settings.speech_worker_count,
        )
        supervisor = Supervisor(children, child_env(settings))
        stack.callback(supervisor.stop)
        supervisor.start()
        log.info("fleet running (Redis %s); Ctrl-C stops it", settings.redis_url)
        try:
            while True:
                time.sleep(0.5)
                supervisor.poll()
        except KeyboardInterrupt:
            log.info("stopping the fleet")
    return 0


def cmd_file(args: argparse.Namespace, settings: Settings) -> int:
    """Narrate one text file into one audio file through the same streams and workers as the fleet."""
    from jobs.errors import InvalidRequest
    from jobs.service import JobRequest
    from narrate.supervisor import Supervisor, child_env, fleet_children

    settings = _embedded_model(args, settings)
    text = Path(args.input).read_text(encoding="utf-8")
    output = Path(args.output or Path(args.input).with_suffix(f".{args.format}"))
    request = JobRequest(
        text=text,
        title=args.title or Path(args.input).stem,
        voice=args.voice,
        model=args.model,
        format=args.format,
        sample_rate=args.sample_rate,
        seed=args.seed,
        markdown=not args.plain,
    )
    with ExitStack() as stack:
        settings = _settings_with_redis(settings, stack)
        children = fleet_children(
            api=False,
            ar_workers=1,
            decoders=1,
            assemblers=1,
            finalizers=1,
            models=[settings.default_model],
            speech_workers=settings.speech_worker_count,
        )
        supervisor = Supervisor(children, child_env(settings), log_dir=settings.data_dir / "logs")
        stack.callback(supervisor.stop)
        supervisor.start()
        try:
            return asyncio.run(_narrate_file(settings, request, output, supervisor))
        except InvalidRequest as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2


def _embedded_model(args: argparse.Namespace, settings: Settings) -> Settings:
    """The model ``narrate file`` uses: --model, else NARRATE_DEFAULT_MODEL, else the eSpeak NG voice
    when the espeak extra is installed, else ``tiny`` (noise) with a warning. NARRATE_MODELS, when
    not set, becomes that one model."""
    from models.espeak import unavailable_reason

    model = args.model
    if model is None and "default_model" in settings.model_fields_set:
        model = settings.default_model
    if model is None:
        if (reason := unavailable_reason()) is None:
            model = "espeak"
        else:
            model = "tiny"
            print(
                f"narrate: warning: {reason}\n"
                "narrate: narrating with the 'tiny' test model instead: its audio is noise, not speech",
                file=sys.stderr,
            )
    models = settings.models if "models" in settings.model_fields_set else model
    return settings.model_copy(update={"default_model": model, "models": models})


async def _narrate_file(settings: Settings, request, output: Path, supervisor) -> int:
    from tqdm import tqdm

    from fleet.redis import async_client
    from fleet.storage import storage_from_settings
    from jobs.model import EventType
    from jobs.service import submit
    from jobs.store import JobStore

    redis = async_client(settings)
    store = JobStore.for_settings(redis, settings)
    try:
        job = await submit(store, settings, request)
        bar = tqdm(total=job.segments_total, unit="seg", desc=output.name, dynamic_ncols=True)
        after = "0-0"
        while True:
            supervisor.poll()
            if broken := supervisor.crash_looping():
                bar.close()
                logs = settings.data_dir / "logs"
                print(f"narrate: {', '.join(broken)} keep(s) failing; see {logs}/<name>.log", file=sys.stderr)
                return 1
            for event in await store.read_events(job.id, after, block_ms=500):
                after = event.id
                if event.type == EventType.SEGMENT:
                    bar.update(1)
                elif event.type == EventType.PROGRESS:
                    bar.set_postfix(audio=f"{event.data['audio_seconds']:.0f}s")
                elif event.type == EventType.DONE:
                    bar.close()
                    done = await store.get(job.id)
                    output.parent.mkdir(parents=True, exist_ok=True)
                    await asyncio.to_thread(storage_from_settings(settings).download, done.audio_key, output)
                    print(
                        f"{output}: {done.duration_s:.1f} s of audio, {done.segments_total} segments, {done.chapters} chapters"
                    )
                    return 0
                elif event.type.terminal:
                    bar.close()
                    print(f"narrate: job {event.type.value}: {event.data.get('error', '')}", file=sys.stderr)
                    return 1
    finally:
        await redis.aclose()


# --- parsing -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("file", help="narrate a text file into an audio file (embedded defaults)")
    p.add_argument("input", help="a UTF-8 text or Markdown file")
    p.add_argument(
        "-o", "--output", help="audio file to write (default: the input's name with the format's suffix)"
    )
    p.add_argument("--title")
    p.add_argument("--model")
    p.add_argument("--voice")
    p.add_argument("--format", default="wav", choices=list(FORMATS))
    p.add_argument("--sample-rate", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="the input is plain text, not Markdown")
    p.set_defaults(func=cmd_file)

    p = sub.add_parser("fleet", help="run the API and every worker as child processes")
    p.add_argument("--no-api", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--ar-workers", type=int, default=1, help="AR workers per model")
    p.add_argument("--decoders", type=int, default=1)
    p.add_argument("--assemblers", type=int, default=1)
    p.add_argument("--finalizers", type=int, default=1)
    p.add_argument(
        "--speech-workers",
        type=int,
        help="speech workers (default: NARRATE_SPEECH_WORKERS or half the cores)",
    )
    p.set_defaults(func=cmd_fleet)

    p = sub.add_parser("api", help="the HTTP API")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("ar-worker", help="stage 0: an AR (codec LM) worker for one model")
    p.add_argument("--model")
    p.set_defaults(func=cmd_ar_worker)

    p = sub.add_parser("decoder-worker", help="stage 1: a codec decoder worker")
    p.add_argument("--models", help="comma separated (default: NARRATE_MODELS)")
    p.set_defaults(func=cmd_decoder_worker)

    p = sub.add_parser("speech-worker", help="single-stage models (eSpeak NG): text to delta audio")
    p.add_argument("--models", help="comma separated (default: NARRATE_MODELS)")
    p.set_defaults(func=cmd_speech_worker)

    p = sub.add_parser("assembler", help="assembles segments, publishes progress, queues finalize")
    p.set_defaults(func=cmd_assembler)

    p = sub.add_parser("finalize-worker", help="RQ worker running finalize jobs (stitch, encode, upload)")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.set_defaults(func=cmd_finalize_worker)

    p = sub.add_parser("models", help="list the models and voices this fleet serves")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    return args.func(args, Settings())


if __name__ == "__main__":
    sys.exit(main())
