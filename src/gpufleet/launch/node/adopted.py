"""Processes that left their tree: adopted by a subreaper, and stopped when it ends.

A daemon that forks twice, calls ``setsid`` and clears its environment is in none of the places
the process-tree stopper looks (the leader's process group, its descendants, the run id in the
environment): its parent exits and the kernel gives it to ``init``. A process that is a *child
subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``) receives such orphans of its descendants instead,
so they stay its descendants, whatever their session or environment. A rank's worker and a
node's guard are subreapers, and before they exit they stop what is still below them
(:func:`stop_descendants`): nothing a call or a workload started outlives it, and a guard
whose supervisor was killed stops them at once, as it stops its process group.

Standard library only, like :mod:`procgroup`: the guard runs by file path on Ray nodes. On
systems without ``/proc`` or ``prctl`` everything here does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

_PR_SET_CHILD_SUBREAPER = 36
_KILL_WAIT_S = 5.0


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants' orphans; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from ``/proc``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()  # the name, in parentheses, may hold anything
    try:
        return fields[0].decode(), int(fields[1])
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def descendants(pid: int | None = None) -> list[int]:
    """Every live (non-zombie) descendant of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for p in _pids():
        st = _stat(p)
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(p)
    found, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _reap(pids: Iterable[int]) -> None:
    """Collect those of ``pids`` that are our children and have exited (a subreaper's zombies)."""
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def stop_pids(pids: list[int], grace_period_s: float, poll_s: float = 0.05) -> int:
    """SIGTERM to ``pids``, up to ``grace_period_s`` for them to end, then SIGKILL; how many needed SIGKILL."""
    pids = [p for p in pids if p != os.getpid()]
    killed = 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [p for p in pids if _alive(p)]
        if not left:
            break
        if sig == signal.SIGKILL:
            killed = len(left)
        for p in left:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_period_s if sig == signal.SIGTERM else _KILL_WAIT_S)
        while time.monotonic() < deadline:
            _reap(pids)
            if not any(_alive(p) for p in pids):
                break
            time.sleep(poll_s)
    _reap(pids)
    return killed


def stop_descendants(grace_period_s: float = 2.0) -> int:
    """Stop everything below this process (adopted orphans too); how many needed SIGKILL."""
    pids = descendants()
    return stop_pids(pids, grace_period_s) if pids else 0


def wait_descendants(limit_s: float, poll_s: float = 0.1) -> bool:
    """Wait up to ``limit_s`` for everything below this process to end on its own (reaping it); True once none is left."""
    deadline = time.monotonic() + limit_s
    while True:
        pids = descendants()
        _reap(pids)
        if not any(_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
