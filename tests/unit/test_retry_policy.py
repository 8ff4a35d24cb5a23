"""The retry policy's decisions, and the controller carrying them out against scripted groups (no processes)."""

from __future__ import annotations

import threading
import time

import pytest

from gpufleet.errors import DistributedHangError, RunCanceledError, WorkerExitError
from gpufleet.launch.hangwatch.diagnosis import Diagnosis
from gpufleet.launch.hangwatch.watchdog import Verdict
from gpufleet.launch.policy import Action, AttemptEnded, Decision, RetryPolicy
from gpufleet.states import CANCELED, FAILED, SUCCESS, TIMEDOUT
from tests.unit.test_controller import FakeGroup, exited, make, ok

CALL = RetryPolicy.for_call(max_retries=2)
WORKLOAD = RetryPolicy.for_workload(max_attempts=3)
PREEMPTED = "preempted: Slurm signaled job 7 to stop"


@pytest.mark.parametrize(
    ("policy", "ended", "expected"),
    [
        # a failed attempt is retried while retries are left
        (CALL, AttemptEnded(FAILED, attempt=1), Decision(Action.RETRY)),
        (CALL, AttemptEnded(FAILED, attempt=2), Decision(Action.RETRY)),
        (CALL, AttemptEnded(FAILED, attempt=3), Decision(Action.GIVE_UP, FAILED)),
        # a call's timeout covers the whole call: never retried; a workload's attempt has its own
        (CALL, AttemptEnded(TIMEDOUT, attempt=1), Decision(Action.GIVE_UP, TIMEDOUT)),
        (WORKLOAD, AttemptEnded(TIMEDOUT, attempt=1), Decision(Action.RETRY)),
        (WORKLOAD, AttemptEnded(TIMEDOUT, attempt=3), Decision(Action.GIVE_UP, TIMEDOUT)),
        # a preemption spends no retry, even with none left, up to max_preemptions
        (CALL, AttemptEnded(FAILED, attempt=3, preempted=PREEMPTED), Decision(Action.RESUBMIT, reason=PREEMPTED)),
        (RetryPolicy(max_preemptions=2), AttemptEnded(FAILED, attempt=3, preemptions=2, preempted=PREEMPTED),
         Decision(Action.GIVE_UP, FAILED)),
        # attempts that were preempted do not count as retries
        (CALL, AttemptEnded(FAILED, attempt=5, preemptions=3), Decision(Action.RETRY)),
        (CALL, AttemptEnded(FAILED, attempt=6, preemptions=3), Decision(Action.GIVE_UP, FAILED)),
        # under a whole-call deadline a retry needs a second left; a workload's deadline is per attempt
        (CALL, AttemptEnded(FAILED, attempt=1, time_left=0.4),
         Decision(Action.GIVE_UP, FAILED, "the timeout leaves 0.4 s")),
        (CALL, AttemptEnded(FAILED, attempt=1, time_left=1.5), Decision(Action.RETRY)),
        (WORKLOAD, AttemptEnded(FAILED, attempt=1, time_left=0.0), Decision(Action.RETRY)),
        # a cancel: never a retry; a workload's run ends CANCELED while attempts were left, a call's keeps its error
        (CALL, AttemptEnded(FAILED, attempt=1, canceled=True), Decision(Action.GIVE_UP, FAILED)),
        (WORKLOAD, AttemptEnded(FAILED, attempt=1, canceled=True), Decision(Action.GIVE_UP, CANCELED)),
        (WORKLOAD, AttemptEnded(TIMEDOUT, attempt=2, canceled=True), Decision(Action.GIVE_UP, CANCELED)),
        (WORKLOAD, AttemptEnded(FAILED, attempt=3, canceled=True), Decision(Action.GIVE_UP, FAILED)),
        (WORKLOAD, AttemptEnded(CANCELED, attempt=1, canceled=True), Decision(Action.GIVE_UP, CANCELED)),
        (WORKLOAD, AttemptEnded(FAILED, attempt=1, preempted=PREEMPTED, canceled=True), Decision(Action.GIVE_UP, CANCELED)),
        # the pause before a retry doubles, up to its cap, and counts against a whole-call deadline
        (RetryPolicy(max_retries=5, backoff_s=2.0), AttemptEnded(FAILED, attempt=1), Decision(Action.RETRY, delay_s=2.0)),
        (RetryPolicy(max_retries=5, backoff_s=2.0), AttemptEnded(FAILED, attempt=3), Decision(Action.RETRY, delay_s=8.0)),
        (RetryPolicy(max_retries=9, backoff_s=2.0, max_backoff_s=10.0), AttemptEnded(FAILED, attempt=6),
         Decision(Action.RETRY, delay_s=10.0)),
        (RetryPolicy(max_retries=5, backoff_s=2.0), AttemptEnded(FAILED, attempt=1, time_left=2.5),
         Decision(Action.GIVE_UP, FAILED, "the timeout leaves 2.5 s")),
    ],
)
def test_decisions(policy: RetryPolicy, ended: AttemptEnded, expected: Decision) -> None:
    assert policy.decide(ended) == expected
    assert policy.decide(ended) == expected  # no state: the same question, the same answer


