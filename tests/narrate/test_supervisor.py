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
