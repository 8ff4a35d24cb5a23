"""The account of each in-place recovery of a run (``recovery="replace"``): one record per lost rank.

The controller makes a :class:`Recovery` when it decides about a rank whose process died while
the others ran (:meth:`gpufleet.launch.controller.Controller._replaced`), and updates it as the
recovery goes on; each change goes to the callbacks' ``on_recovery`` hook, which the run store
(the attempt's ``recoveries``, ``gpufleet get``) and MLflow (a tag and metrics per recovery) keep.
A recovery is:

- ``replacing``: a new process took the rank; the ranks join the group's next generation;
- ``recovered``: the replacement completed its first step after the join (``resumed_step`` + 1):
  ``seconds_lost`` is the time from the death to that step, ``steps_lost`` the steps some rank
  had completed and trains again;
- ``failed``: the attempt ended before that (the join raised, another rank died, a cancel);
  ``reason`` says how;
- ``refused``: not replaced (a Python exception, a second death of the slot...): ``reason`` says
  why; the attempt ends and the retries take over, as without recovery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["FAILED", "RECOVERED", "REFUSED", "REPLACING", "Recovery"]

REPLACING = "replacing"
RECOVERED = "recovered"
FAILED = "failed"
REFUSED = "refused"


@dataclass(frozen=True)
class Recovery:
    """One lost rank of an attempt and what became of it (module docstring)."""

    attempt: int
    #: The recovery's number in its attempt, from 1.
    number: int
    rank: int
    #: How the rank's process ended, in words ("SIGKILL", "exit code 3", "ValueError").
    cause: str
    outcome: str
    #: When the launcher saw the death (seconds since the epoch).
    died_at: float
    old_pid: int | None = None
    new_pid: int | None = None
    #: The new process was a warm spare (imports done), not one started cold.
    warm: bool = False
    #: The process group's generation the replacement joined.
    generation: int | None = None
    #: The step every rank went on from (the last one all of them completed).
    resumed_step: int | None = None
    steps_lost: int | None = None
    #: When the replacement completed its first step after the join.
    recovered_at: float | None = None
    seconds_lost: float | None = None
    #: Why it was refused, or how it failed.
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, stored: Any) -> Recovery | None:
        """A record read back from the run store (None for anything that is not one)."""
        if not isinstance(stored, dict):
            return None
        try:
            return cls(**{f.name: stored[f.name] for f in fields(cls) if f.name in stored})
        except TypeError:  # a field it must have is missing
            return None

    def recovered(self, resumed_step: int, steps_lost: int, at: float) -> Recovery:
        return replace(self, outcome=RECOVERED, resumed_step=resumed_step, steps_lost=steps_lost, recovered_at=at,
                       seconds_lost=max(0.0, at - self.died_at))  # fmt: skip

    def failed(self, reason: str) -> Recovery:
        return replace(self, outcome=FAILED, reason=reason)

    def describe(self) -> str:
        """One line: what happened to the rank (the caller's line, the MLflow tag, ``gpufleet get``)."""
        if self.outcome == REPLACING:
            by = "a warm spare" if self.warm else "a new process"
            return (f"rank {self.rank} died ({self.cause}); replaced in place by {by} (pid {self.new_pid}); "
                    "the other ranks go on")  # fmt: skip
        if self.outcome == RECOVERED:
            lost = f"{self.steps_lost} step{'' if self.steps_lost == 1 else 's'}"
            return (f"rank {self.rank} ({self.cause}) is back: every rank went on after step {self.resumed_step}, "
                    f"{self.seconds_lost:.2f} s after the death; {lost} trained again (pid {self.old_pid} -> "
                    f"{self.new_pid})")  # fmt: skip
        if self.outcome == FAILED:
            return f"rank {self.rank} ({self.cause}): the recovery in place failed: {self.reason}"
        return f"rank {self.rank} failed ({self.cause}); not replaced in place: {self.reason}"
