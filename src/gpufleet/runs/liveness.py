"""Runs whose supervisor is gone: found when a CLI command reads them, marked FAILED, stopped.

A run whose supervisor died is never shown RUNNING forever. The CLI commands (``get``,
``list``, ``logs``, ``cancel``, ``run --watch`` and a resubmitted idempotency key) read runs
through :func:`get_run` and :func:`list_runs`, which check the supervisor's pid (and its start
time, against pid reuse) and heartbeat, mark such a run FAILED with the reason, and stop
whatever the run left running. The run store's own reads never act on processes.

A run still RUNNING in the store whose outcome file exists (its supervisor finished while the
store was busy) is shown with that outcome, which is written to the store when it can be. The
supervisor's heartbeat counts from the later of the store's ``heartbeat_at`` and its alive
file, so a supervisor waiting on a busy store is not mistaken for a hung one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Any

from ..launch.proctree import run_processes, stop_tree
from ..states import ACTIVE_STATES, FAILED, PENDING
from .records import alive_at, read_run_outcome
from .store import RunRecord, RunStore, StoreError

logger = logging.getLogger(__name__)

#: Age after which a supervisor's heartbeat is stale (it beats every ``store.HEARTBEAT_S``).
STALE_HEARTBEAT_S = 90.0
#: Seconds a PENDING run may wait for its supervisor to register.
START_GRACE_S = 120.0
#: Seconds a read waits to write what it found (a dead supervisor, an outcome file) to a busy store.
_WRITE_BACK_WAIT_S = 2.0


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``started`` is given, is that same process."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if started is not None and abs(p.create_time() - started) > 1.0:
            return False  # the pid was reused by another process
        return True
    except psutil.Error:
        return False


def process_start_time(pid: int) -> float:
    """Creation time of ``pid`` as psutil reports it (used to detect pid reuse)."""
    import psutil

    return psutil.Process(pid).create_time()


def kill_run_processes(run_id: str, grace_period_s: float = 3.0) -> int:
    """Stop every process that carries ``GPUFLEET_RUN_ID=run_id``; returns how many there were.

    Each is stopped with its process group and descendants (TERM, grace period, KILL).
    """
    procs = run_processes(run_id)
    if procs:
        stop_tree([p.pid for p in procs], grace_period_s, run_id=run_id)
    return len(procs)


def supervisor_gone(run: RunRecord, now: float | None = None) -> tuple[str | None, bool]:
    """Why an active run's supervisor is gone (None while it is fine), and whether it hangs.

    A hanging supervisor (alive, but no heartbeat for ``STALE_HEARTBEAT_S``) must be killed.
    """
    if not run.is_active:
        return None, False
    now = time.time() if now is None else now
    if run.supervisor_pid is None:
        if run.state == PENDING and now - run.created_at > START_GRACE_S:
            return "its supervisor process never started", False
        return None, False
    who = "supervisor process" if run.own_supervisor else "calling process"  # a call's caller stands for its supervisor
    if not pid_alive(run.supervisor_pid, run.supervisor_started):
        return f"its {who} (pid {run.supervisor_pid}) died", False
    beats = [t for t in (run.heartbeat_at, alive_at(run.run_dir)) if t is not None]
    if beats and now - max(beats) > STALE_HEARTBEAT_S:
        return (
            f"its supervisor process (pid {run.supervisor_pid}) stopped responding "
            f"(no heartbeat for {now - max(beats):.0f} s) and was killed"
        ), True
    return None, False


def _ended(run: RunRecord, state: str, **fields: Any) -> RunRecord:
    """``run`` as it is once it ended in ``state`` (what the store shows after the write)."""
    fields.setdefault("ended_at", time.time())
    return dataclasses.replace(run, state=state, **fields)


def settle(store: RunStore, run: RunRecord) -> RunRecord | None:
    """The run with the outcome its supervisor wrote to its folder, or None when it wrote none.

    The outcome is written to the store when the store lets it within a moment; else the next
    read does it (or the supervisor, which keeps trying).
    """
    if not run.is_active:
        return None
    outcome = read_run_outcome(run.run_dir)
    if outcome is None:
        return None
    fields = {"exit_code": outcome["exit_code"], "message": outcome["message"], "ended_at": outcome["ended_at"]}
    try:
        store.with_wait(min(store.wait_s, _WRITE_BACK_WAIT_S)).finish_run(run.id, outcome["state"], **fields)
        return store.get(run.id)
    except StoreError:
        return _ended(run, outcome["state"], **fields)


def reap(store: RunStore, run: RunRecord) -> RunRecord:
    """Settle an active run from its outcome file, or mark it FAILED when its supervisor is gone.

    A run whose supervisor is gone has what it left running stopped. Returns the run as stored
    afterwards (``run`` itself when its supervisor is fine).
    """
    settled = settle(store, run)
    if settled is not None:
        return settled
    reason, hung = supervisor_gone(run)
    if reason is None:
        return run
    if hung and run.supervisor_pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.supervisor_pid, signal.SIGKILL)
    settled = settle(store, run)  # it may have finished just before it was found gone
    if settled is not None:
        return settled
    message = f"run failed: {reason}; nothing of it is left running"
    try:
        recorded: bool | None = store.with_wait(min(store.wait_s, _WRITE_BACK_WAIT_S)).finish_run(
            run.id, FAILED, message=message
        )
    except StoreError:  # the store is busy: the next read records it
        recorded = None
    if recorded:
        logger.warning("run %s: %s", run.id, reason)
    kill_run_processes(run.id)
    if recorded is None:
        return _ended(run, FAILED, message=message)
    return store.get(run.id)


def get_run(store: RunStore, run_id: str) -> RunRecord:
    """The run with this id (or unique prefix), after reaping it if its supervisor is gone."""
    return reap(store, store.get(run_id))


def list_runs(
    store: RunStore,
    states: tuple[str, ...] | None = ACTIVE_STATES,
    limit: int | None = 20,
    filters: dict[str, str] | None = None,
) -> list[RunRecord]:
    """:meth:`RunStore.list`, reaping each run whose supervisor is gone."""
    runs = [reap(store, r) for r in store.list(states=states, limit=limit, filters=filters)]
    if states:  # a run just found dead is no longer in an active state
        runs = [r for r in runs if r.state in states]
    return runs
