"""Errors raised by gpufleet, and the per-rank failure record behind them."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

__all__ = [
    "GpufleetError",
    "LaunchConfigError",
    "GPUUnavailableError",
    "PayloadPicklingError",
    "RankFailure",
    "RemoteTraceback",
    "WorkerGroupError",
    "WorkerSignalError",
    "WorkerExitError",
    "DistributedTimeoutError",
    "DistributedHangError",
    "RunCanceledError",
    "SchedulingTimeoutError",
]


class GpufleetError(Exception):
    """Base class of every error gpufleet raises itself."""


class LaunchConfigError(GpufleetError, ValueError):
    """A launch setting or argument is wrong; raised before any process starts."""


class GPUUnavailableError(LaunchConfigError):
    """The GPUs asked for (count or type) are not on this machine."""


class SchedulingTimeoutError(GpufleetError, TimeoutError):
    """A cluster could not give the run the resources it asked for in time (nothing was wrong with the request)."""


class PayloadPicklingError(GpufleetError, pickle.PicklingError):
    """The function or one of its arguments cannot travel to the workers."""


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised inside a worker."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


# Kinds of per-rank failure.
EXCEPTION = "exception"  # the function raised (or its result could not be pickled)
SIGNAL = "signal"  # the process was killed by a signal (OOM killer, segfault, kill -9)
EXIT = "exit"  # the process exited with a non-zero code without an outcome
NO_RESULT = "no_result"  # the process exited 0 but wrote no outcome (os._exit in user code)
STOPPED = "stopped"  # gpufleet stopped the rank because of another rank, a timeout or cancel
HUNG = "hung"  # the hang watchdog found the rank missing from (or mismatched in) a collective


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    kind: str
    time: float
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal_name: str = ""
    log_path: str = ""
    log_tail: str = ""
    secondary: bool = False  # a communication error caused by another rank's failure
    exc_bytes: bytes | None = field(default=None, repr=False)

    def headline(self) -> str:
        """One line that says what happened on this rank."""
        if self.kind == EXCEPTION:
            return f"{self.exc_type}: {self.message}" if self.message else self.exc_type
        why = f" ({self.message})" if self.message else ""
        if self.kind == SIGNAL:
            hint = " (often the out-of-memory killer)" if self.signal_name == "SIGKILL" and not why else why
            return f"killed by signal {self.signal_name}{hint}"
        if self.kind == EXIT:
            return f"process exited with code {self.exit_code} before returning a result{why}"
        if self.kind == NO_RESULT:
            return f"process exited with code 0 without returning a result (os._exit or sys.exit in the function?){why}"
        return self.message or "stopped by gpufleet"

    def group_key(self) -> tuple[str, str, str]:
        return (self.kind, self.exc_type, self.message if self.kind != STOPPED else "")


def _format_ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class WorkerGroupError(GpufleetError):
    """One or more ranks of a run failed.

    Attributes:
        failures: failure record per failed or stopped rank, keyed by global rank.
        root_cause: the earliest real failure (communication errors caused by another
            rank's failure are never chosen while a primary failure exists).
        world_size: number of ranks in the run.
        run_dir: the run directory holding every rank's log.
    """

    def __init__(
        self,
        failures: dict[int, RankFailure],
        world_size: int,
        run_dir: str = "",
        headline: str = "",
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.world_size = world_size
        self.run_dir = run_dir
        self.root_cause = self._pick_root_cause()
        self._headline = headline
        super().__init__(self.summary())

    def _pick_root_cause(self) -> RankFailure | None:
        real = [f for f in self.failures.values() if f.kind != STOPPED]
        primary = [f for f in real if not f.secondary] or real
        if not primary:
            primary = list(self.failures.values())
        return min(primary, key=lambda f: (f.time, f.rank)) if primary else None

    @property
    def rank(self) -> int | None:
        """Global rank of the root cause."""
        return self.root_cause.rank if self.root_cause else None

    def summary(self) -> str:
        """Human-readable report: root cause first, then every other rank's fate, grouped."""
        lines: list[str] = []
        rc = self.root_cause
        if self._headline:
            lines.append(self._headline)
        if rc is not None:
            lines.append(
                f"root cause: rank {rc.rank} of {self.world_size} failed first: {rc.headline()}"
            )
            if rc.log_path:
                lines.append(f"  log: {rc.log_path}")
        groups: dict[tuple[str, str, str], list[RankFailure]] = {}
        for f in self.failures.values():
            if rc is not None and f.rank == rc.rank:
                continue
            groups.setdefault(f.group_key(), []).append(f)
        rc_key = rc.group_key() if rc else None
        for key, members in groups.items():
            same = " (same error as the root cause)" if key == rc_key else ""
            lines.append(f"  {_format_ranks([m.rank for m in members])}: {members[0].headline()}{same}")
        ok = self.world_size - len(self.failures)
        if ok > 0:
            lines.append(f"  {ok} other rank(s) finished normally")
        if rc is not None and rc.kind in (SIGNAL, EXIT, NO_RESULT) and rc.log_tail:
            lines.append(f"  last lines of rank {rc.rank}'s log:")
            lines.extend("    | " + line for line in rc.log_tail.rstrip().splitlines())
        if self.run_dir:
            lines.append(f"  run directory: {self.run_dir}")
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (self.failures, self.world_size, self.run_dir, self._headline))


class WorkerSignalError(WorkerGroupError):
    """A rank was killed by a signal (out-of-memory killer, segfault, kill)."""


class WorkerExitError(WorkerGroupError):
    """A rank's process exited without returning a result."""


class DistributedTimeoutError(WorkerGroupError, TimeoutError):
    """The call ran past its timeout; every rank was stopped."""


class DistributedHangError(DistributedTimeoutError):
    """No rank made progress for ``hang_timeout`` seconds; the error names the rank missing from
    the collective the others wait in (or the mismatched collectives) and where each rank was."""


class RunCanceledError(WorkerGroupError):
    """The run was canceled (``cancel()``, Ctrl-C or a notebook interrupt)."""
