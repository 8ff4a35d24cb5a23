"""Whether a rank is doing anything: CPU seconds of its process tree, a stopped process, its GPU.

The hang watchdog's fast path only declares a rank hung when it makes no progress *and* does
nothing: no CPU time in its process tree (its data-loader workers included), not stopped by a
signal and busy elsewhere, no GPU utilisation. Read from outside with psutil for ranks on this
machine; for a rank elsewhere, from the CPU seconds and GPU utilisation its progress record
carries (:mod:`gpufleet.launch.progress`), which stop moving while the rank's Python is blocked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..proctree import RUN_ID_ENV

#: A rank using less than this share of one core over the window looks idle (an idle Python
#: process, its progress reporter included, uses well under 1 %).
BUSY_CPU_SHARE = 0.05
#: A GPU at or above this utilisation (percent) is busy.
BUSY_GPU_UTIL = 10
#: Reading or writing more than this (bytes a second; the progress reporter writes about 1 KiB)
#: is activity too: a slow read from a network file system is no hang.
BUSY_IO_BYTES_S = 256 * 1024


@dataclass(frozen=True)
class Sample:
    """One look at a rank: when, its process tree's CPU seconds (None: unknown), stopped by a signal,
    running or waiting for a core (a rank starved on a loaded machine uses no CPU but is not idle)."""

    time: float
    cpu_s: float | None
    stopped: bool = False
    gone: bool = False
    runnable: bool = False
    io_bytes: int | None = None


def rank_pids(workers_are_ranks: bool, pids: list[int], run_id: str,
              progress: Mapping[int, Mapping[str, Any]]) -> dict[int, int]:  # fmt: skip
    """The pid of each rank on this machine: the group's workers, else the pid each progress record names.

    A pid from a progress record counts only when that process carries the run's id in its
    environment (a record alone is not trusted).
    """
    if workers_are_ranks and pids:
        return dict(enumerate(pids))
    import psutil

    found = {}
    for rank, record in progress.items():
        pid = record.get("pid")
        if not isinstance(pid, int):
            continue
        try:
            if psutil.Process(pid).environ().get(RUN_ID_ENV) == run_id:
                found[rank] = pid
        except (psutil.Error, OSError):
            continue
    return found


def sample(pid: int, now: float) -> Sample:
    """CPU seconds of ``pid`` and its descendants, and whether ``pid`` is stopped (SIGSTOP, SIGTSTP)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        status = proc.status()
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return Sample(now, None, gone=True)
        total, io = 0.0, 0
        for member in [proc, *proc.children(recursive=True)]:
            try:
                total += sum(member.cpu_times()[:2])
                counters = member.io_counters()
                io += getattr(counters, "read_chars", counters.read_bytes) + getattr(counters, "write_chars", counters.write_bytes)
            except (psutil.Error, AttributeError, OSError):
                continue
        # running, waiting for a core, or in an uninterruptible wait (disk, network file system)
        runnable = status in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP)
        return Sample(now, total, stopped=status == psutil.STATUS_STOPPED, runnable=runnable, io_bytes=io)
    except psutil.NoSuchProcess:
        return Sample(now, None, gone=True)
    except psutil.Error:
        return Sample(now, None)


def judge(before: Sample | None, after: Sample | None, record_before: Mapping[str, Any] | None,
          record_after: Mapping[str, Any] | None) -> str:  # fmt: skip
    """``stopped``, ``busy``, ``idle`` or ``unknown``: what the rank did between two looks.

    The process tree's CPU seconds decide where they are known; else the CPU seconds of the
    rank's own progress records (only when both records are fresh: a blocked rank writes none).
    A GPU at work, a process found running (or waiting for a core or a disk), or reading and
    writing files make a rank busy either way.
    """
    if after is not None and after.stopped:
        return "stopped"
    if record_after and int(record_after.get("gpu_util") or 0) >= BUSY_GPU_UTIL:
        return "busy"
    if (before is not None and before.runnable) or (after is not None and after.runnable):
        return "busy"
    if before is not None and after is not None and before.io_bytes is not None and after.io_bytes is not None:
        span = after.time - before.time
        if span > 0 and (after.io_bytes - before.io_bytes) / span >= BUSY_IO_BYTES_S:
            return "busy"
    if before is not None and after is not None and before.cpu_s is not None and after.cpu_s is not None:
        span = after.time - before.time
        if span > 0:
            return "busy" if (after.cpu_s - before.cpu_s) / span >= BUSY_CPU_SHARE else "idle"
    if record_before and record_after:
        span = float(record_after.get("time", 0)) - float(record_before.get("time", 0))
        a, b = record_after.get("cpu_s"), record_before.get("cpu_s")
        if span > 0 and isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return "busy" if (a - b) / span >= BUSY_CPU_SHARE else "idle"
    return "unknown"
