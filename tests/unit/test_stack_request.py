"""A stopped rank's stack dump shows the line it was stopped at, however many threads it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

from gpufleet.launch.progress import PROGRESS_INTERVAL_ENV, request_stacks

# A rank with gpufleet's stack handler and 16 busy threads (gloo, the progress reporter, a data loader's
# helpers...) that stops itself: SIGSTOP at a line of its own code, as `kill -STOP` or a debugger would.
_RANK = textwrap.dedent("""
    import os, signal, threading, time
    from gpufleet.launch import progress
    progress.start(0)
    def spin():
        while True:
            time.sleep(0.001)
    for _ in range(16):
        threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGSTOP)  # STOPPED HERE
    x = 0
    for i in range(200000):  # runs on once continued: a dump taken late shows these lines
        x += i
""")
_STOP_LINE = next(n for n, ln in enumerate(_RANK.splitlines(), 1) if "STOPPED HERE" in ln)


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def test_a_stopped_rank_dumps_the_line_it_was_stopped_at_once_continued(tmp_path: Path) -> None:
    env = {**os.environ, "GPUFLEET_RUN_DIR": str(tmp_path), PROGRESS_INTERVAL_ENV: "60"}
    for round_ in range(10):  # a signal any thread may take misses the line in about 2 of 3 rounds
        proc = subprocess.Popen([sys.executable, "-c", _RANK], env=env)
        try:
            deadline = time.monotonic() + 60
            while not _stopped(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, "the rank did not stop itself"
                time.sleep(0.02)
            # the watchdog's order: the stack request, then SIGCONT while it waits for the dump
            threading.Timer(0.3, os.kill, args=(proc.pid, signal.SIGCONT)).start()
            text = request_stacks(proc.pid, tmp_path / "stacks-0.txt", timeout_s=30) or ""
            main = [ln.strip() for ln in text.splitlines() if "in <module>" in ln]  # the main thread's line
            assert main == [f'File "<string>", line {_STOP_LINE} in <module>'], f"round {round_}: {text}"
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()
