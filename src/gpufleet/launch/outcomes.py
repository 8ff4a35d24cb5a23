"""What every launcher shares once ranks run: run states, per-rank failures, results, errors.

A launcher decides how ranks start and how it learns about them (local processes, Ray
actors); :class:`RankGroupRun` turns what it learns (outcome records, exit codes, stops)
into the per-rank contract: results in global-rank order, or the root cause's own
exception, or a :class:`~gpufleet.errors.WorkerGroupError` subclass.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
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
from ..results import ERROR, OK, RunDir, tail
from ..states import CANCELED, FAILED, PENDING, SUCCESS, TERMINAL_STATES, TIMEDOUT

# Messages of errors that are consequences of another rank's failure, not causes.
SECONDARY_MESSAGES = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|recvBytes|sendBytes|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(abort|watchdog)|Socket Timeout|"
    r"DistNetworkError|DistBackendError|failed to recv|Connection refused|"
    r"(?i:connection.*(closed|reset|lost))",
)
SECONDARY_TYPES = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})

_ERROR_CLASSES: dict[str, type[WorkerGroupError]] = {
    SIGNAL: WorkerSignalError,
    EXIT: WorkerExitError,
    NO_RESULT: WorkerExitError,
}


@dataclass
class LogConfig:
    """What each rank's output shows in the caller: full ranks plus everyone's stderr."""

    enabled: bool = True
    full_ranks: str | tuple[int, ...] = (0,)  # "all" or rank numbers streamed in full
    stderr: bool = True  # every other rank's stderr (warnings, errors)

    def shows(self, rank: int, is_stderr: bool) -> bool:
        """Whether a line of ``rank`` (from stderr or stdout) is shown in the caller."""
        if not self.enabled:
            return False
        if self.full_ranks == "all" or rank in self.full_ranks:
            return True
        return is_stderr and self.stderr


def echo_line(logs: LogConfig, rank: int, is_stderr: bool, line: bytes, out: IO[str], err: IO[str]) -> None:
    """Show one output line of ``rank`` in the caller with a ``[rank R]`` prefix, if ``logs`` says so."""
    if not logs.shows(rank, is_stderr):
        return
    text = line.decode("utf-8", "replace")
    prefix = f"[rank {rank}] "
    sink = err if is_stderr else out
    try:
        sink.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
        sink.flush()
    except Exception:  # the caller's stream closed: the log file still has it
        pass


def signal_name(num: int) -> str:
    """The name of signal ``num`` (``SIGKILL``), or ``signal N`` when it has none."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def is_secondary(exc_type: str, message: str) -> bool:
    """True for an error that follows from another rank's failure (a peer closed the link)."""
    return exc_type in SECONDARY_TYPES or bool(SECONDARY_MESSAGES.search(message))


def failure_from_outcome(rank: int, rec: dict[str, Any], log_path: Path) -> RankFailure:
    """The failure of a rank that wrote an ``error`` outcome record."""
    msg = rec.get("message", "")
    exc_type = rec.get("exc_type", "Exception")
    return RankFailure(
        rank=rank,
        kind=EXCEPTION,
        time=rec.get("time", time.time()),
        exc_type=exc_type,
        message=msg,
        traceback=rec.get("traceback", ""),
        log_path=str(log_path),
        secondary=is_secondary(exc_type, msg),
        exc_bytes=rec.get("exc_bytes"),
    )


def failure_from_exit(rank: int, code: int, log_path: Path) -> RankFailure:
    """The failure of a rank that exited with ``code`` without an outcome record."""
    common = {"rank": rank, "time": time.time(), "log_path": str(log_path), "log_tail": tail(log_path)}
    if code < 0:
        return RankFailure(kind=SIGNAL, exit_code=code, signal_name=signal_name(-code), **common)
    if code == 0:
        return RankFailure(kind=NO_RESULT, exit_code=0, **common)
    return RankFailure(kind=EXIT, exit_code=code, **common)


