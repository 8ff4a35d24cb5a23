"""The controller: runs a worker group's attempts to an outcome.

One loop for every launcher. It owns what no worker group decides for itself: the deadline,
the settle window after a first failure (so identical errors on several ranks are grouped and
a secondary error does not hide the root cause), cancel and Ctrl-C, failure classification, and
the tracking hooks (:class:`ControllerCallback`). What follows an attempt that did not succeed
(a retry, a resubmit after a preemption, or the run's end and its state) is its
:class:`~gpufleet.launch.policy.RetryPolicy`'s decision, which the controller carries out. A
worker group only starts, polls and stops (:mod:`gpufleet.launch.group`).

Within an attempt, a rank whose process died is replaced in place when the policy agrees
(``recovery="replace"``, :meth:`~gpufleet.launch.policy.RetryPolicy.why_not_replace`); the
group starts the new process and tells the survivors. Each such decision and its end is a
:class:`~gpufleet.launch.recoveries.Recovery`, told to the caller in a line and to the hooks.

One concern past 400 lines: the decisions over a group's life (deadline, settle, cancel,
Ctrl-C, hang watchdog, replacements, retries, hooks), kept in one loop so that their order is seen at once.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import (
    HUNG,
    DistributedHangError,
    DistributedTimeoutError,
    RankFailure,
    RunCanceledError,
    WorkerGroupError,
)
from ..states import CANCEL_REASON, CANCELED, FAILED, PENDING, RUNNING, SUCCESS, TIMEDOUT, RunState
from .failures import failed_error, load_values
from .group import GroupStartCanceled, GroupStatus, WorkerGroup
from .hangwatch.watchdog import HangSettings, Verdict, Watchdog, write_note
from .policy import Action, AttemptEnded, Decision, RankLost, RetryPolicy
from .recoveries import REFUSED, REPLACING, Recovery

logger = logging.getLogger(__name__)

#: How long the other ranks may still report after a first failure.
SETTLE_S = 1.0
#: Why a run stopped by a Ctrl-C (a notebook interrupt) in its caller was stopped.
INTERRUPTED = "interrupted (KeyboardInterrupt)"

_active: weakref.WeakSet[Controller] = weakref.WeakSet()


@atexit.register
def _stop_active() -> None:
    """A caller that exits stops its runs (a submitted run must not outlive it unseen), saying so on stderr."""
    for controller in list(_active):
        if not controller.finished.is_set():
            print(exiting_message(controller), file=sys.stderr, flush=True)
        controller.cancel("the calling process is exiting", grace_period_s=1.0)
    for controller in list(_active):
        controller.finished.wait(5.0)


def exiting_message(controller: Controller) -> str:
    """What a program that ends with a run still going prints: the run, and how to keep it."""
    group = controller.group
    run_id = group.run_id if group is not None else "(not started yet)"
    return (
        f"gpufleet: the program is exiting while run {run_id} is still {controller.state}; stopping every rank "
        "of it now. To let it finish, wait for it before the program ends (`handle.result()`), or start it "
        "with `submit(..., detach=True)`: it then runs on without this process (follow it with "
        "`gpufleet logs RUN_ID --follow`)."
    )


class ControllerCallback:
    """Hooks around each attempt (tracking uses them); every method is optional.

    An exception raised by a hook is logged and never changes the run's outcome.
    """

    def attach(self, controller: Controller) -> None:
        """The controller this callback serves (made once, before any attempt): e.g. to cancel it."""

    def before_start(self, group: WorkerGroup, attempt: int) -> None:
        """The group exists and has not started: it still takes environment (``add_env``, or ``defer_env``)."""

    def after_start(self, group: WorkerGroup, attempt: int) -> None:
        """The group started (a Ray group knows its size now)."""

    def on_running(self, group: WorkerGroup, attempt: int) -> None:
        """The ranks run: right after :meth:`after_start` for a group that starts them at once (local),
        at the first poll that finds them running for one that places them later (Ray, Slurm)."""

    def on_end(self, group: WorkerGroup, attempt: int, state: RunState, error: BaseException | None) -> None:
        """The attempt ended in ``state``; ``error`` is what the caller gets for it, if any."""

    def on_watch(self, group: WorkerGroup, attempt: int, note: str | None) -> None:
        """The hang watchdog's note changed: why a stall is not called a hang yet (None: moving again).

        Called on a thread of its own: a slow hook never delays the watchdog.
        """

    def on_recovery(self, group: WorkerGroup, attempt: int, recovery: Recovery) -> None:
        """A lost rank was replaced in place or refused, or its recovery ended (``recovery.outcome``)."""


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended: its state, the values (on success) or the error."""

    state: RunState
    values: list[Any] | None = None
    error: BaseException | None = None
    status: GroupStatus | None = None


