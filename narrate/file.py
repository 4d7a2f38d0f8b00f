"""``narrate file``: one text file in, one audio file out, through the same streams and workers as a
fleet, on embedded defaults (a private Valkey in the data directory, local storage).

The command owns its job and its process tree:

1. everything that can be refused is refused before anything starts (the file, the output's format,
   the request itself): one line on stderr, exit code 2;
2. the data directory's Valkey is this command's alone (a lock); whatever an earlier run left
   unfinished (it was killed) is cancelled and its queued work dropped before the workers start;
3. Ctrl-C, SIGTERM or SIGHUP cancel the job, stop every child and exit with 128 + the signal's
   number (a second one kills the children at once);
4. the file is written where the user asked; the data directory keeps no copy unless ``--keep``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from fleet.names import Names
from fleet.settings import Settings
from jobs.audio import FORMATS, Pauses
from jobs.books import text_encoding
from jobs.model import EventType, Job
from jobs.segmentation import Plan
from narrate.signals import Interrupted, StopSignals

#: Bytes of a text file read at the most (a UTF-8 character is at most 4 bytes).
BYTES_PER_CHAR = 4


class InputError(ValueError):
    """The command line asks for something impossible: said in one line, exit code 2."""


def is_book(path: Path) -> bool:
    """An EPUB, by its name or its first bytes (a zip). Only a regular file is sniffed: a pipe
    (/dev/stdin) cannot be read twice, and its first block would be lost to the text."""
    if path.suffix.lower() == ".epub":
        return True
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False  # read_text_file says why


def read_book_file(path: Path, settings, *, alt_text: bool = False):
    """The EPUB at ``path`` as a ``Book``, or ``InputError`` saying why it cannot be read."""
    from jobs.errors import InvalidRequest
    from jobs.uploads import Upload, read_upload

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return read_upload(Upload(data, path.name, "epub"), settings, alt_text=alt_text)
    except InvalidRequest as exc:
        raise InputError(f"{path}: {exc}") from None


def parse_chapters(text: str | None) -> list[int | str] | None:
    """``--chapters 1,3,Epilogue`` -> [1, 3, "Epilogue"]."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:  # ",," or "": asked for chapters and named none (not "all of them")
        raise InputError("--chapters names no chapter: give numbers or titles, comma-separated")
    return [int(t) if t.isascii() and t.isdigit() else t for t in items]


def print_contents(path: Path, book) -> int:
    """``--list-chapters``: what ``--chapters`` can name, and what is narrated by default."""
    if book is None:
        print(f"narrate: {path}: --list-chapters: only a book (an EPUB) has chapters", file=sys.stderr)
        return 2
    print(f"{book.title or path.name}" + (f" by {book.author}" if book.author else ""))
    for c in book.chapters:
        skipped = f"  (skipped: {c.matter})" if c.skipped_by_default else ""
        print(f"{c.number:4d}  {c.title or '(untitled)'}  [{c.chars:,} characters]{skipped}")
    return 0