def as_original_exception(group: WorkerGroupError) -> BaseException:
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
    exc.add_note(f"gpufleet: raised on rank {rc.rank}\n{group.summary()}")  # Python >= 3.11
    try:
        exc.gpufleet_error = group  # type: ignore[attr-defined]
        exc.gpufleet_rank = rc.rank  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    return exc


class RankGroupRun:
    """The launcher-independent half of a run: per-rank records, cancel, and the final outcome.

    A launcher subclass sets ``run_id``/``run_dir`` and implements :meth:`_stop` (stop every
    rank, then mark the ones without an outcome with :meth:`_mark_stopped`), :meth:`_close`
    (hand back resources once the run ends), :meth:`_watch` and ``num_ranks``; it records what it learns with :meth:`_take_outcome`
    and :meth:`_failure_from_exit`, and ends with :meth:`_finalize`.

    Attributes:
        run_id: the run's id.
        run_dir: the run's directory in the caller (logs, outcomes).
        status: one of ``PENDING``, ``RUNNING`` and the terminal states.
    """

    # Headlines for a root cause of a given kind when the launcher gives none.
    _KIND_HEADLINES: dict[str, str] = {}

    run_id: str
    run_dir: RunDir

    def __init__(self, timeout_s: float | None, grace_period_s: float, call_timeout_s: float | None = None) -> None:
        self._timeout_s = timeout_s  # this attempt's share of the call's time
        self._call_timeout_s = timeout_s if call_timeout_s is None else call_timeout_s  # what the user set
        self._grace_period_s = grace_period_s
        self.status = PENDING
        self._failures: dict[int, RankFailure] = {}
        self._done: dict[int, dict[str, Any]] = {}
        self._stop_reason: str | None = None  # set by cancel()
        self._cancel_grace: float | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._watching = False
        self._result: list[Any] | None = None
        self._error: BaseException | None = None

    # -- what a launcher provides -----------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """How many ranks the run has."""
        raise NotImplementedError

    def _watch(self) -> None:
        """Watch the ranks until the run ends with :meth:`_finalize`."""
        raise NotImplementedError

    def _stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> None:
        raise NotImplementedError

    def _close(self, status: str) -> None:
        """Release what the run holds once its outcome is known (called under the lock)."""
        raise NotImplementedError

    # -- recording ------------------------------------------------------------------------
    def _known(self, rank: int) -> bool:
        return rank in self._done or rank in self._failures

    def _take_outcome(self, rank: int, rec: dict[str, Any] | None) -> str | None:
        """Record ``rank``'s outcome record; returns ``OK``/``ERROR`` once recorded, else None."""
        if rec is not None and rec["status"] == ERROR:
            self._failures[rank] = failure_from_outcome(rank, rec, self.run_dir.log(rank))
            return ERROR
        if rec is not None and rec["status"] == OK:
            self._done[rank] = rec
            return OK
        return None

    def _failure_from_exit(self, rank: int, code: int) -> RankFailure:
        return failure_from_exit(rank, code, self.run_dir.log(rank))

    def _mark_stopped(self, rank: int, reason: str, t_stop: float) -> None:
        """Record that gpufleet stopped ``rank`` before it had an outcome."""
        log = self.run_dir.log(rank)
        self._failures[rank] = RankFailure(
            rank=rank, kind=STOPPED, time=t_stop, message=reason, log_path=str(log), log_tail=tail(log),
        )

    def _first_failure(self) -> RankFailure:
        return min(self._failures.values(), key=lambda f: f.time)

    # -- stopping -------------------------------------------------------------------------
    def cancel(self, reason: str = "canceled by the user", grace_period_s: float | None = None) -> None:
        """Ask the run to stop every rank; ``wait()`` then raises :class:`RunCanceledError`."""
        with self._lock:
            if self.status in TERMINAL_STATES or self._stop_reason:
                return
            self._stop_reason = reason
            self._cancel_grace = grace_period_s
        if not self._watching:
            self._finish_canceled()

    def _finish_canceled(self) -> None:
        grace = self._cancel_grace if self._cancel_grace is not None else self._grace_period_s
        reason = self._stop_reason or "canceled"
        self._stop(reason, grace)
        self._finalize(CANCELED, RunCanceledError, f"the run was canceled ({reason}); every rank was stopped")

    def _finish_failed(self) -> None:
        self._stop(f"stopped by gpufleet after rank {self._first_failure().rank} failed", self._grace_period_s)
        self._finalize(FAILED)

    def _finish_timeout(self) -> None:
        timeout = self._call_timeout_s
        self._stop(
            f"still running at the timeout of {timeout:g} s (its stack at that moment is at the end of its log)",
            self._grace_period_s,
            dump_stacks=True,
        )
        self._finalize(
            TIMEDOUT,
            DistributedTimeoutError,
            f"the call ran past its timeout of {timeout:g} s; every rank was stopped",
        )

    def wait(self) -> list[Any]:
        """Watch the ranks until the end; results in global-rank order, or raise."""
        if self._finished.is_set():
            return self._outcome()
        self._watching = True
        try:
            self._watch()
        except KeyboardInterrupt:
            self._interrupted()
            raise
        finally:
            self._watching = False
        return self._outcome()

    def _interrupted(self) -> None:
        """Stop every rank after a Ctrl-C in the caller (who then re-raises it)."""
        print(f"gpufleet: interrupted; stopping all {self.num_ranks} ranks of run {self.run_id}", file=sys.stderr)
        self._stop_reason = self._stop_reason or "interrupted (KeyboardInterrupt)"
        try:
            self._stop(self._stop_reason, min(2.0, self._grace_period_s))
        finally:
            self._finalize(CANCELED, RunCanceledError, "the run was interrupted; every rank was stopped")

    # -- finishing ------------------------------------------------------------------------
    def _finalize(self, status: str, error_cls: type[WorkerGroupError] | None = None, headline: str = "") -> None:
        with self._lock:
            if self._finished.is_set():
                return
            self._close(status)
            if status == SUCCESS:
                try:
                    self._result = self._load_values()
                except WorkerGroupError as e:
                    status, self._error = FAILED, e
            else:
                self._error = self._build_error(status, error_cls, headline)
            self.status = status
            self._after_finalize()
            self._finished.set()

    def _after_finalize(self) -> None:
        """Tidy up once the outcome is known (called under the lock, before waiters wake)."""

    def _load_values(self) -> list[Any]:
        import cloudpickle

        values = []
        for rank in range(self.num_ranks):
            rec = self._done[rank]
            try:
                values.append(cloudpickle.loads(rec["value"]))
            except Exception as e:
                failure = RankFailure(
                    rank=rank, kind=EXCEPTION, time=rec["time"], exc_type=type(e).__name__,
                    message=f"rank {rank}'s return value could not be unpickled in the caller: {e}",
                    log_path=str(self.run_dir.log(rank)),
                )
                raise WorkerGroupError({rank: failure}, self.num_ranks, str(self.run_dir.path)) from e
        return values

    def _build_error(self, status: str, error_cls: type[WorkerGroupError] | None, headline: str) -> BaseException:
        n = self.num_ranks
        if error_cls is None:
            probe = WorkerGroupError(self._failures, n)
            kind = probe.root_cause.kind if probe.root_cause else EXCEPTION
            error_cls = _ERROR_CLASSES.get(kind, WorkerGroupError)
            headline = self._KIND_HEADLINES.get(kind, headline)
        group = error_cls(self._failures, n, str(self.run_dir.path), headline)
        if status == FAILED:
            return as_original_exception(group)
        return group

    def _outcome(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- inspection -----------------------------------------------------------------------
    def logs(self, rank: int = 0) -> str:
        """Everything rank ``rank`` has printed so far (stdout and stderr)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in 0..{self.num_ranks - 1}, got {rank}")
        path = self.run_dir.log(rank)
        return path.read_text("utf-8", "replace") if path.exists() else ""
