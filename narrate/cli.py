"""``narrate``: every process of the fleet is a subcommand.

narrate file book.md -o book.wav     narrate a text file on embedded defaults (no Redis/S3/GPU needed)
narrate fleet                        API + all workers as child processes (embedded Valkey if no REDIS_URL)
narrate api | ar-worker | decoder-worker | speech-worker | assembler | finalize-worker
                                     one stage alone, against the Redis in REDIS_URL
narrate models                       the models and voices, and which can run here
narrate keys create|list|revoke      API keys (tenants); narrate tenants list|set: their limits
narrate clean                        free the embedded data directory (jobs kept with --keep, logs)
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

from fleet.settings import Settings
from jobs.audio import FORMATS

log = logging.getLogger("narrate")


# --- single stages -------------------------------------------------------------------------------


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from api.app import create_app

    host = args.host or settings.api_host
    if problem := open_without_keys(host, settings):
        print(f"narrate: {problem}", file=sys.stderr)
        return 2
    # a request handler waits for the interpreter lock while a thread segments a book: hand it over
    # every millisecond instead of every 5 (the thread's throughput barely changes)
    sys.setswitchinterval(0.001)
    uvicorn.run(create_app(settings), host=host, port=args.port or settings.api_port, log_level="info")
    return 0


def open_without_keys(host: str, settings: Settings) -> str | None:
    """Why the API must not listen on ``host``: beyond loopback, with auth on and no key yet, anyone
    who can reach it would be served."""
    import ipaddress

    from fleet.names import Names
    from fleet.redis import sync_client

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or settings.auth != "auto":  # "required" refuses everyone without a key anyway
        return None
    with sync_client(settings) as client:
        names = Names(settings.key_prefix)
        if client.exists(names.api_keys(), names.api_keys_made()):
            return None
    return (
        f"refusing to serve {host} without API keys: make one with `narrate keys create --tenant NAME`, "
        "or set NARRATE_AUTH=off to serve everyone"
    )


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
    """Every model: what it is, its voices, and why it cannot run here if it cannot."""
    import textwrap

    from models.registry import MODELS

    chosen, _warning = file_model(None, settings)
    print(f"narrate file uses: {chosen} (choose with --model; NARRATE_MODELS for a fleet: {settings.models})")
    for spec in MODELS.values():
        problem = spec.problem(settings)
        state = f"unavailable: {problem}" if problem else "available"
        print(f"\n{spec.name}: {spec.description}\n  {state}")
        if problem:
            continue
        f = spec.family
        voices = ", ".join(f.voices)
        print(textwrap.fill(f"voices ({len(f.voices)}, default {f.default_voice}): {voices}", 100,
                            initial_indent="  ", subsequent_indent="    "))  # fmt: skip
        print(f"  {f.sample_rate} Hz")
        if spec.single_stage:
            if f.variants:
                print(textwrap.fill(f"variants (<voice>+<variant>): {', '.join(f.variants)}", 100,
                                    initial_indent="  ", subsequent_indent="    "))  # fmt: skip
            pitch = (f"pitch {f.pitch_range[0]}-{f.pitch_range[1]} (default {f.default_pitch})"
                     if f.has_pitch else "no pitch setting")  # fmt: skip
            print(f"  rate {f.rate_range[0]}-{f.rate_range[1]} words a minute (default {f.default_rate}); {pitch}")
    return 0


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    from narrate import admin

    if args.action == "create":
        return admin.run(settings, admin.keys_create(args.tenant, args.admin, args.label or ""))
    if args.action == "revoke":
        return admin.run(settings, admin.keys_revoke(args.id))
    return admin.run(settings, admin.keys_list())


def cmd_tenants(args: argparse.Namespace, settings: Settings) -> int:
    from narrate import admin

    if args.action == "set":
        limits = {k: v for k, v in vars(args).items() if k in LIMIT_OPTIONS and v is not None}
        return admin.run(settings, admin.tenants_set(args.name, limits))
    return admin.run(settings, admin.tenants_list(settings))


#: ``narrate tenants set`` options: jobs.tenants.Limits fields (0: the fleet's default).
LIMIT_OPTIONS = {
    "concurrent_jobs": "jobs not yet ended at once",
    "chars_per_day": "characters of text a day",
    "requests_per_minute": "API requests a minute",
    "max_text_chars": "characters in one job's text",
    "weight": "its share of the engines against other tenants",
}


def cmd_clean(args: argparse.Namespace, settings: Settings) -> int:
    from narrate.clean import run

    return run(settings, everything=args.all)


# --- the whole fleet -----------------------------------------------------------------------------


def cmd_fleet(args: argparse.Namespace, settings: Settings) -> int:
    """Every stage as a child process until SIGINT, SIGTERM or SIGHUP (a second one kills them)."""
    from models.registry import UnknownModelError, served_models
    from narrate import mps
    from narrate.embedded import DataDirBusy, fleet_redis
    from narrate.signals import StopSignals
    from narrate.supervisor import PlacementError, Supervisor, child_env

    try:
        served_models(settings)  # every model of NARRATE_MODELS can run here, or say why not now
        settings, children = fleet_plan(args, settings)  # placed on the GPUs before anything starts
    except (UnknownModelError, PlacementError) as exc:
        print(f"narrate: {exc}", file=sys.stderr)
        return 2
    if settings.gpu_ids and not settings.device.startswith("cuda"):
        log.warning("NARRATE_GPUS=%s with NARRATE_DEVICE=%s: pinned, but on the CPU", settings.gpus, settings.device)
    supervisor = None

    def kill_now() -> None:
        if supervisor is not None:
            supervisor.kill()

    with StopSignals(on_second=kill_now) as signals, ExitStack() as stack:
        try:
            settings, _ = fleet_redis(settings, stack)
            gpu_env = mps.start_for(settings, stack)  # the GPU children share it: quit after them
        except (DataDirBusy, mps.MpsError) as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2
        supervisor = Supervisor(children, {**child_env(settings), **gpu_env})
        stack.callback(supervisor.stop)
        supervisor.start()
        log.info("fleet running (Redis %s); Ctrl-C stops it", settings.redis_url)
        while not signals.event.wait(0.5):
            supervisor.poll()
        log.info("stopping the fleet (%s)", signal.Signals(signals.received).name)
    return 0


def fleet_plan(args: argparse.Namespace, settings: Settings):
    """``narrate fleet``'s settings (``--gpus`` and ``--decoder-placement`` over NARRATE_GPUS and
    NARRATE_DECODER_PLACEMENT) and its children, placed on the GPUs (narrate/supervisor.py);
    ``PlacementError`` if they cannot be."""
    from narrate.supervisor import PlacementError, fleet_children, fleet_gpu_options

    update = {}
    if args.gpus is not None:
        if not all(c.isalnum() or c in "-_.:, " for c in args.gpus):
            raise PlacementError(f"--gpus {args.gpus!r}: GPUs as CUDA_VISIBLE_DEVICES names them, e.g. 0,1")
        update["gpus"] = args.gpus
    if args.decoder_placement is not None:
        update["decoder_placement"] = args.decoder_placement
    settings = settings.model_copy(update=update) if update else settings
    children = fleet_children(
        api=not args.no_api,
        ar_workers=args.ar_workers,
        decoders=args.decoders,
        assemblers=args.assemblers,
        finalizers=args.finalizers,
        models=list(settings.model_names),
        api_port=args.port,
        speech_workers=args.speech_workers or settings.speech_worker_count,
        metrics_port=settings.metrics_port,  # a port each (docs/metrics.md)
        **fleet_gpu_options(settings),
    )
    return settings, children


#: What ``narrate file`` narrates with when neither --model nor NARRATE_DEFAULT_MODEL says: the first
#: of these that can run here (a neural voice, then formant speech), else ``tiny`` with a warning.
FILE_MODELS = ("piper", "espeak")


def file_model(model: str | None, settings: Settings) -> tuple[str, str | None]:
    """The model ``narrate file`` uses: ``model``, else NARRATE_DEFAULT_MODEL, else the best voice
    installed (Piper's neural voices, then eSpeak NG), else ``tiny`` (noise) with a warning. With
    NARRATE_PIPER_VOICES_DIR set (and Piper installed) it is Piper, whose start-up check then names
    a broken voice file rather than falling back to another voice."""
    from models.registry import MODELS

    if model is None and "default_model" in settings.model_fields_set:
        model = settings.default_model
    if model is not None:
        return model, None
    from models.piper import unavailable_reason as piper_missing

    if settings.piper_voices_dir is not None and piper_missing() is None:
        return "piper", None  # voices the user pointed at: a broken one is an error, not a fallback
    reasons = []
    for name in FILE_MODELS:
        if (reason := MODELS[name].problem(settings)) is None:
            return name, None
        reasons.append(f"narrate: warning: {reason}")
    return "tiny", (
        "\n".join(reasons) + "\n"
        "narrate: narrating with the 'tiny' test model instead: its audio is noise, not speech"
    )


def check_model(model: str, settings: Settings) -> None:
    """``InputError`` unless ``model`` can run here."""
    from models.registry import MODELS
    from narrate.file import InputError

    if model not in MODELS:
        raise InputError(f"unknown model {model!r}; known: {', '.join(MODELS)} (see `narrate models`)")
    if problem := MODELS[model].problem(settings):
        raise InputError(f"model {model!r} cannot run here: {problem}")


def reads_as_markdown(source: Path, args: argparse.Namespace) -> bool:
    """Markdown unless --plain, but a .txt file is plain text unless --markdown: as the API reads an
    uploaded .txt (a file sounds the same from both: "2*3*4" or "my_file" keep their characters)."""
    if args.plain or args.markdown:
        return args.markdown
    return source.suffix.lower() != ".txt"


def cmd_file(args: argparse.Namespace, settings: Settings) -> int:
    """Narrate one text file into one audio file; refuse what cannot work before anything starts."""
    from dataclasses import replace

    from jobs.errors import InvalidRequest
    from jobs.service import JobRequest, from_book, validate
    from narrate.file import (
        FileJob,
        InputError,
        is_book,
        output_and_format,
        parse_chapters,
        print_contents,
        read_book_file,
        read_cover_file,
        read_text_file,
        run,
        worker_children,
    )
    from narrate.supervisor import PlacementError

    source = Path(args.input)
    try:
        book = read_book_file(source, settings, alt_text=args.alt_text) if is_book(source) else None
        if args.list_chapters:
            return print_contents(source, book)
        text = read_text_file(source, settings.max_text_chars) if book is None else ""
        output, fmt = output_and_format(source, args.output, args.format)
        model, warning = file_model(args.model, settings)
        check_model(model, settings)
        # the model chosen is served, whatever NARRATE_MODELS (set for a fleet) lists
        served = settings.model_names if "models" in settings.model_fields_set else ()
        models = ",".join(dict.fromkeys([*served, model]))
        # the data directory keeps no copy of the book's audio unless --keep: then the segment cache too
        cache = settings.segment_cache if args.keep else "off"
        settings = settings.model_copy(update={"default_model": model, "models": models, "segment_cache": cache})
        request = JobRequest(
            text=text,
            title=args.title or source.stem,
            voice=args.voice,
            model=model,
            format=fmt,
            sample_rate=args.sample_rate,
            seed=args.seed,
            markdown=reads_as_markdown(source, args),
            rate=args.rate,
            pitch=args.pitch,
            bitrate_kbps=args.bitrate,
            author=args.author or "",
            narrator=args.narrator,
            year=args.year,
            language=args.language or "",
            normalize=args.normalize,
            loudness_lufs=args.loudness,
            true_peak_dbtp=args.true_peak,
            cover=read_cover_file(args.cover) if args.cover else None,
        )
        if book is not None:  # the book's title, author, language and cover unless given
            request = from_book(replace(request, title=args.title), book, parse_chapters(args.chapters))
            request = replace(request, title=request.title or source.stem)
        elif args.chapters:
            raise InputError(f"{source}: --chapters: only a book (an EPUB) has chapters to choose")
        job, plan = validate(request, settings)
        worker_children(settings)  # NARRATE_GPUS: placed as `narrate fleet` places them, or refused
    except (InputError, InvalidRequest, PlacementError) as exc:
        print(f"narrate: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr)
    return run(FileJob(job, plan, output, keep=args.keep, manifest=args.manifest, cover=request.cover), settings)


# --- parsing -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")

    p = sub.add_parser("file", help="narrate a text file into an audio file (embedded defaults)")
    p.add_argument(
        "input", help="an EPUB, or a UTF-8 text or Markdown file (Markdown headings start chapters)"
    )
    p.add_argument(
        "-o",
        "--output",
        help="the audio file to write; its extension picks the format (default: the input's name, .wav)",
    )
    p.add_argument(
        "--format", type=str.lower, choices=list(FORMATS), help="the output format, when the file name does not say it"
    )
    p.add_argument("--title", help="the book's title (default: an EPUB's own, else the input's file name)")
    p.add_argument(
        "--chapters",
        metavar="LIST",
        help="an EPUB's chapters to narrate: numbers and titles, comma-separated (see --list-chapters); "
        "default: all but the front and back matter",
    )
    p.add_argument("--list-chapters", action="store_true", help="list an EPUB's chapters and exit")
    p.add_argument("--alt-text", action="store_true", help="read an EPUB's image descriptions (alt text)")
    p.add_argument("--author", help="the book's author (the file's artist tag)")
    p.add_argument("--cover", metavar="PICTURE", help="a PNG or JPEG cover (m4b, m4a, mp3, opus)")
    p.add_argument("--narrator", help="the narrator tag (default: the voice's name)")
    p.add_argument("--year", type=int, help="the year tag")
    p.add_argument("--language", help="the language tag: ISO 639-2, three letters (e.g. eng)")
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="normalise the loudness (default: on for m4b/m4a/mp3/opus, off for wav/flac)",
    )
    p.add_argument("--loudness", type=float, default=-18.0, metavar="LUFS", help="the target (default -18)")
    p.add_argument("--true-peak", type=float, default=-3.0, metavar="DBTP", help="the ceiling (default -3)")
    p.add_argument(
        "--bitrate", type=int, metavar="KBPS", help="compressed formats: kb/s (default: m4b/m4a/mp3 64, opus 32)"
    )
    p.add_argument(
        "--model",
        help="the model to narrate with (default: piper if installed, else espeak; see `narrate models`)",
    )
    p.add_argument("--voice", help="a voice of the model (see `narrate models`)")
    p.add_argument(
        "--rate", type=int, help="speaking rate in words a minute (espeak: 80-450, default 175; piper: 100-350, 200)"
    )
    p.add_argument("--pitch", type=int, help="voice pitch (espeak: 0-100, default 50; piper has none)")
    p.add_argument("--sample-rate", type=int, help="output sample rate in Hz (default: the model's)")
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed of codec-LM models (same seed, same audio)"
    )
    markup = p.add_mutually_exclusive_group()
    markup.add_argument(
        "--plain", action="store_true", help="the input is plain text, not Markdown (the default for .txt files)"
    )
    markup.add_argument("--markdown", action="store_true", help="a .txt input is Markdown too")
    p.add_argument(
        "--manifest",
        action="store_true",
        help="also write the chapter and sentence times beside the file (.json)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the job, its files and its rendered sentences in the data directory (a rerun of an "
        "edited book renders only what changed; `narrate clean` frees them)",
    )
    p.set_defaults(func=cmd_file)

    p = sub.add_parser("fleet", help="run the API and every worker as child processes")
    p.add_argument("--no-api", action="store_true", help="workers only")
    p.add_argument("--port", type=int, help="the API's port (default: NARRATE_API_PORT, 8000)")
    p.add_argument(
        "--ar-workers", type=int, default=1, help="AR workers per two-stage model (with --gpus: on each GPU)"
    )
    p.add_argument(
        "--decoders",
        type=int,
        default=1,
        help="decoder workers, two-stage models (with --gpus: on each GPU of --decoder-placement)",
    )
    p.add_argument(
        "--gpus",
        metavar="LIST",
        help="GPUs to place AR workers and decoders on, as CUDA_VISIBLE_DEVICES names them, e.g. 0,1: "
        "each child pinned to one (default: NARRATE_GPUS; empty: no pinning)",
    )
    p.add_argument(
        "--decoder-placement",
        metavar="WHERE",
        help="with --gpus: 'each' GPU (default: NARRATE_DECODER_PLACEMENT, each), 'first', or a GPU of --gpus",
    )
    p.add_argument("--assemblers", type=int, default=1, help="assemblers")
    p.add_argument("--finalizers", type=int, default=1, help="finalize workers (RQ)")
    p.add_argument(
        "--speech-workers",
        type=int,
        help="speech workers for single-stage models (default: NARRATE_SPEECH_WORKERS, else one per core with piper, else half the cores)",
    )
    p.set_defaults(func=cmd_fleet)

    p = sub.add_parser("api", help="the HTTP API")
    p.add_argument("--host", help="address to listen on (default: NARRATE_API_HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: NARRATE_API_PORT, 8000)")
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("ar-worker", help="stage 0: an AR (codec LM) worker for one model")
    p.add_argument("--model", help="the model (default: the first of NARRATE_MODELS)")
    p.set_defaults(func=cmd_ar_worker)

    p = sub.add_parser("decoder-worker", help="stage 1: a codec decoder worker")
    p.add_argument("--models", help="comma separated (default: NARRATE_MODELS)")
    p.set_defaults(func=cmd_decoder_worker)

    p = sub.add_parser("speech-worker", help="single-stage models (eSpeak NG): text to delta audio")
    p.add_argument("--models", help="comma separated (default: NARRATE_MODELS)")
    p.set_defaults(func=cmd_speech_worker)

    p = sub.add_parser("assembler", help="assembles segments, publishes progress, queues finalize, sweeps")
    p.set_defaults(func=cmd_assembler)

    p = sub.add_parser("finalize-worker", help="RQ worker running finalize jobs (stitch, encode, upload)")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.set_defaults(func=cmd_finalize_worker)

    p = sub.add_parser("models", help="the models and voices, and which can run here")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("keys", help="API keys: create (shown once), list, revoke")
    keys = p.add_subparsers(dest="action", required=True, help="what to do with keys")
    k = keys.add_parser("create", help="a new key for a tenant (made if new); prints the key once")
    k.add_argument("--tenant", required=True, help="the tenant the key acts as (a-z, 0-9, - and _)")
    k.add_argument("--admin", action="store_true", help="an admin key: sees every tenant's jobs")
    k.add_argument("--label", help="a note kept with the key (who it is for)")
    keys.add_parser("list", help="every key's id, tenant, admin flag, creation time and label")
    k = keys.add_parser("revoke", help="delete a key: refused from the next request on")
    k.add_argument("id", help="the key's id (narrate keys list; at least 8 characters)")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("tenants", help="tenants and their limits")
    tenants = p.add_subparsers(dest="action", required=True, help="what to do with tenants")
    tenants.add_parser("list", help="every tenant with its limits")
    t = tenants.add_parser("set", help="set a tenant's limits (0: the fleet's default)")
    t.add_argument("name", help="the tenant")
    for option, meaning in LIMIT_OPTIONS.items():
        t.add_argument(f"--{option.replace('_', '-')}", dest=option, type=int, help=meaning)
    p.set_defaults(func=cmd_tenants)

    p = sub.add_parser("clean", help="free the embedded data directory and say how much")
    p.add_argument("--all", action="store_true", help="also the Valkey data and the built test models")
    p.set_defaults(func=cmd_clean)
    return parser


#: Commands that run one stage against a Redis they do not start.
STAGE_COMMANDS = {"api", "ar-worker", "decoder-worker", "speech-worker", "assembler", "finalize-worker"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    settings = Settings()
    if args.command in STAGE_COMMANDS and not settings.redis_url:
        from narrate.embedded import running_url

        if (url := running_url(settings.data_dir)) is None:  # else: join the data directory's fleet
            print(
                f"narrate: {args.command} needs a Redis: set REDIS_URL, or run `narrate fleet` (it starts one)",
                file=sys.stderr,
            )
            return 2
        settings = settings.model_copy(update={"redis_url": url})
        return args.func(args, settings)
    # the user's commands: one line, not a traceback (a stage keeps its traceback, for its log)
    from redis.exceptions import ConnectionError as RedisUnreachable

    try:
        return args.func(args, settings)
    except RedisUnreachable as exc:
        print(f"narrate: cannot reach Redis at {settings.redis_url}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before narrate file's own handlers are set (imports, reading a book)
        print("narrate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
