"""``submit(..., detach=True)``: a call that runs on under a supervisor process of its own, like a workload.

The caller stores the call as a PENDING run of kind ``call`` (one id for all its attempts), pickles
the function, its settings and its arguments into the run's private folder (``job.pkl``) and
starts its supervisor (``python -m gpufleet.detached_run RUN_ID``, :mod:`gpufleet.detached_run`)
in a new session, the way ``gpufleet run`` starts a workload's. The supervisor runs the call
through the same controller as ``.distributed()`` (it leases its GPUs, retries, times out, has a
heartbeat, and is canceled with ``gpufleet cancel`` like a workload run), streams its ranks'
output into ``supervisor.log`` and writes the result (or the error) into ``result.pkl``. The
caller returns a :class:`DetachedRunHandle` once the first attempt started (a setting the
supervisor refuses is raised here), and may then exit: the run goes on, ``gpufleet logs RUN_ID
--follow`` follows it, and ``DetachedRunHandle(RUN_ID)`` finds it again from any process.
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

from .detached_run import JOB_FILE, RESULT_FILE

if TYPE_CHECKING:
    from .runs.records import RunRecord
    from .runs.store import RunStore

#: Seconds the caller waits for the supervisor to start the first attempt (its GPUs may be busy: it then
#: returns while the run waits for them, as soon as the attempt is recorded).
START_WAIT_S = 120.0


def submit_detached(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DetachedRunHandle:
    """Hand the call to a detached supervisor; returns once its first attempt started."""
    import cloudpickle

    from .errors import GpufleetError
    from .private import private_file_opener
    from .results import RunDir, new_run_id
    from .runs.calls import CallKind, call_origin
    from .runs.liveness import process_start_time
    from .runs.store import RunStore
    from .runs.supervisor import LOG_FILE, start_supervisor
    from .states import FAILED

    function._bind(args, kwargs)
    try:
        job = cloudpickle.dumps({"func": function.func, "options": function.options, "args": args, "kwargs": kwargs,
                                 "sys_path": [p for p in sys.path if p], "cwd": os.getcwd()},
                                protocol=pickle.HIGHEST_PROTOCOL)  # fmt: skip
    except Exception:
        function._pickle_call(args, kwargs)  # names what cannot be pickled
        raise
    opts = function.options
    launcher = "slurm" if opts.remote == "slurm" else "ray" if opts.remote else "local"
    kind = CallKind(function, launcher, one_run=True)
    run_id = new_run_id(kind.name)
    run_dir = RunDir.create(opts.runs_dir, run_id).path
    with open(run_dir / JOB_FILE, "wb", opener=private_file_opener) as f:
        f.write(job)
    store = RunStore()
    store.create_run(kind.stored_run(run_id, run_dir, {**call_origin(), "detached_from": os.getpid()}))
    try:
        proc = start_supervisor("gpufleet.detached_run", run_id, store.home, run_dir)
    except BaseException as e:
        store.finish_run(run_id, FAILED, message=f"could not start the run: {e}")
        raise
    with contextlib.suppress(Exception):  # it already exited: the liveness check sees that
        store.update_run(run_id, supervisor_pid=proc.pid, supervisor_started=process_start_time(proc.pid))
    handle = DetachedRunHandle(run_id, store.home)
    handle._popen = proc  # reaped by its handle; the run does not need the caller
    deadline = time.monotonic() + START_WAIT_S
    while not handle._started():
        if proc.poll() is not None or time.monotonic() > deadline:
            if handle.done():
                handle.result(0)  # raises why it could not start
            tail = (run_dir / LOG_FILE).read_text(errors="replace")[-2000:]
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            raise GpufleetError(f"the detached supervisor of the call did not start it; its log ({run_dir / LOG_FILE}) "
                                f"ends with:\n{tail}")  # fmt: skip
        time.sleep(0.05)
    print(f"gpufleet: run {run_id} runs detached (supervisor pid {proc.pid}); follow it with "
          f"`gpufleet logs {run_id} --follow`, wait for it with `handle.result()`", file=sys.stderr, flush=True)
    return handle


class DetachedRunHandle:
    """A call that runs under its own supervisor (``submit(..., detach=True)``), found by its run id.

    Like :class:`~gpufleet.api.RunHandle`: ``run_id``, ``status``, ``done()``, ``result()``,
    ``cancel()``, ``logs(rank)``, ``stacks()``; the run goes on when this process ends, and
    ``DetachedRunHandle(run_id)`` finds it again from any process of the same user (``home``: the
    ``GPUFLEET_HOME`` it was stored in).
    """

    def __init__(self, run_id: str, home: str | os.PathLike[str] | None = None) -> None:
        self.run_id = run_id
        self._home = home
        self._db: RunStore | None = None
        self._popen: subprocess.Popen[bytes] | None = None

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

    def _outcome(self) -> dict[str, Any] | None:
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
        """Whether the run ended (its result is written, or its supervisor is gone without one)."""
        if self._outcome() is not None:
            return True
        record = self._record()
        return record is not None and not record.is_active

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run; per-rank results, or the run's error raised here.

        A run that ended without a result (its supervisor died: the liveness check ends it FAILED)
        raises :class:`~gpufleet.errors.WorkerGroupError` with the store's message at once.
        """
        from .errors import WorkerGroupError

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            outcome = self._outcome()
            if outcome is not None:
                break
            record = self._record()
            if record is not None and not record.is_active:
                outcome = self._outcome()  # written before the store learned the end
                if outcome is not None:
                    break
                raise WorkerGroupError({}, 0, record.run_dir, f"run {self.run_id} ended {record.state} without a "
                                       f"result (its supervisor, pid {record.supervisor_pid}, is gone): {record.message}")  # fmt: skip
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_id} is still {self.status} after {timeout} s")
            time.sleep(0.2)
        if outcome.get("error") is not None:
            raise outcome["error"]
        if outcome.get("error_text"):
            raise WorkerGroupError({}, 0, self.run_dir, outcome["error_text"])
        values: list[Any] = outcome["values"]
        return values

    def cancel(self, wait: float | None = 30.0) -> None:
        """Stop every rank (the run ends CANCELED, "canceled by the user"); waits up to ``wait`` seconds."""
        from .runs.cancel import request_cancel

        record = self._record()
        if record is not None and record.is_active:
            request_cancel(self._store(), record)  # as `gpufleet cancel` does
        deadline = time.monotonic() + (wait or 0)
        while wait and not self.done() and time.monotonic() < deadline:
            time.sleep(0.1)

    def logs(self, rank: int = 0) -> str:
        """What rank ``rank`` of the latest attempt printed so far."""
        record = self._record()
        path = record.log_dir / f"rank-{rank}.log" if record is not None else None
        return path.read_text("utf-8", "replace") if path is not None and path.exists() else ""

    def stacks(self) -> dict[int, str]:
        """Every running rank's current stack (all threads), by rank (ranks on this machine)."""
        from .stacks import collect

        _, procs = collect(self.run_id, stored=False)
        return {p["rank"]: p["stack"] for p in procs if p["rank"] is not None}

    def __repr__(self) -> str:
        return f"DetachedRunHandle(run_id={self.run_id!r}, status={self.status!r})"
