"""A process that holds the run store locked, as another program might (a backup, a tool, a hung writer)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# WRITES: `BEGIN EXCLUSIVE`, which in WAL mode stops writers, not readers.
# ALL: exclusive locking mode plus a write, which stops readers as well.
WRITES, ALL = "writes", "all"

_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
if sys.argv[2] == "all":
    db.execute("PRAGMA locking_mode = EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
if sys.argv[2] == "all":
    db.execute("UPDATE runs SET message = message WHERE 0")
    db.execute("SELECT COUNT(*) FROM runs").fetchone()
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
"""


@contextmanager
def store_locked(home: Path, mode: str = WRITES, hold_s: float = 120.0) -> Iterator[subprocess.Popen[str]]:
    """Hold ``home/runs.db`` locked while the block runs (or ``hold_s``); the holder is ended after it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(home / "runs.db"), mode, str(hold_s)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "locked", f"the lock holder did not lock the store (exit {proc.poll()})"
        yield proc
    finally:
        release(proc)


def release(proc: subprocess.Popen[str]) -> None:
    """End the holder (its lock goes with it) and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()
    time.sleep(0.05)