def test_a_policy_refuses_what_cannot_be_meant() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="backoff_s"):
        RetryPolicy(backoff_s=-1.0)
    with pytest.raises(ValueError, match="'DONE' is not a valid RunState"):
        RetryPolicy(retry_on=("DONE",))


FAIL = [[exited(0, 1, t=1.0), exited(1, 1, t=1.0)]]


def _failing_while_canceled(tmp_path, clock, controller_box):
    """An attempt whose ranks failed, and the run is canceled while the controller stops them."""
    class Group(FakeGroup):
        def stop(self, reason, grace_period_s, dump_stacks=False):
            controller_box[0].cancel("canceled by the user")
            return super().stop(reason, grace_period_s, dump_stacks)
    return Group(tmp_path, clock, FAIL)


@pytest.mark.parametrize(("policy", "state"), [("workload", CANCELED), ("call", FAILED)])
def test_a_cancel_as_an_attempt_fails_ends_a_workload_canceled_and_a_call_failed(tmp_path, policy, state) -> None:
    box: list = []
    kwargs = dict(max_retries=2, retry_on=(FAILED, TIMEDOUT), timeout_per_attempt=True, cancel_wins=True) \
        if policy == "workload" else dict(max_retries=2)  # fmt: skip
    c, groups, _ = make(tmp_path, [lambda p, clock: _failing_while_canceled(p, clock, box), []], **kwargs)
    box.append(c)
    with pytest.raises(WorkerExitError):  # what the attempt raised: the rank's exit
        c.run()
    assert c.state == state and len(groups) == 1  # no retry either way


class _HangsOnce:
    """A watchdog that calls the first attempt hung at its third poll, and never the second."""

    def __init__(self) -> None:
        self.polls = 0
        self.note = None

    def reset(self) -> None:
        self.polls = 0

    def check(self, status, group):
        self.polls += 1
        if getattr(group, "hangs", False) and self.polls >= 3:
            found = Diagnosis(summary=["rank 1 never reached all_reduce #4"], missing={1: "never reached all_reduce #4"},
                              waiting={0: "waits in all_reduce #4"}, report="report")  # fmt: skip
            return Verdict(idle_s=30.0, fast=True, found=found)
        return None


@pytest.mark.parametrize(("policy", "attempts"), [("workload", 2), ("call", 1)])
def test_a_hang_is_retried_by_a_workload_not_by_a_call(tmp_path, policy, attempts) -> None:
    def hangs(p, clock):
        group = FakeGroup(p, clock, [[]] * 1000)
        group.hangs = True
        return group

    kwargs = dict(max_retries=1, retry_on=(FAILED, TIMEDOUT), timeout_per_attempt=True) \
        if policy == "workload" else dict(max_retries=1)  # fmt: skip
    c, groups, _ = make(tmp_path, [hangs, [[ok(0, "a"), ok(1, "b")]]], **kwargs)
    c.watchdog = _HangsOnce()  # type: ignore[assignment]
    if policy == "workload":
        assert c.run() == ["a", "b"] and c.state == SUCCESS
    else:
        with pytest.raises(DistributedHangError, match="hung: rank 1 never reached all_reduce #4"):
            c.run()
        assert c.state == TIMEDOUT
    assert len(groups) == attempts


def test_the_pause_before_a_retry_is_logged_and_a_cancel_ends_it(tmp_path, caplog) -> None:
    c, groups, _ = make(tmp_path, [FAIL, FAIL], max_retries=1, backoff_s=50.0)
    threading.Timer(0.3, lambda: c.cancel("canceled by the user")).start()
    start = time.monotonic()
    with pytest.raises(RunCanceledError, match="canceled by the user"):
        c.run()
    assert time.monotonic() - start < 40  # not the 50 s pause
    assert c.state == CANCELED and len(groups) == 2 and groups[1].abort.is_set() and groups[1].polls == 0
    assert "retry 1 of 1 in 50 s" in caplog.text


def test_a_resubmit_after_a_preemption_says_so_and_a_retry_counts_only_retries(tmp_path, caplog) -> None:
    def preempted(p, clock):
        group = FakeGroup(p, clock, FAIL)
        group.preempted = PREEMPTED
        return group

    c, groups, _ = make(tmp_path, [preempted, FAIL, [[ok(0, 1), ok(1, 2)]]], max_retries=1)
    assert c.run() == [1, 2] and len(groups) == 3
    assert f"{PREEMPTED}; resubmitted (preemption 1 of at most 100; no retry spent)" in caplog.text
    assert "ended FAILED; retry 1 of 1" in caplog.text  # not "retry 2 of 1": the preemption spent none
