"""Handles of runs: one interface for a call in this process, a detached call and a workload run.

:class:`RunHandle` is what ``submit()`` returns: the run's controller is in this process.
:class:`StoredRunHandle` is a run of the run store under a supervisor of its own, found by its id
from any process of the same user: what ``submit(..., detach=True)`` returns and what
:func:`run_handle` gives for any stored run (a detached call, a workload run of ``gpufleet run``).
Both answer the same questions the same way:

- ``run_id``, ``status`` (PENDING, RUNNING, SUCCESS, FAILED, CANCELED, TIMEDOUT), ``done()``;
- ``wait(timeout)``: the state once the run ended (or at the timeout, still active);
- ``result(timeout)``: a call's values, one per rank; ``None`` for a workload run; otherwise the
  run's error raised here: the ranks' own exception where the run produced one (a call), else
  the error of its end state (:class:`~gpufleet.errors.RunCanceledError`,
  :class:`~gpufleet.errors.DistributedTimeoutError`, :class:`~gpufleet.errors.WorkerGroupError`)
  with the message the run store holds;
- ``cancel(wait)``: every process stopped, the run CANCELED with "canceled by the user";
- ``logs(n)``: what rank ``n`` of a call (node ``n`` of a workload) printed in the latest attempt;
- ``stacks()``: every running rank's stack now, by rank (ranks on this machine);
- ``run_dir``, ``mlflow_run_id``;
- ``recoveries``: each lost rank of a ``recovery="replace"`` call, of every attempt, and what
  became of it (:class:`~gpufleet.launch.recoveries.Recovery`).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .launch.controller import Controller
    from .launch.group import WorkerGroup
    from .launch.recoveries import Recovery
    from .runs.records import RunRecord
    from .runs.store import RunStore

#: A detached call's values (or error) for its handle, in its run folder.
RESULT_FILE = "result.pkl"


def from_ranks(error: Exception) -> bool:
    """Whether ``error`` is a run's error (a rank's own exception or a worker group's).

    Such an error is raised again without its traceback inside gpufleet: the caller's traceback
    then ends in one gpufleet frame, and the ranks' own traceback is the error's ``__cause__``.
    """
    from .errors import WorkerGroupError

    return isinstance(error, WorkerGroupError) or hasattr(error, "gpufleet_error")


class RunHandle:
    """A run started by :meth:`~gpufleet.api.DistributedFunction.submit`, its controller in this process.

    Attributes:
        run_id: id of the current attempt's run.
    """

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    @property
    def _group(self) -> WorkerGroup:
        group = self._controller.group
        assert group is not None
        return group

    @property
    def status(self) -> str:
        """PENDING, RUNNING, SUCCESS, FAILED, CANCELED or TIMEDOUT."""
        return self._controller.state

    @property
    def run_id(self) -> str:
        return self._group.run_id

    @property
    def mlflow_run_id(self) -> str | None:
        """The current attempt's MLflow run id (None when tracking is off)."""
        return self._group.mlflow_run_id

    @property
    def run_dir(self) -> str:
        """The current attempt's run directory (logs live here)."""
        return str(self._group.run_dir.path)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current attempt's ranks."""
        return self._group.pids

    @property
    def recoveries(self) -> list[Recovery]:
        """Each lost rank replaced in place (or refused) so far, of every attempt, in order."""
        return list(self._controller.recoveries)

    def done(self) -> bool:
        return self._controller.finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the run ends, or ``timeout`` seconds; its state then."""
        self._controller.finished.wait(timeout)
        return self.status

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run; per-rank results, or the run's error raised here."""
        if not self._controller.finished.wait(timeout):
            raise TimeoutError(f"run {self.run_id} is still {self.status} after {timeout} s")
        try:
            return self._controller.outcome()
        except Exception as e:
            if from_ranks(e):
                raise e.with_traceback(None) from e.__cause__  # one gpufleet frame between caller and ranks
            raise

    def cancel(self, wait: float | None = 30.0) -> None:
        """Stop every rank; ``result()`` then raises :class:`~gpufleet.errors.RunCanceledError`.

        Returns once the run has ended (``status`` is then ``CANCELED``, or the state it had
        reached first), or after ``wait`` seconds; ``wait=0`` only asks for the stop.
        """
        self._controller.cancel()
        if wait:
            self._controller.finished.wait(wait)

    def logs(self, rank: int = 0) -> str:
        """What rank ``rank`` printed so far (stdout and stderr), from its log file."""
        return self._group.logs(rank)

    def stacks(self) -> dict[int, str]:
        """Every running rank's current stack (all threads), by rank; needs the hang watchdog on (the default)."""
        return self._group.stacks()

    def __repr__(self) -> str:
        return f"RunHandle(run_id={self.run_id!r}, status={self.status!r})"


def run_handle(run_id: str, home: str | os.PathLike[str] | None = None) -> StoredRunHandle:
    """A handle of the stored run ``run_id`` (a detached call or a workload run; a unique prefix of
    at least 6 characters will do) of this user's run store (``home``: its ``GPUFLEET_HOME``).

    Raises:
        RunNotFoundError: no run has that id.
    """
    from .runs.store import RunStore

    return StoredRunHandle(RunStore(home).get(run_id).id, home)


