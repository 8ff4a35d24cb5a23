"""What happens after an attempt that did not succeed: retry, resubmit, or give up, and in what state.

The controller (:mod:`gpufleet.launch.controller`) runs attempts; a :class:`RetryPolicy` decides,
once per ended attempt, what comes next. Calls and workloads differ only in their policy
(:meth:`RetryPolicy.for_call`, :meth:`RetryPolicy.for_workload`), not in the code that acts on it:

- which end states are retried (a call's timeout covers the whole call and is never retried; a
  workload's attempt has a timeout of its own and a timed-out attempt is retried);
- how many retries there are; an attempt that the scheduler preempted (a Slurm job whose nodes a
  job of a higher priority took) is resubmitted without spending one, up to ``max_preemptions``;
- whether a retry needs time left: under a whole-run deadline a retry with less than
  ``min_retry_s`` left is refused;
- the pause before a retry (``backoff_s``, doubled after each retry up to ``max_backoff_s``);
- the run's state when a cancel arrives as a failed attempt ends with retries left: the
  workload's is CANCELED (the cancel, not the failure, ended the run); a call's stays the
  attempt's, so the caller gets the rank's error that ended it.

A decision is a value (:class:`Decision`) computed from what the controller knows; the policy
keeps no state, so asking twice gives the same answer.

Within an attempt, with ``recovery="replace"``, a rank whose *process* died is replaced in place
(:meth:`RetryPolicy.why_not_replace`): the survivors keep their processes and the attempt goes on.
A rank that raised (a bug happens again), a second death of a slot already replaced, several ranks
failing at once, a cancel or an exhausted timeout take the attempt's usual end instead, and with
it the retries above.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import EXIT, NO_RESULT, SIGNAL
from ..states import CANCELED, FAILED, TIMEDOUT, RunState

#: A retry needs at least this much of a whole-run timeout left.
MIN_RETRY_S = 1.0
#: Attempts a run may lose to its scheduler's preemptions (resubmitted without counting as retries).
MAX_PREEMPTIONS = 100


class Action(enum.Enum):
    """What the controller does after an attempt that did not succeed."""

    RETRY = "retry"  # a new attempt, spending one retry
    RESUBMIT = "resubmit"  # a new attempt after a preemption, spending no retry
    GIVE_UP = "give up"  # the run ends in ``Decision.state``


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one ended attempt."""

    action: Action
    #: The run's end state when it gives up (the attempt's own, or CANCELED when a cancel wins).
    state: RunState | None = None
    #: Why, in words: the preemption of a resubmit, or a refused retry that the log should explain.
    reason: str | None = None
    #: Seconds to wait before the next attempt (a cancel ends the wait).
    delay_s: float = 0.0


@dataclass(frozen=True)
class AttemptEnded:
    """What the controller knows when an attempt ends without success."""

    state: RunState
    #: The attempt's number, from 1.
    attempt: int
    #: Attempts before this one that were preempted (they spent no retry).
    preemptions: int = 0
    #: Why the scheduler took the attempt's nodes back, or None: not preempted.
    preempted: str | None = None
    #: Whether a cancel was asked for.
    canceled: bool = False
    #: Seconds left before a whole-run deadline (None: none).
    time_left: float | None = None


@dataclass(frozen=True)
class RankLost:
    """What the controller knows when a rank fails while the others still run."""

    rank: int
    #: The failure's kind (:mod:`gpufleet.errors`): ``signal``, ``exit``, ``no result``, ``exception``...
    kind: str
    #: How the rank ended, in words ("SIGKILL", "exit code 3", "ValueError").
    cause: str
    #: Ranks failed so far in this attempt (this one included).
    failed: int = 1
    #: Replacements of this rank's slot so far in this attempt.
    replacements: int = 0
    canceled: bool = False
    #: Seconds left before the deadline (None: none).
    time_left: float | None = None


#: The failure kinds that are a process's death.
PROCESS_DEATHS = (SIGNAL, EXIT, NO_RESULT)


