"""The machine-wide lock AR workers hold while their engine starts (several engines on one GPU must
not profile its free memory at the same time), between real processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from fleet.settings import Settings
from workers.runtime import engine_start_lock, machine_lock


def hold(path: str, seconds: float, log: str) -> None:
    """In another process: take the lock, note when, keep it ``seconds``, note the release."""

    async def main() -> None:
        async with machine_lock(Path(path), poll_s=0.02):
            Path(log).write_text(f"{time.time()}\n")
            await asyncio.sleep(seconds)
        with open(log, "a") as f:
            f.write(f"{time.time()}\n")

    asyncio.run(main())


def start(path: Path, seconds: float, log: Path) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=hold, args=(str(path), seconds, str(log)))
    proc.start()
    return proc


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not path.exists() or not path.read_text():
        assert time.time() < deadline, f"{path} was never written"
        time.sleep(0.02)


def test_a_second_process_waits_until_the_first_lets_go(tmp_path):
    lock = tmp_path / "locks" / "engine.lock"
    first = start(lock, 1.0, tmp_path / "first")
    wait_for(tmp_path / "first")
    second = start(lock, 0.0, tmp_path / "second")
    first.join(30)
    second.join(30)
    acquired_1, released_1 = map(float, (tmp_path / "first").read_text().split())
    acquired_2 = float((tmp_path / "second").read_text().split()[0])
    assert first.exitcode == second.exitcode == 0
    assert acquired_2 >= released_1 > acquired_1


def test_a_holder_killed_with_sigkill_releases_it(tmp_path):
    lock = tmp_path / "engine.lock"
    first = start(lock, 60.0, tmp_path / "first")
    wait_for(tmp_path / "first")
    second = start(lock, 0.0, tmp_path / "second")
    time.sleep(0.5)
    assert not (tmp_path / "second").exists(), "the second process took a lock that was held"
    os.kill(first.pid, signal.SIGKILL)
    first.join(10)
    wait_for(tmp_path / "second", timeout=10)
    second.join(10)
    assert second.exitcode == 0


def test_a_worker_told_to_stop_while_waiting_stops(tmp_path):
    lock = tmp_path / "engine.lock"
    holder = start(lock, 60.0, tmp_path / "holder")
    wait_for(tmp_path / "holder")
    try:

        async def waiter() -> None:
            async with machine_lock(lock, poll_s=0.02):
                pytest.fail("the lock was taken while another process held it")

        async def main() -> None:
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
    finally:
        holder.kill()
        holder.join(10)


def test_one_lock_per_device_in_the_data_dir(tmp_path):
    async def main() -> None:
        gpu0 = Settings(data_dir=tmp_path, device="cuda:0")
        gpu1 = Settings(data_dir=tmp_path, device="cuda:1")
        async with engine_start_lock(gpu0):
            # another device's lock is free meanwhile; the same device's is not
            async with asyncio.timeout(5), engine_start_lock(gpu1):
                pass
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5), engine_start_lock(gpu0):
                    pass

    asyncio.run(main())
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == [
        "engine-start-cuda-0.lock",
        "engine-start-cuda-1.lock",
    ]
