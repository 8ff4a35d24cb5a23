"""Local launcher: one fresh interpreter per rank on this machine, watched until the end."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import (
    EXCEPTION,
    EXIT,
    NO_RESULT,
    SIGNAL,
    STOPPED,
    DistributedTimeoutError,
    RankFailure,
    RemoteTraceback,
    RunCanceledError,
    WorkerExitError,
    WorkerGroupError,
    WorkerSignalError,
)
from ..results import ERROR, OK, RunDir, new_run_id, read_outcome, tail
from .ports import find_free_port
from .worker import PARENT_PID_ENV

logger = logging.getLogger(__name__)

PENDING, RUNNING, SUCCESS, FAILED, CANCELED, TIMEDOUT = (
    "PENDING",
    "RUNNING",
    "SUCCESS",
    "FAILED",
    "CANCELED",
    "TIMEDOUT",
)
TERMINAL_STATES = (SUCCESS, FAILED, CANCELED, TIMEDOUT)

_POLL_S = 0.02
_FAILURE_SETTLE_S = 1.0
# Messages of errors that are consequences of another rank's failure, not causes.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|recvBytes|sendBytes|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(abort|watchdog)|Socket Timeout|"
    r"DistNetworkError|DistBackendError|failed to recv|Connection refused|"
    r"(?i:connection.*(closed|reset|lost))",
)
_SECONDARY_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}


@dataclass
class LogConfig:
    """What each rank's output shows in the caller: full ranks plus everyone's stderr."""

    enabled: bool = True
    full_ranks: str | tuple[int, ...] = (0,)  # "all" or rank numbers streamed in full
    stderr: bool = True  # every other rank's stderr (warnings, errors)

    def shows(self, rank: int, is_stderr: bool) -> bool:
        if not self.enabled:
            return False
        if self.full_ranks == "all" or rank in self.full_ranks:
            return True
        return is_stderr and self.stderr


@dataclass
class LocalLaunchSpec:
    """Everything the local launcher needs, as a typed object."""

    num_workers: int
    use_gpus: bool
    gpu_indices: tuple[int, ...] = ()
    timeout_s: float | None = None
    grace_period_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    runs_dir: str | None = None
    name: str = "run"
    logs: LogConfig = field(default_factory=LogConfig)
    master_addr: str = "127.0.0.1"
    fast_exit: bool = True


_active: weakref.WeakSet[LocalRun] = weakref.WeakSet()
_reapers: set[threading.Thread] = set()  # not daemons: the interpreter waits for them at exit


@atexit.register
def _stop_active_runs() -> None:
    for run in list(_active):
        run.cancel("the calling process is exiting", grace_period_s=1.0)


class _LogPump:
    """Copies one rank's stdout and stderr into its log file and, filtered, to the caller."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], log_path: Path, logs: LogConfig):
        self.rank = rank
        self._file = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._logs = logs
        self._out: IO[str] = sys.stdout
        self._err: IO[str] = sys.stderr
        self.threads = [
            threading.Thread(target=self._pump, args=(proc.stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, True), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        prefix = f"[rank {self.rank}] "
        for line in iter(pipe.readline, b""):
            with self._lock:
                if not self._file.closed:
                    self._file.write(line)
            if self._logs.shows(self.rank, is_stderr):
                text = line.decode("utf-8", "replace")
                sink = self._err if is_stderr else self._out
                try:
                    sink.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
                    sink.flush()
                except Exception:  # the caller's stream closed: the log file still has it
                    pass
        pipe.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.join(1.0)
        with self._lock:
            self._file.close()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _run_processes(run_id: str) -> list[Any]:
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


def _kill_tree(procs: Sequence[subprocess.Popen[bytes]], grace_period_s: float, run_id: str) -> None:
    """Stop every process of the run: TERM, grace period, KILL.

    Reaches each rank's process group (DataLoader workers), descendants of ranks that have
    already exited, and children that left the group with setsid: all of them carry the
    run's id in their environment.
    """
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)  # the group outlives its leader while members remain
            except (ProcessLookupError, PermissionError):
                pass
        others = _run_processes(run_id)
        for d in others:
            try:
                d.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + (grace_period_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            ranks_done = all(p.poll() is not None for p in procs)
            if ranks_done and not any(_alive(d) for d in others):
                break
            time.sleep(_POLL_S)
        if all(p.poll() is not None for p in procs) and not _run_processes(run_id):
            return


def _alive(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalRun:
    """One launched group of local worker processes.

    ``start()`` spawns the ranks; ``wait()`` watches them until every rank has an outcome,
    then returns the results in global-rank order or raises the root-cause error.
    """

    def __init__(self, spec: LocalLaunchSpec, call_bytes: bytes) -> None:
        self.spec = spec
        self.run_id = new_run_id(spec.name)
        self.run_dir = RunDir.create(spec.runs_dir, self.run_id)
        self.status = PENDING
        self._call_bytes = call_bytes
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[_LogPump] = []
        self._failures: dict[int, RankFailure] = {}
        self._done: dict[int, dict[str, Any]] = {}
        self._stop_reason: str | None = None  # set by cancel()
        self._cancel_grace: float | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._result: list[Any] | None = None
        self._error: BaseException | None = None
        self.master_port = 0

    # -- starting -----------------------------------------------------------------------
    def _worker_env(self, rank: int) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.env)
        package_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [package_parent, env.get("PYTHONPATH", "")] if p
        )
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.num_workers),
            LOCAL_WORLD_SIZE=str(spec.num_workers),
            NODE_RANK="0",
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(spec.num_workers),
            NUM_NODES="1",
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_RUN_ID=self.run_id,
            PYTHONUNBUFFERED="1",
            GPUFLEET_RUN_ID=self.run_id,
            GPUFLEET_RUN_DIR=str(self.run_dir.path),
        )
        env[PARENT_PID_ENV] = str(os.getpid())
        if spec.use_gpus:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # same order as NVML's indices
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.num_workers))
        return env

    def start(self) -> LocalRun:
        """Write the payload and spawn every rank (fresh interpreters, never fork)."""
        payload = {
            "call": self._call_bytes,
            "sys_path": [p for p in sys.path if p],
            "fast_exit": self.spec.fast_exit,
        }
        self.run_dir.payload.write_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        self._call_bytes = b""
        self.master_port = find_free_port(self.spec.master_addr)
        _active.add(self)
        try:
            for rank in range(self.spec.num_workers):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gpufleet.launch.worker", str(self.run_dir.path), str(rank)],
                    env=self._worker_env(rank),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # own process group: teardown reaches grandchildren
                    close_fds=True,
                )
                self._procs.append(proc)
                self._pumps.append(_LogPump(rank, proc, self.run_dir.log(rank), self.spec.logs))
        except BaseException:
            _kill_tree(self._procs, 0.5, self.run_id)
            raise
        self._started = time.monotonic()
        self.status = RUNNING
        logger.debug("run %s: %d ranks on port %d", self.run_id, len(self._procs), self.master_port)
        return self

    # -- watching -----------------------------------------------------------------------
    def _failure_from_outcome(self, rank: int, rec: dict[str, Any]) -> RankFailure:
        msg = rec.get("message", "")
        exc_type = rec.get("exc_type", "Exception")
        secondary = exc_type in _SECONDARY_TYPES or bool(_SECONDARY.search(msg))
        return RankFailure(
            rank=rank,
            kind=EXCEPTION,
            time=rec.get("time", time.time()),
            exc_type=exc_type,
            message=msg,
            traceback=rec.get("traceback", ""),
            log_path=str(self.run_dir.log(rank)),
            secondary=secondary,
            exc_bytes=rec.get("exc_bytes"),
        )

    def _failure_from_exit(self, rank: int, code: int) -> RankFailure:
        self._pumps[rank].join(1.0)
        log = self.run_dir.log(rank)
        common = {"rank": rank, "time": time.time(), "log_path": str(log), "log_tail": tail(log)}
        if code < 0:
            return RankFailure(kind=SIGNAL, exit_code=code, signal_name=_signal_name(-code), **common)
        if code == 0:
            return RankFailure(kind=NO_RESULT, exit_code=0, **common)
        return RankFailure(kind=EXIT, exit_code=code, **common)

    def _collect(self) -> None:
        """Record outcomes of ranks that finished or wrote an outcome since the last look."""
        for rank, proc in enumerate(self._procs):
            if rank in self._done or rank in self._failures:
                continue
            code = proc.poll()
            rec = read_outcome(self.run_dir.outcome(rank))
            if rec is not None and rec["status"] == ERROR:
                self._failures[rank] = self._failure_from_outcome(rank, rec)
            elif rec is not None and rec["status"] == OK:
                # The rank returned; it may still be exiting (interpreter shutdown with torch
                # loaded takes ~0.5 s). The reaper waits for that after the results are back.
                self._done[rank] = rec
            elif code is not None:
                self._failures[rank] = self._failure_from_exit(rank, code)

    def _stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> None:
        """Stop every rank still running; ranks without an outcome are marked STOPPED."""
        alive = [p for p in self._procs if p.poll() is None]
        if dump_stacks and alive:
            for p in alive:
                try:
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler prints every thread's stack
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        t_stop = time.time()
        try:
            _kill_tree(self._procs, grace_period_s, self.run_id)
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            _kill_tree(self._procs, 0.0, self.run_id)
            raise
        finally:
            self._collect_after_stop(reason, t_stop)

    def _collect_after_stop(self, reason: str, t_stop: float) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is None:
                proc.wait()
            if rank in self._done or rank in self._failures:
                continue
            rec = read_outcome(self.run_dir.outcome(rank))
            if rec is not None and rec["status"] == ERROR:
                self._failures[rank] = self._failure_from_outcome(rank, rec)
            elif rec is not None and rec["status"] == OK:
                self._done[rank] = rec
            else:
                log = self.run_dir.log(rank)
                self._failures[rank] = RankFailure(
                    rank=rank, kind=STOPPED, time=t_stop, message=reason,
                    log_path=str(log), log_tail=tail(log),
                )

    def cancel(self, reason: str = "canceled by the user", grace_period_s: float | None = None) -> None:
        """Ask the run to stop every rank; ``wait()`` then raises :class:`RunCanceledError`."""
        with self._lock:
            if self.status in TERMINAL_STATES or self._stop_reason:
                return
            self._stop_reason = reason
            self._cancel_grace = grace_period_s
        if not self._watcher_active():
            self._finish_canceled()

    def _watcher_active(self) -> bool:
        return getattr(self, "_watching", False)

    def wait(self) -> list[Any]:
        """Watch the ranks until the end; results in global-rank order, or raise."""
        if self._finished.is_set():
            return self._outcome()
        self._watching = True
        try:
            self._watch()
        except KeyboardInterrupt:
            n = len(self._procs)
            print(f"gpufleet: interrupted; stopping all {n} ranks of run {self.run_id}", file=sys.stderr)
            self._stop_reason = self._stop_reason or "interrupted (KeyboardInterrupt)"
            try:
                self._stop(self._stop_reason, grace_period_s=min(2.0, self.spec.grace_period_s))
            finally:
                self._finalize(CANCELED, RunCanceledError, "the run was interrupted; every rank was stopped")
            raise
        finally:
            self._watching = False
        return self._outcome()

    def _watch(self) -> None:
        spec = self.spec
        deadline = None if spec.timeout_s is None else self._started + spec.timeout_s
        while True:
            if self._stop_reason is not None:
                self._finish_canceled()
                return
            self._collect()
            if self._failures:
                # Let the other ranks report for a moment: the same error on several ranks
                # is then grouped, and a secondary error does not hide the root cause.
                settle_until = time.monotonic() + _FAILURE_SETTLE_S
                while time.monotonic() < settle_until and len(self._done) + len(self._failures) < len(self._procs):
                    time.sleep(_POLL_S)
                    self._collect()
                first = min(self._failures.values(), key=lambda f: f.time)
                self._stop(f"stopped by gpufleet after rank {first.rank} failed", spec.grace_period_s)
                self._finalize(FAILED)
                return
            if len(self._done) == len(self._procs):
                self._finalize(SUCCESS)
                return
            if deadline is not None and time.monotonic() > deadline:
                self._stop(
                    f"still running at the timeout of {spec.timeout_s:g} s (its stack at that moment is at the end of its log)",
                    spec.grace_period_s,
                    dump_stacks=True,
                )
                self._finalize(
                    TIMEDOUT,
                    DistributedTimeoutError,
                    f"the call ran past its timeout of {spec.timeout_s:g} s; every rank was stopped",
                )
                return
            time.sleep(_POLL_S)

    def _finish_canceled(self) -> None:
        grace = self._cancel_grace if self._cancel_grace is not None else self.spec.grace_period_s
        reason = self._stop_reason or "canceled"
        self._stop(reason, grace)
        self._finalize(CANCELED, RunCanceledError, f"the run was canceled ({reason}); every rank was stopped")

    # -- finishing ----------------------------------------------------------------------
    def _finalize(self, status: str, error_cls: type[WorkerGroupError] | None = None, headline: str = "") -> None:
        with self._lock:
            if self._finished.is_set():
                return
            if status == SUCCESS:
                # Every rank returned: hand back the results now and let a reaper wait for the
                # ranks to finish exiting (atexit handlers, flushes), then stop any stray child.
                reaper = threading.Thread(target=self._reap, name=f"gpufleet-reap-{self.run_id}")
                _reapers.add(reaper)
                reaper.start()
            else:
                for pump in self._pumps:
                    pump.close()
            _active.discard(self)
            if status == SUCCESS:
                try:
                    self._result = self._load_values()
                except WorkerGroupError as e:
                    status, self._error = FAILED, e
            else:
                self._error = self._build_error(status, error_cls, headline)
            self.status = status
            self._cleanup_files()
            self._finished.set()

    def _reap(self) -> None:
        try:
            deadline = time.monotonic() + max(10.0, self.spec.grace_period_s)
            while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if any(p.poll() is None for p in self._procs) or _run_processes(self.run_id):
                logger.warning("run %s: stopping processes still running after every rank returned", self.run_id)
                _kill_tree(self._procs, self.spec.grace_period_s, self.run_id)
            for pump in self._pumps:
                pump.close()
        finally:
            _reapers.discard(threading.current_thread())

    def _load_values(self) -> list[Any]:
        import cloudpickle

        values = []
        for rank in range(len(self._procs)):
            rec = self._done[rank]
            try:
                values.append(cloudpickle.loads(rec["value"]))
            except Exception as e:
                failure = RankFailure(
                    rank=rank, kind=EXCEPTION, time=rec["time"], exc_type=type(e).__name__,
                    message=f"rank {rank}'s return value could not be unpickled in the caller: {e}",
                    log_path=str(self.run_dir.log(rank)),
                )
                raise WorkerGroupError({rank: failure}, len(self._procs), str(self.run_dir.path)) from e
        return values

    def _build_error(self, status: str, error_cls: type[WorkerGroupError] | None, headline: str) -> BaseException:
        n = len(self._procs)
        if error_cls is None:
            probe = WorkerGroupError(self._failures, n)
            kind = probe.root_cause.kind if probe.root_cause else EXCEPTION
            error_cls = {SIGNAL: WorkerSignalError, EXIT: WorkerExitError, NO_RESULT: WorkerExitError}.get(
                kind, WorkerGroupError
            )
        group = error_cls(self._failures, n, str(self.run_dir.path), headline)
        if status == FAILED:
            return _as_original_exception(group)
        return group

    def _cleanup_files(self) -> None:
        for path in [self.run_dir.payload] + [self.run_dir.outcome(r) for r in range(len(self._procs))]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _outcome(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- inspection ---------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [p.pid for p in self._procs]

    def logs(self, rank: int = 0) -> str:
        """Everything rank ``rank`` has printed so far (stdout and stderr)."""
        if not 0 <= rank < self.spec.num_workers:
            raise ValueError(f"rank must be in 0..{self.spec.num_workers - 1}, got {rank}")
        path = self.run_dir.log(rank)
        return path.read_text("utf-8", "replace") if path.exists() else ""


def _as_original_exception(group: WorkerGroupError) -> BaseException:
    """Rebuild the root cause's own exception, with the remote traceback and the summary."""
    rc = group.root_cause
    if rc is None or rc.kind != EXCEPTION or not rc.exc_bytes:
        return group
    import cloudpickle

    try:
        exc = cloudpickle.loads(rc.exc_bytes)
    except Exception:
        return group
    if not isinstance(exc, Exception):  # SystemExit/KeyboardInterrupt must not end the caller
        return group
    exc.__cause__ = RemoteTraceback(rc.traceback)
    note = f"gpufleet: raised on rank {rc.rank}\n{group.summary()}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    try:
        exc.gpufleet_error = group  # type: ignore[attr-defined]
        exc.gpufleet_rank = rc.rank  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    return exc


def launch_local(
    spec: LocalLaunchSpec, call_bytes: bytes, on_start: Callable[[LocalRun], None] | None = None
) -> list[Any]:
    """Start a local run and wait for it (blocking)."""
    run = LocalRun(spec, call_bytes).start()
    if on_start:
        on_start(run)
    return run.wait()
