"""Canceling a stored run, the one path for every kind of run and every front door.

``gpufleet cancel``, a detached call's handle and (through them) any other terminal ask a run to
stop the same way: a RUNNING run whose supervisor is a process of gpufleet's own (a workload's,
a detached call's) gets a SIGTERM, which stops its ranks at once even while the store is busy;
then the request is stored, which a PENDING run's supervisor reads as it starts and an
in-process call's recorder reads within a second (its caller, a notebook kernel say, gets no
signal). Every one of them ends the run CANCELED with the one reason
:data:`~gpufleet.states.CANCEL_REASON`. A run that no supervisor ever picked up is ended here.
"""

from __future__ import annotations

import os
import signal

from ..states import CANCEL_REASON, CANCELED, PENDING, RUNNING
from .records import RunRecord
from .store import RunStore


def request_cancel(store: RunStore, run: RunRecord) -> None:
    """Ask the active run ``run`` to stop: signal its own supervisor if it runs, and store the request."""
    signaled = signal_supervisor(run)  # a RUNNING run stops at once, even while the store is busy
    store.request_cancel(run.id)  # a PENDING run's supervisor reads it as it starts
    if not signaled:
        signal_supervisor(store.get(run.id))  # it may have started meanwhile


def signal_supervisor(run: RunRecord) -> bool:
    """SIGTERM the supervisor of a RUNNING run (its handler is in place before it is RUNNING).

    The supervisor of a PENDING run may still be starting, and a SIGTERM then would kill it
    instead of canceling the run; it reads the stored cancel request as it starts.
    """
    from .liveness import pid_alive

    if run.state != RUNNING or not run.supervisor_pid or not run.own_supervisor:
        return False
    if not pid_alive(run.supervisor_pid, run.supervisor_started):
        return False
    try:
        os.kill(run.supervisor_pid, signal.SIGTERM)  # wakes it at once
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_reason(signum: int) -> str:
    """Why a supervisor that got signal ``signum`` stops its run: a SIGTERM is a cancel (what ``gpufleet cancel``
    and a handle send), any other signal is named."""
    if signum == signal.SIGTERM:
        return CANCEL_REASON
    return f"canceled ({signal.Signals(signum).name} to the supervisor)"


def end_unstarted(store: RunStore, run_id: str) -> RunRecord:
    """End a run still PENDING after its cancel was asked for (no supervisor picked it up): CANCELED here,
    its processes stopped. Returns the run as it is now."""
    from .liveness import kill_run_processes

    run = store.get(run_id)
    if run.state == PENDING:
        store.finish_run(run_id, CANCELED, message=f"{CANCEL_REASON} before it started")
        kill_run_processes(run_id)
        run = store.get(run_id)
    return run