class Controller:
    """Runs attempts of one worker group until one succeeds or no retry is left.

    Args:
        make_group: builds the worker group of attempt ``n`` (not started). Attempts are numbered
            from 1, for calls and workloads alike (``GPUFLEET_ATTEMPT``, the run store, MLflow).
        timeout_s: seconds for the whole run (or for each attempt, when the policy's
            ``timeout_per_attempt`` says so); None for no limit.
        grace_period_s: how long ranks may take to stop after SIGTERM.
        policy: what follows an attempt that did not succeed (default: no retry).
        callbacks: hooks around each attempt.
        timeout_subject: how the timeout error names what ran out of time ("the call").
        hang_timeout_s: the hang watchdog's long limit: stop the attempt with a diagnosis once no
            rank made progress (collectives, steps) for this long; None: off. It arms once a rank
            has reported progress (a process group, or a step). In the steady state a clear hang
            is called sooner, after a limit learned from the run (:mod:`gpufleet.launch.hangwatch.watchdog`).
        poll_s: how long one poll may wait for news.
        settle_s: how long the other ranks may report after a first failure.
        clock: a monotonic clock (tests pass a fake one).
    """

    def __init__(
        self,
        make_group: Callable[[int], WorkerGroup],
        *,
        timeout_s: float | None,
        grace_period_s: float = 5.0,
        policy: RetryPolicy | None = None,
        callbacks: Sequence[ControllerCallback] = (),
        timeout_subject: str = "the call",
        hang_timeout_s: float | None = None,
        poll_s: float = 0.02,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_group = make_group
        self._timeout_s = timeout_s
        self._grace_period_s = grace_period_s
        self.policy = policy or RetryPolicy()
        self._callbacks = list(callbacks)
        self._timeout_subject = timeout_subject
        self._hang_timeout_s = hang_timeout_s
        self.watchdog: Watchdog | None = None
        if hang_timeout_s is not None:
            self.watchdog = Watchdog(HangSettings.from_env(hang_timeout_s), clock=clock)
        self._poll_s = poll_s
        self._settle_s = settle_s
        self._clock = clock
        self._deadline: float | None = None if timeout_s is None else clock() + timeout_s
        self._cancel: tuple[str, float | None] | None = None
        self._interrupted_by: str | None = None  # a Ctrl-C in the caller (not a cancel)
        self._cancel_asked = threading.Event()  # ends a pause between attempts
        self._lock = threading.Lock()
        self.attempt = 1
        self.group: WorkerGroup | None = None
        self.state: RunState = PENDING
        self.finished = threading.Event()
        self.values: list[Any] | None = None
        self.error: BaseException | None = None
        self.outcomes: list[AttemptOutcome] = []
        self.preemptions = 0  # attempts the scheduler preempted (a group's ``preempted`` said why)
        #: The current attempt's last polled status (frozen; read by the live view from its own thread).
        self.status: GroupStatus | None = None
        #: Every lost rank's recovery in place (or its refusal), of every attempt, in order.
        self.recoveries: list[Recovery] = []
        for callback in self._callbacks:
            try:
                getattr(callback, "attach", lambda _: None)(self)
            except Exception as e:  # a hook never stops a run
                logger.warning("attach hook of %s failed: %s", type(callback).__name__, e)

    # -- public ---------------------------------------------------------------------------
    def add_callback(self, callback: ControllerCallback) -> None:
        """One more hook around each attempt (before the first one starts)."""
        self._callbacks.append(callback)
        callback.attach(self)

    def start(self) -> WorkerGroup:
        """Start the first attempt now (a wrong setting raises here, before anything runs)."""
        _active.add(self)
        try:
            return self._begin_attempt()
        except BaseException as e:
            self._end(CANCELED if isinstance(e, RunCanceledError) else FAILED, None, e)
            raise

    def run(self) -> list[Any]:
        """Watch attempts to the end: every rank's value in rank order, or raise the run's error.

        A ``KeyboardInterrupt`` stops every rank, ends the run CANCELED and is raised again.
        """
        if self.finished.is_set():
            return self.outcome()
        if self.group is None:
            self.start()
        try:
            while True:
                assert self.group is not None
                result = self._watch(self.group)
                self._close_recoveries(self.group, result.error)
                self.outcomes.append(result)
                self._notify_end(self.group, result.state, result.error)
                if result.state == SUCCESS:
                    self._end(SUCCESS, result.values, None)
                    return result.values  # type: ignore[return-value]
                decision = self._decide(result.state)
                if decision.action is Action.GIVE_UP:
                    assert decision.state is not None
                    self._end(decision.state, None, result.error)
                    raise result.error  # type: ignore[misc]
                self._next_attempt(result.state, decision)
                try:
                    self._begin_attempt()
                except BaseException as e:
                    self._end(CANCELED if isinstance(e, RunCanceledError) else FAILED, None, e)
                    raise
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def cancel(self, reason: str = CANCEL_REASON, grace_period_s: float | None = None) -> None:
        """Ask the run to stop every rank; :meth:`run` then ends CANCELED."""
        with self._lock:
            if self.finished.is_set() or self._cancel is not None:
                return
            self._cancel = (reason, grace_period_s)
        self._cancel_asked.set()
        group = self.group
        if group is not None:
            group.abort.set()

    @property
    def canceled(self) -> bool:
        """Whether a cancel was asked for."""
        return self._cancel is not None

    @property
    def cancel_reason(self) -> str | None:
        """Why the run was stopped by someone (a cancel's reason, a Ctrl-C), or None: what the store says of it."""
        return self._cancel[0] if self._cancel is not None else self._interrupted_by

    def outcome(self) -> list[Any]:
        """The values of a finished run, or its error raised."""
        if self.error is not None:
            raise self.error
        assert self.values is not None
        return self.values

    def time_left(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        return None if self._deadline is None else self._deadline - self._clock()

    # -- attempts -------------------------------------------------------------------------
    def _begin_attempt(self) -> WorkerGroup:
        """Make and start the next attempt's group.

        Raises:
            RunCanceledError: the group gave up starting because of a cancel.
            Exception: whatever the group's start raised (a wrong setting, say).
        """
        group = self._make_group(self.attempt)
        self.group = group
        if self._cancel is not None:
            group.abort.set()
        self.state = PENDING
        self._call_hooks("before_start", group)
        try:
            group.start()
        except GroupStartCanceled as e:
            group.close(False)
            reason = self._cancel[0] if self._cancel else str(e)
            error = RunCanceledError(
                {}, group.num_ranks, str(group.run_dir.path), f"the run was canceled ({reason}) before its ranks started"
            )
            self._notify_end(group, CANCELED, error)
            raise error from e
        except KeyboardInterrupt:  # Ctrl-C while the ranks start: the run is canceled, as after they started
            group.close(False)
            self._interrupted_by = f"{INTERRUPTED} before its ranks started"
            error = RunCanceledError(
                {}, group.num_ranks, str(group.run_dir.path), "the run was interrupted before its ranks started"
            )
            self._notify_end(group, CANCELED, error)
            self._end(CANCELED, None, error)
            raise
        except BaseException as e:
            group.close(False)
            self._notify_end(group, FAILED, e)
            raise
        if self.policy.timeout_per_attempt and self._timeout_s is not None:
            self._deadline = self._clock() + self._timeout_s  # an attempt's own time starts with its ranks
        if group.starts_at_once:
            self.state = RUNNING
        self._call_hooks("after_start", group)
        if group.starts_at_once:
            self._call_hooks("on_running", group)
        return group

    def _watch(self, group: WorkerGroup) -> AttemptOutcome:
        """Poll the group until its attempt has an outcome."""
        if self.watchdog is not None:
            self.watchdog.reset()
        try:
            while True:
                if self._cancel is not None:
                    return self._canceled(group)
                status = group.poll(self._poll_s)
                self.status = status
                if status.started and self.state == PENDING:
                    self.state = RUNNING
                    self._call_hooks("on_running", group)
                if self._cancel is not None:  # asked during the poll (a lost node, say): the cancel wins
                    return self._canceled(group)
                if status.failures:
                    if self._replaced(group, status):
                        continue
                    return self._failed(group, status)
                if self.recoveries:
                    self._take_recovered(group)
                if status.succeeded:
                    group.close(True)
                    try:
                        values = load_values(status.results, status.num_ranks, str(group.run_dir.path), group.log_path)
                    except WorkerGroupError as e:
                        return AttemptOutcome(FAILED, error=e, status=status)
                    return AttemptOutcome(SUCCESS, values=values, status=status)
                left = self.time_left()
                if left is not None and left <= 0:
                    return self._timed_out(group)
                verdict = self._watch_progress(group, status)
                if verdict is not None:
                    return self._hung(group, verdict)
        except GroupStartCanceled:
            return self._canceled(group)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # the launcher itself broke (a lost cluster connection, say)
            status = group.stop(f"stopped because the launcher failed: {e}", 1.0)
            group.close(False)
            error = WorkerGroupError(
                dict(status.failures), status.num_ranks, str(group.run_dir.path),
                f"the launcher failed: {type(e).__name__}: {e}",
            )
            error.__cause__ = e
            return AttemptOutcome(FAILED, error=error, status=status)

    def _watch_progress(self, group: WorkerGroup, status: GroupStatus) -> Verdict | None:
        """The hang watchdog's look at this poll; what it sees meanwhile goes to the run folder."""
        if self.watchdog is None:
            return None
        note = self.watchdog.note
        verdict = self.watchdog.check(status, group)
        if self.watchdog.note != note:
            write_note(group.run_dir.path, self.watchdog.note)
            threading.Thread(target=self._call_hooks, args=("on_watch", group, self.watchdog.note),
                             name="gpufleet-watch-note", daemon=True).start()  # fmt: skip
        return verdict

    def _hung(self, group: WorkerGroup, verdict: Verdict) -> AttemptOutcome:
        """Report the hang (diagnosed with stacks and each rank's activity), then stop every rank."""
        found, idle = verdict.found, verdict.idle_s
        report = group.run_dir.path / "hang-report.txt"
        try:
            report.write_text(found.report)
        except OSError:
            pass
        when = time.time()
        status = group.stop(f"stopped by the hang watchdog after {idle:.0f} s without progress", self._grace_period_s)
        group.close(False)
        failures = dict(status.failures)
        for rank, what in found.missing.items():  # blamed: the root cause is the rank that never came
            failures[rank] = RankFailure(rank=rank, kind=HUNG, time=when - 1.0, message=what,
                                         log_path=str(group.log_path(rank)))  # fmt: skip
        for rank, what in found.waiting.items():
            if rank in failures and failures[rank].kind != HUNG:
                failures[rank] = RankFailure(rank=rank, kind="stopped", time=when, message=what,
                                             log_path=str(group.log_path(rank)))  # fmt: skip
        headline = "\n".join([f"{self._timeout_subject} hung: " + found.summary[0], *found.summary[1:],
                              f"  full report (last collectives, every rank's stacks): {report}"])  # fmt: skip
        error = DistributedHangError(failures, status.num_ranks, str(group.run_dir.path), headline)
        return AttemptOutcome(TIMEDOUT, error=error, status=status)

    def _replaced(self, group: WorkerGroup, status: GroupStatus) -> bool:
        """With ``recovery="replace"``: a rank whose process died gets a new one in place, when the
        policy agrees; True if it did (the attempt goes on). Either way the caller hears it in one line
        and the hooks get the :class:`Recovery`."""
        if not group.replaces_ranks:
            return False
        first = status.first_failure()
        assert first is not None
        cause = first.signal_name or first.exc_type or (f"exit code {first.exit_code}" if first.exit_code else first.kind)
        replacements = getattr(group, "replacements", {})
        lost = RankLost(first.rank, first.kind, cause, failed=len(status.failures),
                        replacements=replacements.get(first.rank, 0),
                        canceled=self._cancel is not None, time_left=self.time_left())  # fmt: skip
        why_not = self.policy.why_not_replace(lost)
        old_pid = group.pids[first.rank] if first.rank < len(group.pids) else None
        number = sum(1 for r in self.recoveries if r.attempt == self.attempt) + 1
        record = Recovery(self.attempt, number, first.rank, cause, REPLACING, first.time, old_pid=old_pid)
        if why_not is None:
            try:
                new = group.replace(first.rank, cause)
            except Exception as e:  # noqa: BLE001 - no process can take the slot: the attempt ends as without recovery
                logger.debug("run %s: rank %d could not be replaced", group.run_id, first.rank, exc_info=True)
                why_not = f"no process could take its place ({type(e).__name__}: {e})"
        if why_not is not None:
            group.refuse_replacement(first.rank, cause, why_not)
            self._recovery(group, dataclasses.replace(record, outcome=REFUSED, reason=why_not))
            return False
        self._recovery(group, dataclasses.replace(record, new_pid=new.pid, warm=new.warm,
                                                  generation=sum(replacements.values())))  # fmt: skip
        return True

    def _recovery(self, group: WorkerGroup, record: Recovery) -> None:
        """Keep ``record`` (in place of the same recovery's older state), tell the caller and the hooks."""
        for i, known in enumerate(self.recoveries):
            if (known.attempt, known.number) == (record.attempt, record.number):
                self.recoveries[i] = record
                break
        else:
            self.recoveries.append(record)
        print(f"gpufleet: run {group.run_id}: {record.describe()}", file=sys.stderr, flush=True)
        self._call_hooks("on_recovery", group, record)

    def _take_recovered(self, group: WorkerGroup) -> None:
        """The replacements that said they are back: their recoveries end ``recovered``."""
        for report in group.recovered():
            for record in self.recoveries:
                if (record.attempt, record.outcome, record.generation) == (self.attempt, REPLACING, report.generation):
                    self._recovery(group, record.recovered(report.resumed_step, report.steps_lost, report.at))

    def _close_recoveries(self, group: WorkerGroup, error: BaseException | None) -> None:
        """The attempt ended: a recovery not yet back failed with it (why: the attempt's error)."""
        self._take_recovered(group)
        for record in list(self.recoveries):
            if record.attempt == self.attempt and record.outcome == REPLACING:
                headline = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""
                why = f"{type(error).__name__}: {headline}" if error is not None else "the attempt ended first"
                self._recovery(group, record.failed(f"the attempt ended before the rank was back ({why})"))

    def _failed(self, group: WorkerGroup, status: GroupStatus) -> AttemptOutcome:
        # Let the other ranks report for a moment: the same error on several ranks is then
        # grouped, and a secondary error does not hide the root cause.
        settle_until = self._clock() + self._settle_s
        while self._clock() < settle_until and not status.finished and self._cancel is None:
            status = group.poll(self._poll_s)
        first = status.first_failure()
        assert first is not None
        status = group.stop(f"stopped by gpufleet after rank {first.rank} failed", self._grace_period_s)
        group.close(False)
        error = failed_error(status.failures, status.num_ranks, str(group.run_dir.path))
        return AttemptOutcome(FAILED, error=error, status=status)

    def _canceled(self, group: WorkerGroup) -> AttemptOutcome:
        reason, grace = self._cancel or ("canceled", None)
        status = group.stop(reason, self._grace_period_s if grace is None else grace)
        group.close(False)
        error = RunCanceledError(
            dict(status.failures), status.num_ranks, str(group.run_dir.path),
            f"the run was canceled ({reason}); every rank was stopped",
        )
        return AttemptOutcome(CANCELED, error=error, status=status)

    def _timed_out(self, group: WorkerGroup) -> AttemptOutcome:
        timeout = self._timeout_s or 0.0
        status = group.stop(
            f"still running at the timeout of {timeout:g} s (its stack at that moment is at the end of its log)",
            self._grace_period_s,
            dump_stacks=True,
        )
        group.close(False)
        error = DistributedTimeoutError(
            dict(status.failures), status.num_ranks, str(group.run_dir.path),
            f"{self._timeout_subject} ran past its timeout of {timeout:g} s; every rank was stopped",
        )
        return AttemptOutcome(TIMEDOUT, error=error, status=status)

    def _interrupted(self) -> None:
        """Stop every rank after a Ctrl-C in the caller (who then re-raises it)."""
        group = self.group
        if self.finished.is_set() or group is None:
            return
        print(f"gpufleet: interrupted; stopping all {group.num_ranks} ranks of run {group.run_id}", file=sys.stderr)
        reason = self._interrupted_by = INTERRUPTED
        status: GroupStatus | None = None
        try:
            try:
                status = group.stop(reason, min(2.0, self._grace_period_s))
            except KeyboardInterrupt:  # a second Ctrl-C: no more grace
                status = group.stop(reason, 0.0)
                raise
        finally:
            group.close(False)
            error = RunCanceledError(
                dict(status.failures) if status else {}, group.num_ranks, str(group.run_dir.path),
                "the run was interrupted; every rank was stopped",
            )
            self._close_recoveries(group, error)
            self._notify_end(group, CANCELED, error)
            self._end(CANCELED, None, error)

    def _decide(self, state: RunState) -> Decision:
        """The policy's decision on the attempt that just ended (logged when it refuses a retry for a reason)."""
        group = self.group
        decision = self.policy.decide(AttemptEnded(
            state, self.attempt, self.preemptions, getattr(group, "preempted", None) or None,
            self._cancel is not None, self.time_left(),
        ))  # fmt: skip
        if decision.action is Action.GIVE_UP and decision.reason:
            run_id = group.run_id if group else "?"
            logger.warning("run %s ended %s and is not retried: %s", run_id, state, decision.reason)
        return decision

    def _next_attempt(self, state: RunState, decision: Decision) -> None:
        """Count the attempt that ended and say why another one comes; wait out the policy's pause."""
        run_id = self.group.run_id if self.group else "?"
        if decision.action is Action.RESUBMIT:
            self.preemptions += 1  # the scheduler took the nodes back: resubmit, not a failure of the run
            logger.warning("run %s: %s; resubmitted (preemption %d of at most %d; no retry spent)",
                           run_id, decision.reason, self.preemptions, self.policy.max_preemptions)  # fmt: skip
        else:
            used = self.policy.retries_used(self.attempt, self.preemptions) + 1
            logger.warning("run %s ended %s; retry %d of %d%s", run_id, state, used, self.policy.max_retries,
                           f" in {decision.delay_s:g} s" if decision.delay_s else "")  # fmt: skip
        self.attempt += 1
        if decision.delay_s > 0:
            self._cancel_asked.wait(decision.delay_s)  # a cancel ends the pause; the next start then sees it

    # -- ending ---------------------------------------------------------------------------
    def _end(self, state: RunState, values: list[Any] | None, error: BaseException | None) -> None:
        with self._lock:
            if self.finished.is_set():
                return
            self.state, self.values, self.error = state, values, error
            self.finished.set()
        _active.discard(self)

    def _notify_end(self, group: WorkerGroup, state: RunState, error: BaseException | None) -> None:
        self._call_hooks("on_end", group, state, error)

    def _call_hooks(self, name: str, group: WorkerGroup, *args: Any) -> None:
        for callback in self._callbacks:
            try:
                hook = getattr(callback, name, None)
                if hook is None:
                    continue  # a callback that does not subclass ControllerCallback, written before the hook
                hook(group, self.attempt, *args)  # type: ignore[misc]
            except Exception as e:  # tracking trouble never changes the run's outcome
                logger.warning("run %s: %s hook of %s failed: %s", group.run_id, name, type(callback).__name__, e)
