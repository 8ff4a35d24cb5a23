"""The one process-tree stopper: TERM, a grace period, KILL, over everything a run started.

A run's processes are found three ways, since each alone misses some: the process group of
each leader (``start_new_session=True``; a group outlives its leader while members remain),
the leaders' descendants (children that called ``setsid`` left the group but not the tree),
and every process carrying the run's id in its environment (descendants of a leader that
already exited, daemons that double-forked away from the tree). Processes that must stay free
of third-party imports (the node guard, the environment builder) use
:mod:`gpufleet.launch.node.procgroup` instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .node import envcontract

#: Environment variable that marks every process of a run.
RUN_ID_ENV = envcontract.RUN_ID
_KILL_WAIT_S = 5.0


def popen_in_own_group(
    argv: list[str], env: dict[str, str], cwd: str | None = None, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group (stdout and stderr piped by default).

    Its own process group lets teardown reach grandchildren (DataLoader workers); stdin is
    closed and no other descriptor is inherited but ``pass_fds`` (a GPU lease's locks).
    """
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )


def alive(proc: Any) -> bool:
    """True while the ``psutil.Process`` ``proc`` runs and is not a zombie."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_processes(run_id: str) -> list[Any]:
    """Live processes (``psutil.Process``) that carry ``run_id`` in their environment."""
    import psutil

    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(RUN_ID_ENV) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _descendants(pids: Iterable[int]) -> list[Any]:
    import psutil

    found: dict[int, Any] = {}
    for pid in pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


def _processes(pids: Iterable[int]) -> list[Any]:
    import psutil

    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def stop_tree(
    leaders: Sequence[int | subprocess.Popen[Any]],
    grace_period_s: float,
    run_id: str | None = None,
    poll_s: float = 0.02,
) -> int:
    """Stop process-group leaders, their groups, their descendants and the run's processes.

    SIGTERM to all of them, up to ``grace_period_s`` for them to end, then SIGKILL to what is
    left (and up to 5 s for that). Popen leaders are reaped. Safe to call when everything has
    already ended.

    Args:
        leaders: pids (or ``Popen`` objects) of processes started with ``start_new_session``.
        grace_period_s: how long SIGTERM may take before SIGKILL follows.
        run_id: also stop every process whose environment carries this run id (not on a Ray
            node, where other ranks of the same run live beside this one).
        poll_s: how often to look whether everything has stopped.

    Returns:
        How many processes were still running when SIGKILL was sent (0: all ended in grace).
    """
    import psutil

    popens = [p for p in leaders if isinstance(p, subprocess.Popen)]
    pids = [p.pid if isinstance(p, subprocess.Popen) else int(p) for p in leaders]
    # Taken before the first signal: a TERMed leader's children are re-parented and lost to it.
    tree = {p.pid: p for p in _processes(pids) + _descendants(pids)}

    def others() -> list[Any]:
        if run_id is not None:
            for p in run_processes(run_id):
                tree.setdefault(p.pid, p)
        return [p for p in tree.values() if alive(p)]

    def done() -> bool:
        for p in popens:
            p.poll()  # reap a leader that exited, so it is no zombie of ours
        return not others()

    killed = 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        left = others()
        if sig == signal.SIGKILL:
            killed = len(left)
        for p in left:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + (grace_period_s if sig == signal.SIGTERM else _KILL_WAIT_S)
        while time.monotonic() < deadline:
            if done():
                break
            time.sleep(poll_s)
        if done():
            break
    for p in popens:
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    return killed
