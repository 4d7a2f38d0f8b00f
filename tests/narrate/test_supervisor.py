from __future__ import annotations

import sys
import time

from narrate.supervisor import Child, Supervisor


def test_a_dying_child_is_restarted_with_backoff_and_reported(tmp_path):
    marker = tmp_path / "starts"
    script = f"open({str(marker)!r}, 'a').write('x'); import sys; sys.exit(3)"
    sup = Supervisor([Child("bad", [sys.executable, "-c", script])], env={}, log_dir=tmp_path / "logs")
    sup.start()
    started = time.monotonic()
    try:
        while not sup.crash_looping(2) and time.monotonic() - started < 30:
            sup.poll()
            time.sleep(0.05)
        sup.children[0].process.wait(timeout=30)  # the third start runs to its exit
    finally:
        sup.stop()
    assert sup.crash_looping(2) == ["bad"]
    assert marker.read_text() == "xxx"  # first start and two restarts
    assert time.monotonic() - started >= 3  # backed off 1 s, then 2 s


def test_stop_ends_children_that_ignore_nothing(tmp_path):
    sup = Supervisor(
        [Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])], env={}, log_dir=tmp_path
    )
    sup.start()
    began = time.monotonic()
    sup.stop(timeout=5)
    assert sup.children[0].process.poll() is not None and time.monotonic() - began < 5


GRANDPARENT = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(float(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _grandchild(marker, timeout=10.0) -> int:
    deadline = time.monotonic() + timeout
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(marker.read_text())


def test_stop_also_ends_what_a_child_started(tmp_path):
    """A child's own children (vLLM's engine core, say) are in its process group: stop ends them too."""
    marker = tmp_path / "pid"
    sup = Supervisor([Child("parent", [sys.executable, "-c", GRANDPARENT, str(marker), "60"])], env={})
    sup.start()
    grandchild = _grandchild(marker)
    sup.stop(timeout=5)
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_child_that_dies_takes_what_it_started_with_it(tmp_path):
    marker = tmp_path / "pid"
    sup = Supervisor([Child("parent", [sys.executable, "-c", GRANDPARENT, str(marker), "0.5"])], env={})
    sup.start()
    try:
        grandchild = _grandchild(marker)
        sup.children[0].process.wait(timeout=10)
        sup.poll()  # notices the exit: its group goes before the restart
        assert sup.children[0].exits == [0]
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild)
    finally:
        sup.children[0].next_start = float("inf")  # no restart
        sup.stop(timeout=5)
