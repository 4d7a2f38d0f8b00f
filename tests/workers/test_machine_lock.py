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
from workers.runtime import StopRequested, engine_start_lock, engine_start_lock_path, machine_lock


def hold(path: str, log: str, until: str | None, hold_s: float) -> None:
    """In another process: note "trying", take the lock, note "acquired"; keep it until the file
    ``until`` exists (another process is trying) and ``hold_s`` more; note "released" while still
    holding it (so the stamps are ordered as the lock was), then let go."""

    def note(what: str) -> None:
        with open(log, "a") as f:
            f.write(f"{what} {time.time()}\n")

    async def main() -> None:
        note("trying")
        async with machine_lock(Path(path), poll_s=0.02):
            note("acquired")
            while until is not None and not Path(until).exists():
                await asyncio.sleep(0.02)
            await asyncio.sleep(hold_s)
            note("released")

    asyncio.run(main())


def start(path: Path, log: Path, until: Path | None = None, hold_s: float = 0.0) -> multiprocessing.Process:
    args = (str(path), str(log), str(until) if until else None, hold_s)
    proc = multiprocessing.get_context("spawn").Process(target=hold, args=args)
    proc.start()
    return proc


def stamps(log: Path) -> dict[str, float]:
    return {k: float(v) for k, v in (line.split() for line in log.read_text().splitlines())}


def wait_for(log: Path, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not (log.exists() and what in log.read_text()):
        assert time.time() < deadline, f"{log.name} never noted {what!r}"
        time.sleep(0.02)


def test_a_second_process_waits_until_the_first_lets_go(tmp_path):
    lock, first_log, second_log = tmp_path / "locks" / "engine.lock", tmp_path / "first", tmp_path / "second"
    # the first holds the lock until the second has started trying, then 0.3 s more
    first = start(lock, first_log, until=second_log, hold_s=0.3)
    try:
        wait_for(first_log, "acquired")
        second = start(lock, second_log)
        first.join(60)
        second.join(60)
        assert first.exitcode == second.exitcode == 0
        one, two = stamps(first_log), stamps(second_log)
        assert one["acquired"] < two["trying"] < one["released"] <= two["acquired"]
    finally:
        first.kill()


def test_a_holder_killed_with_sigkill_releases_it(tmp_path):
    lock, first_log, second_log = tmp_path / "engine.lock", tmp_path / "first", tmp_path / "second"
    first = start(lock, first_log, until=tmp_path / "never", hold_s=0.0)
    second = None
    try:
        wait_for(first_log, "acquired")
        second = start(lock, second_log)
        wait_for(second_log, "trying")
        time.sleep(0.3)
        assert "acquired" not in second_log.read_text(), "the second process took a lock that was held"
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        wait_for(second_log, "acquired", timeout=10)
        second.join(10)
        assert second.exitcode == 0
    finally:
        first.kill()
        if second is not None:
            second.kill()


def sleep_in_child(seconds: float) -> None:
    time.sleep(seconds)


def test_a_child_forked_while_it_is_held_does_not_keep_it(tmp_path):
    """vLLM forks its engine core (on CUDA) while the AR worker holds the lock: the child shares the
    lock's open file, and must not keep the lock after the worker lets go."""
    lock = tmp_path / "engine.lock"
    child = multiprocessing.get_context("fork").Process(target=sleep_in_child, args=(30,))

    async def main() -> None:
        async with machine_lock(lock):
            child.start()
        async with asyncio.timeout(5), machine_lock(lock, poll_s=0.02):
            pass

    try:
        asyncio.run(main())
        assert child.is_alive()
    finally:
        child.kill()
        child.join(10)


def test_a_worker_told_to_stop_while_waiting_stops(tmp_path):
    lock, holder_log = tmp_path / "engine.lock", tmp_path / "holder"
    holder = start(lock, holder_log, until=tmp_path / "never")
    try:
        wait_for(holder_log, "acquired")

        async def main() -> None:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.3, stop.set)
            with pytest.raises(StopRequested):
                async with asyncio.timeout(10), machine_lock(lock, poll_s=0.02, stop=stop):
                    pytest.fail("the lock was taken while another process held it")

        asyncio.run(main())
    finally:
        holder.kill()
        holder.join(10)


def test_one_lock_per_gpu_that_vllm_will_take(tmp_path, monkeypatch):
    """vLLM takes the first GPU of CUDA_VISIBLE_DEVICES (the device index of the settings does not
    reach it), so that, not the settings' device, names the lock."""

    def lock_of(device: str, visible: str | None) -> str:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return engine_start_lock_path(Settings(data_dir=tmp_path, device=device)).name

    assert (
        lock_of("cuda", None)
        == lock_of("cuda:0", None)
        == lock_of("cuda:1", "0,1")
        == "engine-start-gpu-0.lock"
    )
    assert lock_of("cuda", "1") == lock_of("cuda:0", "1,0") == "engine-start-gpu-1.lock"
    assert lock_of("cpu", None) == "engine-start-cpu.lock"

    async def same_gpu_waits() -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        async with engine_start_lock(Settings(data_dir=tmp_path, device="cuda")):
            with pytest.raises(TimeoutError):
                async with (
                    asyncio.timeout(0.5),
                    engine_start_lock(Settings(data_dir=tmp_path, device="cuda:0")),
                ):
                    pass
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # another GPU: free meanwhile
            async with asyncio.timeout(5), engine_start_lock(Settings(data_dir=tmp_path, device="cuda")):
                pass

    asyncio.run(same_gpu_waits())
