"""Supervisors own their process trees, whatever signal dispositions they inherit: ``narrate file`` and
``narrate fleet`` stop every child (and the embedded Valkey) on SIGINT, SIGTERM and SIGHUP, even when
started with SIGINT and SIGHUP ignored (``nohup cmd &``); a second signal kills at once; a SIGKILLed
supervisor leaves nothing behind (the children's parent-death signal). ``narrate file`` cancels its
job on the way out, and the next run starts clean."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from models.espeak import unavailable_reason
from narrate.embedded import EmbeddedValkey
from tests.conftest import require

pytestmark = pytest.mark.integration

BOOK = " ".join(f"Sentence number {i} is a little longer than it needs to be." for i in range(3000))


def ignore_sigint_and_sighup() -> None:  # what `nohup cmd &` in a script hands a command
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env.update(NARRATE_DATA_DIR=str(tmp_path / "data"), NARRATE_BLOCK_MS="200")
    err = tmp_path / "stderr.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "narrate.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(err, "wb"),  # noqa: SIM115 - the child owns it
        preexec_fn=ignore_sigint_and_sighup,
    )
    return proc, err


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(0.1)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return out


def narrating(proc, err: Path, tmp_path: Path) -> list[psutil.Process]:
    """Wait until the job is being narrated; the process tree then (Valkey and every worker)."""
    wait_for(lambda: "seg/s" in err.read_text(errors="replace") or proc.poll() is not None, 120, "progress")
    assert proc.poll() is None, err.read_text()
    procs = tree(proc)
    names = " ".join(" ".join(p.cmdline()) for p in procs)
    assert "valkey-server" in names and "speech-worker" in names and "finalize-worker" in names, names
    return procs


def leftovers(data: Path) -> tuple[list[bytes], int]:
    """Reopen the data directory's Valkey: job keys and queued stage-stream entries left in it."""
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    try:
        with redis.Redis.from_url(url) as r:
            keys = sorted(r.scan_iter(match="narr:job:*"))
            queued = sum(r.xlen(s) for s in r.scan_iter(match="narr:*") if r.type(s) == b"stream")
        return keys, queued
    finally:
        valkey.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_cancels_the_job_stops_the_tree_and_the_next_run_starts_clean(tmp_path, sig):
    (tmp_path / "book.txt").write_text(BOOK, encoding="utf-8")
    proc, err = start(tmp_path, "file", "book.txt", "-o", "book.wav")
    procs = narrating(proc, err, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    text = err.read_text(errors="replace")
    assert f"narrate: interrupted ({sig.name}); the job was cancelled" in text and "Traceback" not in text
    wait_for(lambda: not alive(procs), 5, "every child gone")
    assert not (tmp_path / "book.wav").exists()
    assert not [p for p in (tmp_path / "data" / "storage").rglob("*") if p.is_file()]
    assert leftovers(tmp_path / "data") == ([], 0)  # nothing of the job, no queued work


def test_a_second_signal_kills_at_once(tmp_path):
    (tmp_path / "book.txt").write_text(BOOK, encoding="utf-8")
    proc, err = start(tmp_path, "file", "book.txt", "-o", "book.wav")
    procs = narrating(proc, err, tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    wait_for(lambda: not alive(procs), 5, "every child gone")


@pytest.mark.parametrize("command", ["file", "fleet"])
def test_a_sigkilled_supervisor_leaves_no_process_behind(tmp_path, command):
    (tmp_path / "book.txt").write_text(BOOK, encoding="utf-8")
    if command == "file":
        proc, err = start(tmp_path, "file", "book.txt", "-o", "book.wav")
        procs = narrating(proc, err, tmp_path)
    else:
        proc, err = start(tmp_path, "fleet", "--port", "0")
        wait_for(lambda: "started finalizer-0" in err.read_text(errors="replace"), 60, "the fleet")
        procs = tree(proc)
    assert len(alive(procs)) >= 4, alive(procs)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    wait_for(lambda: not alive(procs), 5, f"no process left (left: {alive(procs)})")


def test_narrate_fleet_started_with_sigint_ignored_stops_on_ctrl_c(tmp_path):
    proc, err = start(tmp_path, "fleet", "--port", "0")
    wait_for(lambda: "started finalizer-0" in err.read_text(errors="replace"), 60, "the fleet")
    time.sleep(1)
    procs = tree(proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0, err.read_text()
    assert "stopping the fleet (SIGINT)" in err.read_text()
    wait_for(lambda: not alive(procs), 5, "every child gone")
