"""Each rank's output: into its log file, and filtered, with a ``[rank N]`` prefix, to the caller."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..private import private_file_opener


@dataclass(frozen=True)
class LogConfig:
    """What each rank's output shows in the caller: full ranks plus everyone's stderr."""

    enabled: bool = True
    full_ranks: str | tuple[int, ...] = (0,)  # "all" or rank numbers streamed in full
    stderr: bool = True  # every other rank's stderr (warnings, errors)
    secrets: tuple[str, ...] = field(default=(), repr=False)  # values masked as *** in logs and echoes

    def mask(self, line: bytes) -> bytes:
        """``line`` with every secret value replaced by ``***``."""
        for value in sorted(self.secrets, key=len, reverse=True):
            if value:
                line = line.replace(value.encode(), b"***")
        return line

    def shows(self, rank: int, is_stderr: bool) -> bool:
        """Whether a line of ``rank`` (from stderr or stdout) is shown in the caller."""
        if not self.enabled:
            return False
        if self.full_ranks == "all" or rank in self.full_ranks:
            return True
        return is_stderr and self.stderr


def echo_line(logs: LogConfig, rank: int, is_stderr: bool, line: bytes, out: IO[str], err: IO[str]) -> None:
    """Show one output line of ``rank`` in the caller with a ``[rank R]`` prefix, if ``logs`` says so."""
    if not logs.shows(rank, is_stderr):
        return
    text = line.decode("utf-8", "replace")
    prefix = f"[rank {rank}] "
    sink = err if is_stderr else out
    try:
        sink.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
        sink.flush()
    except Exception:  # the caller's stream closed: the log file still has it
        pass


class RankLog:
    """Writes one rank's lines into its log file and, filtered, to the caller's streams.

    The caller's ``sys.stdout``/``sys.stderr`` are taken when the log opens, so a notebook
    cell's output goes to the cell that launched the run.
    """

    def __init__(self, rank: int, path: Path, logs: LogConfig) -> None:
        self.rank = rank
        self._file = open(path, "ab", buffering=0, opener=private_file_opener)  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._logs = logs
        self._out: IO[str] = sys.stdout
        self._err: IO[str] = sys.stderr
        self._last: bytes = b""

    def write(self, line: bytes, is_stderr: bool) -> None:
        """Append one line to the log file and echo it if the config says so."""
        if self._logs.secrets:
            line = self._logs.mask(line)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
        echo_line(self._logs, self.rank, is_stderr, line, self._out, self._err)

    def end_with(self, text: str) -> None:
        """Have the log end with ``text`` (a failed rank's traceback), written into the file only
        (the caller gets the exception itself) when the log closes, after the rank's last output."""
        self._last = text.encode("utf-8", "replace")

    def close(self) -> None:
        with self._lock:
            if self._last and not self._file.closed:
                last = self._logs.mask(self._last) if self._logs.secrets else self._last
                try:
                    self._file.write(last if last.endswith(b"\n") else last + b"\n")
                except OSError:  # a full disk: the caller's error has the traceback
                    pass
            self._file.close()


def failure_text(rank: int, exc_type: str, traceback: str) -> str:
    """What a failed rank's log ends with: a line naming the failure, then its traceback."""
    return f"gpufleet: rank {rank} failed with {exc_type}; its traceback:\n{traceback.rstrip()}\n"


class Pump:
    """Copies one local process's stdout and stderr, line by line, into a :class:`RankLog`; the log can
    change while it runs (:meth:`serve`: a warm spare that takes a rank writes into that rank's log)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: RankLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._pump, args=(proc.stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, True), daemon=True),
        ]
        for t in self.threads:
            t.start()

    @property
    def log(self) -> RankLog:
        return self._log

    def serve(self, log: RankLog) -> RankLog:
        """Write the lines from now on into ``log``; the log served before (to close)."""
        with self._lock:
            old, self._log = self._log, log
        return old

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            with self._lock:
                self._log.write(line, is_stderr)
        pipe.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.join(1.0)
        with self._lock:
            self._log.close()
