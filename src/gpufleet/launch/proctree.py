"""Stopping a run's processes: each rank's process group plus the stragglers found around it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

_KILL_WAIT_S = 5.0


def popen_in_own_group(argv: list[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group, its stdout and stderr piped.

    Its own process group lets teardown reach grandchildren (DataLoader workers); stdin is
    closed and no other descriptor is inherited.
    """
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def alive(proc: Any) -> bool:
    """True while the ``psutil.Process`` ``proc`` runs and is not a zombie."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_processes(run_id: str) -> list[Any]:
    """Live processes that carry this run's id in their environment (ranks and descendants)."""
    import psutil

    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get("GPUFLEET_RUN_ID") == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def stop_process_tree(
    procs: Sequence[subprocess.Popen[bytes]],
    grace_period_s: float,
    others: Callable[[], Sequence[Any]],
    poll_s: float = 0.02,
) -> None:
    """Stop processes and everything around them: TERM, grace period, KILL.

    Each of ``procs`` leads its own process group (``start_new_session=True``); the group is
    signalled, since it outlives its leader while members remain. ``others()`` names the
    ``psutil`` processes outside those groups that must stop too (children that called
    ``setsid``, descendants of leaders that already exited); it is asked again after each
    signal, so it may return a fresh scan or a fixed list.

    Args:
        procs: the process-group leaders.
        grace_period_s: how long SIGTERM may take before SIGKILL follows.
        others: returns the other processes to signal.
        poll_s: how often to look whether everything has stopped.
    """
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        found = others()
        for d in found:
            try:
                d.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + (grace_period_s if sig == signal.SIGTERM else _KILL_WAIT_S)
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in procs) and not any(alive(d) for d in found):
                break
            time.sleep(poll_s)
        if all(p.poll() is not None for p in procs) and not any(alive(d) for d in others()):
            return