class StoredRunHandle:
    """A run of the run store under a supervisor of its own (a detached call, a workload run).

    The same interface as :class:`RunHandle` (module docstring); the run goes on when this
    process ends, and any process of the same user can make one with :func:`run_handle`.
    """

    def __init__(self, run_id: str, home: str | os.PathLike[str] | None = None) -> None:
        self.run_id = run_id
        self._home = home
        self._db: RunStore | None = None
        self._popen: subprocess.Popen[bytes] | None = None  # the supervisor, when this process started it

    def _store(self) -> RunStore:
        if self._db is None:
            from .runs.store import RunStore

            self._db = RunStore(self._home, wait_s=1.0)
        return self._db

    def _record(self) -> RunRecord | None:
        """The run's record after the liveness check (a supervisor that died leaves it FAILED); None if unreadable."""
        from .runs.liveness import get_run

        if self._popen is not None:
            self._popen.poll()
        try:
            return get_run(self._store(), self.run_id)
        except Exception:  # noqa: BLE001 - a busy store: the next look
            return None

    def _started(self) -> bool:
        record = self._record()
        return record is not None and (bool(record.attempts) or not record.is_active)

    @property
    def pid(self) -> int | None:
        """The supervisor's process id."""
        if self._popen is not None:
            return self._popen.pid
        record = self._record()
        return record.supervisor_pid if record is not None else None

    @property
    def status(self) -> str:
        """PENDING, RUNNING, SUCCESS, FAILED, CANCELED or TIMEDOUT (a run whose supervisor died is FAILED)."""
        outcome = self._outcome()
        if outcome is not None:
            return str(outcome["state"])
        record = self._record()
        return str(record.state) if record is not None else "PENDING"

    @property
    def run_dir(self) -> str:
        record = self._record()
        return record.run_dir if record is not None else ""

    @property
    def mlflow_run_id(self) -> str | None:
        """The latest attempt's MLflow run id (None when tracking is off)."""
        record = self._record()
        ids = record.mlflow_run_ids() if record is not None else []
        return ids[-1] if ids else None

    @property
    def recoveries(self) -> list[Recovery]:
        """Each lost rank replaced in place (or refused), of every attempt, as the run store holds them."""
        from .launch.recoveries import Recovery

        record = self._record()
        stored = [r for a in record.attempts for r in a.recoveries] if record is not None else []
        return [r for r in map(Recovery.from_dict, stored) if r is not None]

    def _outcome(self) -> dict[str, Any] | None:
        """A call's values or error, as its supervisor wrote them (None before, and for a workload run)."""
        run_dir = self.run_dir
        try:
            data = (Path(run_dir) / RESULT_FILE).read_bytes() if run_dir else None
        except OSError:
            return None
        if data is None:
            return None
        outcome: dict[str, Any] = pickle.loads(data)
        return outcome

    def done(self) -> bool:
        """Whether the run ended (a call's result is written, or the store holds its end)."""
        if self._outcome() is not None:
            return True
        record = self._record()
        return record is not None and not record.is_active

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the run ends, or ``timeout`` seconds; its state then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)
        return self.status

    def result(self, timeout: float | None = None) -> list[Any] | None:
        """Wait for the run: a call's per-rank results, ``None`` for a workload run, or the run's error raised here.

        A call that ended without a result (its supervisor died: the liveness check ends it
        FAILED) raises :class:`~gpufleet.errors.WorkerGroupError` with the store's message at once.
        """
        if self.wait(timeout) not in ("SUCCESS", "FAILED", "CANCELED", "TIMEDOUT"):
            raise TimeoutError(f"run {self.run_id} is still {self.status} after {timeout} s")
        outcome = self._outcome()  # a call's, written before the store learned the end
        if outcome is None:
            record = self._record()
            assert record is not None
            if record.state == "SUCCESS" and not record.is_call:
                return None
            raise _error_of(record)
        if outcome.get("error") is not None:
            raise outcome["error"]
        if outcome.get("error_text"):
            from .errors import WorkerGroupError

            raise WorkerGroupError({}, 0, self.run_dir, outcome["error_text"])
        values: list[Any] = outcome["values"]
        return values

    def cancel(self, wait: float | None = 30.0) -> None:
        """Stop every process (the run ends CANCELED, "canceled by the user"); waits up to ``wait`` seconds."""
        from .runs.cancel import request_cancel

        record = self._record()
        if record is not None and record.is_active:
            request_cancel(self._store(), record)  # as `gpufleet cancel` does
        if wait:
            self.wait(wait)

    def logs(self, rank: int = 0) -> str:
        """What rank ``rank`` of a call (node ``rank`` of a workload) printed in the latest attempt."""
        record = self._record()
        path = record.log_dir / f"{record.log_name}-{rank}.log" if record is not None else None
        return path.read_text("utf-8", "replace") if path is not None and path.exists() else ""

    def stacks(self) -> dict[int, str]:
        """Every running rank's current stack (all threads), by rank (ranks on this machine)."""
        from .stacks import collect

        _, procs = collect(self.run_id, stored=False)
        return {p["rank"]: p["stack"] for p in procs if p["rank"] is not None}

    def __repr__(self) -> str:
        return f"StoredRunHandle(run_id={self.run_id!r}, status={self.status!r})"


def _error_of(record: RunRecord) -> Exception:
    """The error of a run that ended without a result of its own: its end state's class, the store's message."""
    from .errors import DistributedTimeoutError, RunCanceledError, WorkerGroupError

    kind = {"CANCELED": RunCanceledError, "TIMEDOUT": DistributedTimeoutError}.get(str(record.state), WorkerGroupError)
    why = f"run {record.id} ended {record.state}"
    if record.is_call:  # a call's supervisor writes its result before the end: it died first
        why += f" without a result (its supervisor, pid {record.supervisor_pid}, is gone)"
    return kind({}, 0, record.run_dir, f"{why}: {record.message}")
