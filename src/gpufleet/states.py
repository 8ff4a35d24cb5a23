"""Run states, the one set shared by ``@distributed`` calls, workload runs and the run store."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    """Where a run (or one attempt of it) stands; a ``str``, so it compares and stores as its name."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    TIMEDOUT = "TIMEDOUT"

    @property
    def terminal(self) -> bool:
        """True once the run has ended (it never changes state again)."""
        return self not in (RunState.PENDING, RunState.RUNNING)


PENDING = RunState.PENDING
RUNNING = RunState.RUNNING
SUCCESS = RunState.SUCCESS
FAILED = RunState.FAILED
CANCELED = RunState.CANCELED
TIMEDOUT = RunState.TIMEDOUT

#: Why a run stopped when its user stopped it: ``gpufleet cancel``, a handle's ``cancel()``, a SIGTERM to
#: its supervisor. A canceled run's (and attempt's) stored message for calls and workloads alike.
CANCEL_REASON = "canceled by the user"

STATES = tuple(RunState)
ACTIVE_STATES = tuple(s for s in RunState if not s.terminal)
TERMINAL_STATES = tuple(s for s in RunState if s.terminal)
