"""NARRATE_CUDA_MPS: the fleet's private MPS daemon (narrate/mps.py), its pipes handed to the
children, quit after them; refusals that say what to do. No GPU here: NVIDIA's control program is
played by a script that keeps its interface (``-d`` starts, ``quit`` on stdin stops) and records
each call with the pipe and log directories it was given. Whether MPS speeds the engines up is the
H200 bench's question (``--fleet-variant mps:cuda_mps=true``)."""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from fleet.settings import Settings
from narrate import mps
from narrate.supervisor import Child, PlacementError, Supervisor, fleet_gpu_options

CONTROL = f"""#!{sys.executable}
import json, os, pathlib, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FORK") and os.fork() == 0:  # the daemon: keeps stdout and stderr
        pathlib.Path(os.environ["FAKE_MPS_FORK"]).write_text(str(os.getpid()))
        import time
        time.sleep(60)
        os._exit(0)
    if os.environ.get("FAKE_MPS_REFUSE"):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    (pathlib.Path(pipe) / "control").write_text("up")
    what = "start"
else:
    what = sys.stdin.read().strip()
    (pathlib.Path(pipe) / "control").unlink()
with open(os.environ["FAKE_MPS_RECORD"], "a") as f:
    f.write(json.dumps([what, pipe, os.environ.get("CUDA_MPS_LOG_DIRECTORY")]) + "\\n")
with open(os.environ["FAKE_MPS_RECORD"] + ".devices", "a") as f:
    f.write(json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES")) + "\\n")
"""


@pytest.fixture
def control(monkeypatch, tmp_path) -> Path:
    """The stand-in nvidia-cuda-mps-control, first on PATH; returns the file its calls go to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / mps.CONTROL
    program.write_text(CONTROL)
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    return record


def calls(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def gpu_settings(tmp_path, **kw) -> Settings:
    return Settings(data_dir=tmp_path / "data", device="cuda", engine="vllm", **kw)


def test_the_children_get_the_daemons_pipes_and_it_quits_after_them(control, monkeypatch, tmp_path):
    """Pinned children keep their GPU's id as it is without MPS: the daemon sees every GPU (not the
    command's CUDA_VISIBLE_DEVICES, under which an MPS server renumbers the GPUs it shows)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # what the fleet command itself sees
    show = (
        "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'], os.environ['CUDA_MPS_LOG_DIRECTORY'],"
        " os.environ['CUDA_VISIBLE_DEVICES'])"
    )
    child = Child("ar-tiny-g3-0", [sys.executable, "-c", show], env={"CUDA_VISIBLE_DEVICES": "3"})
    with ExitStack() as stack:
        env = mps.start_for(gpu_settings(tmp_path, cuda_mps=True), stack)
        pipe, logs = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
        assert calls(control) == [["start", str(pipe), str(logs)]]
        assert (pipe / "control").exists() and logs.is_dir()
        # private to this fleet, and short: the pipes are UNIX sockets (paths of at most ~107 bytes)
        assert pipe.parent == logs.parent and pipe.parent.name.startswith("narrate-mps-")
        assert len(str(pipe)) < 60
        sup = Supervisor([child], {**os.environ, **env}, log_dir=tmp_path / "logs")
        stack.callback(sup.stop)  # as narrate fleet does: the children stop before the daemon quits
        sup.start()
        child.process.wait(timeout=30)
        assert (tmp_path / "logs" / "ar-tiny-g3-0.log").read_text().split() == [str(pipe), str(logs), "3"]
        assert len(calls(control)) == 1  # still up while the fleet runs
    assert calls(control) == [["start", str(pipe), str(logs)], ["quit", str(pipe), str(logs)]]
    assert calls(Path(f"{control}.devices")) == [None, None]  # the daemon saw every GPU
    assert not pipe.parent.exists()  # its temporary directory goes with it


def test_without_the_setting_nothing_starts(control, tmp_path):
    with ExitStack() as stack:
        assert mps.start_for(gpu_settings(tmp_path), stack) == {}
    assert calls(control) == []


def test_a_missing_control_program_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    needs = r"NARRATE_CUDA_MPS=1 needs nvidia-cuda-mps-control .* on PATH"
    with pytest.raises(mps.MpsError, match=needs), ExitStack() as stack:
        mps.start_for(gpu_settings(tmp_path, cuda_mps=True), stack)


def test_a_daemon_keeping_its_descriptors_does_not_hold_the_start(control, monkeypatch, tmp_path):
    """``-d`` forks the daemon, which may keep the stdout and stderr it was given: the start waits
    for the command, not for those to close (the real daemon lives as long as the fleet)."""
    import signal
    import time

    pid_file = tmp_path / "daemon.pid"
    monkeypatch.setenv("FAKE_MPS_FORK", str(pid_file))
    started = time.monotonic()
    daemon = mps.MpsDaemon().start()
    try:
        assert time.monotonic() - started < 20  # the forked daemon sleeps 60 s
        assert pid_file.exists() and daemon.env
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        daemon.stop()


def test_a_daemon_that_refuses_to_start_says_why_and_leaves_nothing(control, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_MPS_REFUSE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(mps.MpsError, match=r"-d failed \(exit 1\): An instance of this daemon is already running"):
        mps.MpsDaemon().start()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_mps_off_the_gpu_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(PlacementError, match="NARRATE_CUDA_MPS=1 .* NARRATE_DEVICE=cpu: set NARRATE_DEVICE=cuda"):
        fleet_gpu_options(Settings(data_dir=tmp_path, device="cpu", cuda_mps=True))
    assert fleet_gpu_options(gpu_settings(tmp_path, cuda_mps=True))["gpu_memory_share"] == 0.85


def test_narrate_fleet_exits_2_when_the_daemon_cannot_start(control, monkeypatch, tmp_path, capsys):
    """The refusal reaches the command line as one line and exit 2, with nothing left running (the
    embedded Valkey it had started is stopped with the rest of the stack)."""
    from narrate.cli import main

    for key in list(os.environ):
        if key.startswith("NARRATE_"):
            monkeypatch.delenv(key)
    for key, value in {"NARRATE_DATA_DIR": str(tmp_path / "data"), "NARRATE_DEVICE": "cuda",
                       "NARRATE_ENGINE": "vllm", "NARRATE_CUDA_MPS": "1", "FAKE_MPS_REFUSE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main(["fleet"]) == 2
    err = capsys.readouterr().err
    assert "nvidia-cuda-mps-control -d failed (exit 1): An instance of this daemon is already running" in err
