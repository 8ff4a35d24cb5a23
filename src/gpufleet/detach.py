"""``submit(..., detach=True)``: a call that runs on under its own supervisor process, like a workload.

The caller pickles the function, its settings and its arguments into a private job folder
(``$GPUFLEET_HOME/detached/<job-id>/``, 0700) and starts ``python -m gpufleet.detached_run JOB_DIR``
in a new session: the supervisor runs the call through the same controller as ``.distributed()``
(so it is recorded in the run store, leases its GPUs, retries, times out and is canceled with
``gpufleet cancel`` like any call), streams its ranks' output into ``supervisor.log`` and writes
the result (or the error) into ``result.pkl``. It writes each attempt's run id into ``run_id``
as the attempt starts, and the caller returns a :class:`DetachedRunHandle` once the first one
is there. The caller may then exit: the run goes on, and ``gpufleet logs RUN_ID --follow``
follows it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .launch.controller import ControllerCallback

if TYPE_CHECKING:
    from .launch.group import WorkerGroup

JOB_FILE = "job.pkl"
RUN_ID_FILE = "run_id"
RESULT_FILE = "result.pkl"
LOG_FILE = "supervisor.log"
#: Seconds the caller waits for the supervisor to start the first attempt (its GPUs may be busy: it then
#: returns while the run waits for them, as soon as the run has its id).
START_WAIT_S = 120.0


def _job_root() -> Path:
    from .private import private_dir
    from .results import gpufleet_home

    private_dir(gpufleet_home())
    return private_dir(gpufleet_home() / "detached", "the detached calls folder")


def submit_detached(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DetachedRunHandle:
    """Hand the call to a detached supervisor; returns once its first attempt has a run id."""
    import cloudpickle

    from .errors import GpufleetError
    from .private import private_dir, private_file_opener
    from .results import new_run_id
    from .runs.calls import call_origin

    function._bind(args, kwargs)
    try:
        job = cloudpickle.dumps({"func": function.func, "options": function.options, "args": args, "kwargs": kwargs,
                                 "sys_path": [p for p in sys.path if p], "cwd": os.getcwd(),
                                 "origin": {**call_origin(), "detached_from": os.getpid()}},
                                protocol=pickle.HIGHEST_PROTOCOL)  # fmt: skip
    except Exception:
        function._pickle_call(args, kwargs)  # names what cannot be pickled
        raise
    name = function.options.name or getattr(function.func, "__name__", "run")
    job_dir = private_dir(_job_root() / new_run_id(name), "the detached call's folder")
    with open(job_dir / JOB_FILE, "wb", opener=private_file_opener) as f:
        f.write(job)
    with open(job_dir / LOG_FILE, "ab", opener=private_file_opener) as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.detached_run", str(job_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, cwd=os.getcwd(),
        )  # fmt: skip
    handle = DetachedRunHandle(job_dir, proc.pid)
    deadline = time.monotonic() + START_WAIT_S
    while handle._read_run_id() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            if (job_dir / RESULT_FILE).exists():
                handle.result(0)  # raises why it could not start
            tail = (job_dir / LOG_FILE).read_text(errors="replace")[-2000:]
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            raise GpufleetError(f"the detached supervisor of the call did not start it; its log ({job_dir / LOG_FILE}) "
                                f"ends with:\n{tail}")  # fmt: skip
        time.sleep(0.05)
    handle._popen = proc  # reaped by its handle; the run does not need the caller
    print(f"gpufleet: run {handle.run_id} runs detached (supervisor pid {proc.pid}); follow it with "
          f"`gpufleet logs {handle.run_id} --follow`, wait for it with `handle.result()`", file=sys.stderr, flush=True)
    return handle


class DetachedRunHandle:
    """A call that runs under a detached supervisor (``submit(..., detach=True)``).

    Like :class:`~gpufleet.api.RunHandle`: ``run_id``, ``status``, ``done()``, ``result()``,
    ``cancel()``, ``logs(rank)``; the run goes on when this process ends.
    """

    def __init__(self, job_dir: Path, pid: int) -> None:
        self.job_dir = job_dir
        self.pid = pid
        self._popen: subprocess.Popen[bytes] | None = None

    def _read_run_id(self) -> str | None:
        try:
            return (self.job_dir / RUN_ID_FILE).read_text().strip() or None
        except OSError:
            return None

    @property
    def run_id(self) -> str:
        """The current attempt's run id."""
        return self._read_run_id() or "?"

    def _record(self) -> Any:
        """The current attempt's record, after the liveness check: a supervisor that died leaves it FAILED."""
        from .runs.calls import store
        from .runs.liveness import get_run

        try:
            return get_run(store(), self.run_id)
        except Exception:  # noqa: BLE001
            return None

    def _supervisor_gone(self) -> str | None:
        """Why the run can no longer give a result (its supervisor died without writing one), or None."""
        from .runs.liveness import pid_alive

        if self.done():
            return None
        record = self._record()
        if record is not None and record.is_active:
            return None
        if record is not None and record.supervisor_pid is not None:
            alive = pid_alive(record.supervisor_pid, record.supervisor_started)
        else:  # no record yet: the process this handle started, or the pid it was given
            alive = self._popen.poll() is None if self._popen is not None else pid_alive(self.pid)
        if alive or self.done():  # alive: it writes the result next (or starts the next attempt)
            return None
        why = record.message if record is not None and record.message else "it ended without writing a result"
        return f"the detached supervisor (pid {self.pid}) of run {self.run_id} is gone: {why}"

    @property
    def status(self) -> str:
        """PENDING, RUNNING, SUCCESS, FAILED, CANCELED or TIMEDOUT (from the result, else the run store).

        A run whose supervisor died is FAILED (the store's liveness check), not RUNNING for ever.
        """
        outcome = self._outcome()
        if outcome is not None:
            return str(outcome["state"])
        record = self._record()
        if record is not None:
            return str(record.state)
        return "FAILED" if self._supervisor_gone() else "RUNNING"

    @property
    def run_dir(self) -> str:
        record = self._record()
        return record.run_dir if record is not None else ""

    @property
    def mlflow_run_id(self) -> str | None:
        record = self._record()
        ids = record.mlflow_run_ids() if record is not None else []
        return ids[-1] if ids else None

    def _outcome(self) -> dict[str, Any] | None:
        try:
            data = (self.job_dir / RESULT_FILE).read_bytes()
        except OSError:
            return None
        outcome: dict[str, Any] = pickle.loads(data)
        return outcome

    def done(self) -> bool:
        if self._popen is not None:
            self._popen.poll()
        return (self.job_dir / RESULT_FILE).exists()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run; per-rank results, or the run's error raised here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        checked = time.monotonic()
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_id} is still {self.status} after {timeout} s")
            if time.monotonic() - checked >= 1.0:  # a supervisor that died never writes the result
                checked = time.monotonic()
                gone = self._supervisor_gone()
                if gone is not None:
                    from .errors import WorkerGroupError

                    raise WorkerGroupError({}, 0, self.run_dir, gone)
            time.sleep(0.1)
        outcome = self._outcome()
        assert outcome is not None
        if outcome.get("error") is not None:
            raise outcome["error"]
        if outcome.get("error_text"):
            from .errors import WorkerGroupError

            raise WorkerGroupError({}, 0, self.run_dir, outcome["error_text"])
        values: list[Any] = outcome["values"]
        return values

    def cancel(self, wait: float | None = 30.0) -> None:
        """Stop every rank (the supervisor records the run CANCELED); waits up to ``wait`` seconds."""
        from .runs.calls import store
        from .runs.cancel import request_cancel

        record = self._record()
        try:
            if record is not None and record.is_active:
                request_cancel(store(), record)  # as `gpufleet cancel` does
        except Exception:  # noqa: BLE001 - a busy store: the signal alone stops it
            pass
        if not self.done():  # its SIGTERM handler cancels the run at once
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + (wait or 0)
        while wait and not self.done() and time.monotonic() < deadline:
            time.sleep(0.1)

    def logs(self, rank: int = 0) -> str:
        path = Path(self.run_dir) / f"rank-{rank}.log"
        return path.read_text("utf-8", "replace") if path.exists() else ""

    def __repr__(self) -> str:
        return f"DetachedRunHandle(run_id={self.run_id!r}, status={self.status!r}, pid={self.pid})"


# ------------------------------------------------------------------ the supervisor


class _JobFiles(ControllerCallback):
    """Writes each attempt's run id into the job folder as it starts."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir

    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        from .results import write_atomic

        write_atomic(self.job_dir / RUN_ID_FILE, group.run_id.encode())


def _write_result(job_dir: Path, outcome: dict[str, Any]) -> None:
    import cloudpickle

    from .results import write_atomic

    try:
        data = cloudpickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an error or value that does not pickle: its text
        error = outcome.get("error")
        data = pickle.dumps({"state": outcome["state"], "values": None, "error": None,
                             "error_text": f"{type(error).__name__}: {error}" if error is not None else
                             "the run's result could not be pickled"})  # fmt: skip
    write_atomic(job_dir / RESULT_FILE, data)