def read_text_file(path: Path, max_chars: int) -> str:
    """The text of ``path``, or ``InputError`` saying why it cannot be narrated."""
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a text file")
    limit = max_chars * BYTES_PER_CHAR
    try:
        with path.open("rb") as f:  # (a pipe has no size to check first)
            data = f.read(limit + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise InputError(f"{path}: more text than this fleet accepts ({max_chars:,} characters)")
    encoding = text_encoding(data)  # UTF-16 with its byte-order mark too, as the API takes it
    if data.startswith(b"%PDF-"):
        raise InputError(f"{path}: is a PDF; narrate reads text (.txt, .md) and EPUB: save its text first")
    if encoding != "utf-16" and b"\x00" in data[:65536]:
        raise InputError(f"{path}: looks like a binary file, not text")
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    if not text.strip():
        raise InputError(f"{path}: is empty: there is nothing to narrate")
    return text


def read_cover_file(name: str) -> bytes:
    """The bytes of ``--cover`` (what it is, the job's validation says)."""
    path = Path(name)
    if not path.is_file():
        raise InputError(f"{path}: no such picture" if not path.exists() else f"{path}: is not a file")
    return path.read_bytes()


def output_and_format(source: Path, output: str | None, fmt: str | None) -> tuple[Path, str]:
    """Where to write and in which format: the output's extension decides unless ``--format`` says;
    an extension that names another known format is a contradiction."""
    known = list(FORMATS)
    if output is None:
        fmt = (fmt or "wav").lower()
        return source.with_suffix(f".{fmt}"), fmt
    path = Path(output)
    ext = path.suffix.lower().lstrip(".")
    if fmt is not None:
        fmt = fmt.lower()
        if ext in known and ext != fmt:
            raise InputError(f"{path}: the extension says {ext} but --format says {fmt}")
    elif ext in known:
        fmt = ext
    else:
        raise InputError(
            f"{path}: cannot tell the format from {'.' + ext if ext else 'a name without extension'}; "
            f"name the file .{' or .'.join(known)}, or say --format"
        )
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a file name")
    if path.resolve() == source.resolve():
        raise InputError(f"{path}: is the input file")
    _check_writable(path)
    return path, fmt


def _check_writable(path: Path) -> None:
    """``InputError`` if ``path`` cannot be written (found now, not after the book is narrated): its
    nearest existing folder must be a folder that takes a file (created there and removed at once)."""
    folder = next(p for p in (path.absolute().parent, *path.absolute().parents) if p.exists())
    if not folder.is_dir():
        raise InputError(f"{path}: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot write in {folder} ({exc.strerror or exc})") from None


@dataclass
class FileJob:
    """What ``narrate file`` was asked, checked: the job and its plan (validated, not yet stored)."""

    job: Job
    plan: Plan
    output: Path
    keep: bool
    manifest: bool
    #: The Valkey is this command's own (embedded), not a shared Redis.
    private: bool = False
    #: The cover picture's bytes (validated with the job).
    cover: bytes | None = None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The progress bar: segments, audio including the pauses after them, real-time factor and ETA."""

    def __init__(self, job: Job, plan: Plan, settings: Settings, model_rate: int) -> None:
        from tqdm import tqdm

        pauses = Pauses.of(settings)
        self.pause_s = [pauses.after(s, model_rate) / model_rate for s in plan.segments]
        self.audio_s = 0.0
        self.started = time.monotonic()
        self.bar = tqdm(total=job.segments_total, unit="seg", desc="narrating", dynamic_ncols=True)

    def segment(self, index: int, duration_s: float) -> None:
        self.audio_s += duration_s + self.pause_s[index]
        speed = self.audio_s / max(time.monotonic() - self.started, 1e-6)
        self.bar.set_postfix_str(f"{_duration(self.audio_s)} of audio, {speed:.1f}x real time", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run(file_job: FileJob, settings: Settings) -> int:
    """Narrate ``file_job`` on embedded (or REDIS_URL's) infrastructure; the process exit code."""
    from narrate.embedded import DataDirBusy, fleet_redis, ping
    from narrate.mps import MpsError

    supervisor = None

    def kill_now() -> None:  # a second signal: no more waiting
        if supervisor is not None:
            supervisor.kill()
        os._exit(128 + (signals.received or 2))

    with StopSignals(on_second=kill_now) as signals, ExitStack() as stack:
        try:
            settings, valkey = fleet_redis(settings, stack)
        except DataDirBusy as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2
        try:
            signals.check()
            if valkey is None:  # REDIS_URL's: reachable, before any worker starts
                ping(settings.redis_url)
            if valkey is not None:  # this command's own Valkey: start from a clean slate
                file_job.private = True
                asyncio.run(reset_private_fleet(settings))
            supervisor = _start_workers(settings, stack)
            return asyncio.run(_narrate(file_job, settings, supervisor, signals))
        except Interrupted as exc:
            if supervisor is not None:
                supervisor.stop()
            if valkey is not None:
                asyncio.run(reset_private_fleet(settings))
            print(f"narrate: interrupted ({exc}); the job was cancelled", file=sys.stderr)
            return exc.exit_code
        except MpsError as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2


def worker_children(settings: Settings) -> list:
    """The command's workers: one AR worker and one decoder (on each GPU of NARRATE_GPUS, placed and
    pinned as ``narrate fleet`` places them), one assembler, one finalizer. ``PlacementError`` if the
    GPUs cannot take them (checked before anything starts)."""
    from narrate.supervisor import fleet_children, fleet_gpu_options

    return fleet_children(
        api=False,
        ar_workers=1,
        decoders=1,
        assemblers=1,
        finalizers=1,
        models=[settings.default_model],
        speech_workers=settings.speech_worker_count,
        metrics_port=settings.metrics_port,
        **fleet_gpu_options(settings),
    )


def _start_workers(settings: Settings, stack: ExitStack):
    from narrate import mps
    from narrate.supervisor import Supervisor, child_env

    env = {**child_env(settings), **mps.start_for(settings, stack)}
    supervisor = Supervisor(worker_children(settings), env, log_dir=settings.data_dir / "logs")
    stack.callback(supervisor.stop)
    supervisor.start()
    return supervisor


async def reset_private_fleet(settings: Settings) -> None:
    """On a Valkey this command owns alone: cancel and delete every unfinished job (an earlier run
    was killed before it could) and drop the stage streams with whatever work they still queue."""
    from fleet.redis import async_client
    from fleet.storage import storage_from_settings
    from jobs import service
    from jobs.store import JobStore

    redis = async_client(settings)
    try:
        store = JobStore.for_settings(redis, settings)
        names = Names(settings.key_prefix)
        storage = storage_from_settings(settings)
        for raw in await redis.zrange(names.jobs_index(), 0, -1):
            job = await store.get(raw.decode())
            if job is not None and not job.status.terminal:
                await service.delete(store, storage, settings, job)
        await redis.delete(*names.stage_streams(settings.model_names, settings.task_shards))
    finally:
        await redis.aclose()


async def _narrate(file_job: FileJob, settings: Settings, supervisor, signals: StopSignals) -> int:
    from fleet.redis import async_client
    from fleet.storage import storage_from_settings
    from jobs import service
    from jobs.finalize import enqueue_finalize
    from jobs.segcache import SegmentCache
    from jobs.store import JobStore
    from models.registry import MODELS

    redis = async_client(settings)
    store = JobStore.for_settings(redis, settings)
    storage = storage_from_settings(settings)
    job, plan = file_job.job, file_job.plan
    progress = None
    try:
        await service.store_cover(storage, job, file_job.cover)
        cache = SegmentCache(redis, store.names, settings)
        reuse = service.Reuse(cache, lambda job_id: asyncio.to_thread(enqueue_finalize, settings, job_id))
        await service.enqueue(store, job, plan, reuse=reuse)
        progress = Progress(job, plan, settings, MODELS[job.model].family.sample_rate)
        after = "0-0"
        while True:
            signals.check()
            supervisor.poll()
            if broken := supervisor.crash_looping():
                progress.close()
                logs = settings.data_dir / "logs"
                print(f"narrate: {', '.join(broken)} keep(s) failing; see {logs}/<name>.log", file=sys.stderr)
                return 1
            for event in await store.read_events(job.id, after, block_ms=250):
                after = event.id
                if event.type == EventType.SEGMENT:
                    progress.segment(event.data["index"], event.data["duration_s"])
                elif event.type == EventType.DONE:
                    progress.close()
                    return await _deliver(file_job, settings, store, storage, job.id)
                elif event.type.terminal:
                    progress.close()
                    print(f"narrate: job {event.type.value}: {event.data.get('error', '')}", file=sys.stderr)
                    return 1
    except Interrupted:
        if progress is not None:
            progress.close()
        if (current := await store.get(job.id)) is not None:
            await service.delete(store, storage, settings, current)
        raise
    finally:
        await redis.aclose()


async def _deliver(file_job: FileJob, settings: Settings, store, storage, job_id: str) -> int:
    """Write the file (and the manifest, if asked) where the user wants them; forget the job unless kept."""
    from jobs import service

    done = await store.get(job_id)
    output = file_job.output
    manifest = json.loads(await asyncio.to_thread(storage.get_bytes, done.objects.manifest))
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(storage.download, done.audio_key, output)
        if file_job.manifest:
            output.with_suffix(".json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1), encoding="utf-8")
    except OSError as exc:  # checked before the start, but a disk fills up or a folder goes
        print(f"narrate: cannot write {exc.filename or output}: {exc.strerror or exc}", file=sys.stderr)
        if not file_job.keep:
            await service.delete(store, storage, settings, done)
        return 1
    lines = [
        f"{output}: {_duration(done.duration_s)} of audio ({done.duration_s:.1f} s), "
        f"{done.segments_total} segment{'s' * (done.segments_total != 1)}, "
        f"{done.chapters} chapter{'s' * (done.chapters != 1)}"
        + (f", {done.segments_reused} reused from earlier runs" if done.segments_reused else "")
    ]
    if file_job.manifest:
        lines.append(f"manifest (chapters, sentence times): {output.with_suffix('.json')}")
    if file_job.keep:
        where = storage.local_path(done.objects.manifest) or done.objects.manifest
        lines.append(
            f"kept in the data directory as job {job_id} (manifest: {where}); `narrate clean` frees it"
        )
    else:
        await service.delete(store, storage, settings, done)
        if file_job.private:
            from narrate.clean import compact

            await compact(store.redis)  # the job's audio passed through Valkey: leave no trace of it
        if not file_job.manifest:
            lines.append("(chapter and sentence times: add --manifest to write them beside the file)")
    print("\n".join(lines))
    return 0
