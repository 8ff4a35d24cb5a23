"""Per-rank failure records and the error a caller gets for them.

Turns what a worker group learns (outcome records, exit codes, stops) into
:class:`~gpufleet.errors.RankFailure` records, and a set of records into the error raised in
the caller: the root cause's own exception type (remote traceback attached, the other ranks'
fate in its notes) or a :class:`~gpufleet.errors.WorkerGroupError` subclass.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import (
    EXCEPTION,
    EXIT,
    NO_RESULT,
    SIGNAL,
    STOPPED,
    RankFailure,
    RemoteTraceback,
    WorkerExitError,
    WorkerGroupError,
    WorkerSignalError,
)
from ..results import tail

#: Kind of a rank whose Ray actor or node was lost.
LOST = "lost"

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
_KIND_HEADLINES: dict[str, str] = {
    LOST: "a rank's Ray actor or node was lost; every other rank was stopped",
}


def signal_name(num: int) -> str:
    """The name of signal ``num`` (``SIGKILL``), or ``signal N`` when it has none."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def is_secondary(exc_type: str, message: str) -> bool:
    """True for an error that follows from another rank's failure (a peer closed the link)."""
    return exc_type in SECONDARY_TYPES or bool(SECONDARY_MESSAGES.search(message))


def failure_from_outcome(rank: int, rec: Mapping[str, Any], log_path: Path) -> RankFailure:
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


_OUT_OF_SPACE = re.compile(r"No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]")


def out_of_space(log_tail: str) -> str:
    """What a rank's last lines say of a full disk (the line, and the folder when it names one), or ''."""
    for line in reversed(log_tail.splitlines()):
        if _OUT_OF_SPACE.search(line):
            return f"out of disk space: {line.strip()[:300]}"
    return ""


def failure_from_exit(rank: int, code: int, log_path: Path) -> RankFailure:
    """The failure of a rank that exited with ``code`` without an outcome record."""
    log_tail = tail(log_path)
    common = {
        "rank": rank, "time": time.time(), "log_path": str(log_path), "log_tail": log_tail,
        "message": out_of_space(log_tail),
    }
    if code < 0:
        return RankFailure(kind=SIGNAL, exit_code=code, signal_name=signal_name(-code), **common)
    if code == 0:
        return RankFailure(kind=NO_RESULT, exit_code=0, **common)
    return RankFailure(kind=EXIT, exit_code=code, **common)


def stopped(rank: int, reason: str, when: float, log_path: Path) -> RankFailure:
    """The record of a rank that gpufleet stopped before it had an outcome."""
    return RankFailure(
        rank=rank, kind=STOPPED, time=when, message=reason, log_path=str(log_path), log_tail=tail(log_path)
    )


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


def failed_error(failures: Mapping[int, RankFailure], num_ranks: int, run_dir: str) -> BaseException:
    """The error of a failed run: the root cause's own exception, or the class its kind calls for."""
    probe = WorkerGroupError(dict(failures), num_ranks)
    kind = probe.root_cause.kind if probe.root_cause else EXCEPTION
    error_cls = _ERROR_CLASSES.get(kind, WorkerGroupError)
    group = error_cls(dict(failures), num_ranks, run_dir, _KIND_HEADLINES.get(kind, ""))
    return as_original_exception(group)


def load_values(results: Mapping[int, Mapping[str, Any]], num_ranks: int, run_dir: str, log_of: Any) -> list[Any]:
    """Every rank's return value, in rank order, from its ``ok`` outcome record.

    Raises:
        WorkerGroupError: a value could not be unpickled here (naming the rank).
    """
    import cloudpickle

    values = []
    for rank in range(num_ranks):
        rec = results[rank]
        if rec.get("value") is None:  # a rank with nothing to return (a workload's node command)
            values.append(None)
            continue
        try:
            values.append(cloudpickle.loads(rec["value"]))
        except Exception as e:
            failure = RankFailure(
                rank=rank, kind=EXCEPTION, time=rec.get("time", time.time()), exc_type=type(e).__name__,
                message=f"rank {rank}'s return value could not be unpickled in the caller: {e}",
                log_path=str(log_of(rank)),
            )
            raise WorkerGroupError({rank: failure}, num_ranks, run_dir) from e
    return values