@dataclass(frozen=True)
class RetryPolicy:
    """When a run gets another attempt (module docstring)."""

    max_retries: int = 0
    retry_on: tuple[RunState, ...] = (FAILED,)
    #: The deadline restarts with every attempt (workloads) instead of covering the whole run (calls).
    timeout_per_attempt: bool = False
    min_retry_s: float = MIN_RETRY_S
    max_preemptions: int = MAX_PREEMPTIONS
    #: A cancel that arrives as a retried attempt ends, with retries left, ends the run CANCELED.
    cancel_wins: bool = False
    #: The pause before the first retry; each further retry waits twice as long, up to ``max_backoff_s``.
    backoff_s: float = 0.0
    max_backoff_s: float = 60.0
    #: "replace": a rank whose process died is replaced in place (:meth:`why_not_replace`); "restart": never.
    recovery: str = "restart"

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.max_preemptions < 0:
            raise ValueError(f"max_retries and max_preemptions must be >= 0, got {self.max_retries}, {self.max_preemptions}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {self.backoff_s}, {self.max_backoff_s}")
        object.__setattr__(self, "retry_on", tuple(RunState(s) for s in self.retry_on))

    @classmethod
    def for_call(cls, max_retries: int, recovery: str = "restart") -> RetryPolicy:
        """A decorated call: a failed attempt is retried within the call's one timeout."""
        return cls(max_retries=max_retries, recovery=recovery)

    @classmethod
    def for_workload(cls, max_attempts: int) -> RetryPolicy:
        """A workload: every end but SUCCESS and CANCELED is retried, each attempt with its own timeout."""
        return cls(max_retries=max_attempts - 1, retry_on=(FAILED, TIMEDOUT), timeout_per_attempt=True,
                   cancel_wins=True)  # fmt: skip

    def retries_used(self, attempt: int, preemptions: int) -> int:
        """Retries spent once attempt ``attempt`` has run (preempted attempts spend none)."""
        return attempt - 1 - preemptions

    def decide(self, ended: AttemptEnded) -> Decision:
        """Retry, resubmit or give up after an attempt that did not succeed."""
        retried = ended.state in self.retry_on
        retries_left = self.max_retries - self.retries_used(ended.attempt, ended.preemptions)
        if ended.canceled:
            if self.cancel_wins and retried and retries_left > 0:
                return Decision(Action.GIVE_UP, CANCELED)
            return Decision(Action.GIVE_UP, ended.state)
        if not retried:
            return Decision(Action.GIVE_UP, ended.state)
        if ended.preempted and ended.preemptions < self.max_preemptions:
            return Decision(Action.RESUBMIT, reason=ended.preempted)
        if retries_left <= 0:
            return Decision(Action.GIVE_UP, ended.state)
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** self.retries_used(ended.attempt, ended.preemptions))
        left = ended.time_left
        if not self.timeout_per_attempt and left is not None and left - delay < self.min_retry_s:
            return Decision(Action.GIVE_UP, ended.state, f"the timeout leaves {max(left, 0.0):.1f} s")
        return Decision(Action.RETRY, delay_s=delay)

    def why_not_replace(self, lost: RankLost) -> str | None:
        """None: replace rank ``lost.rank`` in place; else why not, in words (the attempt then ends as usual)."""
        if self.recovery != "replace":
            return "the run restarts every rank (recovery='restart')"
        if lost.canceled:
            return "the run is being canceled"
        if lost.kind not in PROCESS_DEATHS:
            return f"it raised {lost.cause} (an error of its own happens again; only a process's death is replaced)"
        if lost.failed > 1:
            return "more than one rank failed at once"
        if lost.replacements > 0:
            return f"its slot already failed {lost.replacements} time{'s' if lost.replacements > 1 else ''} in this attempt"
        if lost.time_left is not None and lost.time_left < self.min_retry_s:
            return f"the timeout leaves {max(lost.time_left, 0.0):.1f} s"
        return None
