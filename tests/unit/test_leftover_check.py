"""The leftover-process check names what it found, whatever state those processes are in."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.proc import describe


def test_a_live_process_is_named_by_its_command_line() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "marker-live"])
    try:
        p = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while "marker-live" not in p.cmdline():  # until the child has replaced itself with python
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        text = describe(p)
        assert text.startswith(f"{proc.pid} (") and "marker-live" in text
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_is_named_instead_of_crashing_the_check() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; never reaped until wait(): a zombie
    p = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    while p.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    try:
        try:
            p.cmdline()  # what the check used to call, and crashed on
        except psutil.ZombieProcess:
            pass
        text = describe(p)
        assert text.startswith(f"{proc.pid} (zombie)") and "python" in text.lower(), text
    finally:
        proc.wait()


def test_a_process_gone_since_it_was_found_is_named_by_its_pid() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p = psutil.Process(proc.pid)  # found while alive
    proc.kill()
    proc.wait()  # reaped: gone
    assert describe(p) == f"{proc.pid} (gone)"
