"""Replacing a dead rank in place: the policy's answer, the controller acting on it against a
scripted group (no processes), the store's notice and the faults aimed at one incarnation."""

from __future__ import annotations

import json

import pytest

from gpufleet.errors import LaunchConfigError, RankFailure
from gpufleet.faults import parse_fault
from gpufleet.launch.controller import ControllerCallback
from gpufleet.launch.group import Replacement
from gpufleet.launch.policy import RankLost, RetryPolicy
from gpufleet.launch.store import Assignment, Notice, Recovered
from gpufleet.options import make_options
from gpufleet.states import FAILED, SUCCESS
from tests.unit.test_controller import FakeGroup, make, ok, raised

REPLACE = RetryPolicy.for_call(max_retries=0, recovery="replace")


@pytest.mark.parametrize(
    ("lost", "why_not"),
    [
        (RankLost(1, "signal", "SIGKILL"), None),
        (RankLost(0, "exit", "exit code 3"), None),
        (RankLost(1, "no_result", "no_result"), None),
        (RankLost(1, "exception", "ValueError"), "it raised ValueError"),
        (RankLost(1, "signal", "SIGKILL", failed=2), "more than one rank failed at once"),
        (RankLost(1, "signal", "SIGKILL", replacements=1), "its slot already failed 1 time in this attempt"),
        (RankLost(1, "signal", "SIGKILL", canceled=True), "the run is being canceled"),
        (RankLost(1, "signal", "SIGKILL", time_left=0.5), "the timeout leaves 0.5 s"),
    ],
)
def test_only_a_process_death_of_a_slot_not_yet_replaced_is_replaced(lost: RankLost, why_not: str | None) -> None:
    answer = REPLACE.why_not_replace(lost)
    assert answer == why_not if why_not is None else why_not in answer
    assert "recovery='restart'" in RetryPolicy.for_call(0).why_not_replace(RankLost(1, "signal", "SIGKILL"))


class ReplacingGroup(FakeGroup):
    """A scripted group that replaces ranks: a replacement clears the rank's failure and the script goes on.

    ``back`` maps a poll's number to the replacement's report that it is back, given at that poll.
    """

    replaces_ranks = True

    def __init__(self, *args, back: dict[int, Recovered] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replaced: list[tuple[int, str]] = []
        self.refused: list[tuple[int, str, str]] = []
        self.replacements: dict[int, int] = {}
        self.back = dict(back or {})
        self.warm = False

    @property
    def pids(self) -> list[int]:
        return [1000 + r for r in range(self.spec.world_size)]

    def replace(self, rank: int, cause: str) -> Replacement:
        self.replaced.append((rank, cause))
        self.replacements[rank] = self.replacements.get(rank, 0) + 1
        self.failures.pop(rank)
        return Replacement(4242, warm=self.warm)

    def recovered(self) -> list[Recovered]:
        return [self.back.pop(n) for n in sorted(self.back) if n <= self.polls]

    def refuse_replacement(self, rank: int, cause: str, reason: str) -> None:
        self.refused.append((rank, cause, reason))


def _killed(rank: int, t: float) -> tuple[int, RankFailure]:
    return rank, RankFailure(rank=rank, kind="signal", time=t, exit_code=-9, signal_name="SIGKILL")


def test_the_controller_replaces_a_killed_rank_and_the_attempt_goes_on(tmp_path, capfd) -> None:
    script = [[], [_killed(1, 1.0)], [], [ok(0, "a"), ok(1, "b")]]
    controller, groups, _ = make(tmp_path, [lambda tmp, clock: ReplacingGroup(tmp, clock, script)], recovery="replace")
    assert controller.run() == ["a", "b"]
    assert controller.state == SUCCESS and controller.attempt == 1
    assert groups[0].replaced == [(1, "SIGKILL")] and groups[0].stops == []
    assert "rank 1 died (SIGKILL); replaced in place by a new process (pid 4242)" in capfd.readouterr().err


def test_a_raise_and_a_second_death_are_refused_and_end_the_attempt(tmp_path, capfd) -> None:
    raising = [[raised(1, ValueError("bug"), 1.0)]]
    controller, groups, _ = make(tmp_path, [lambda tmp, clock: ReplacingGroup(tmp, clock, raising)], recovery="replace")
    with pytest.raises(ValueError):
        controller.run()
    assert groups[0].replaced == [] and groups[0].refused[0][:2] == (1, "ValueError")
    assert "it raised ValueError" in groups[0].refused[0][2]

    twice = [[_killed(1, 1.0)], [_killed(1, 2.0)]]
    controller, groups, _ = make(tmp_path, [lambda tmp, clock: ReplacingGroup(tmp, clock, twice)], recovery="replace")
    with pytest.raises(Exception, match="SIGKILL"):
        controller.run()
    assert controller.state == FAILED and groups[0].replaced == [(1, "SIGKILL")]
    assert groups[0].refused == [(1, "SIGKILL", "its slot already failed 1 time in this attempt")]
    assert "not replaced in place: its slot already failed" in capfd.readouterr().err


class NoProcessGroup(ReplacingGroup):
    def replace(self, rank: int, cause: str) -> Replacement:
        raise BlockingIOError(11, "Resource temporarily unavailable")


def test_a_slot_no_process_can_take_is_refused_with_the_reason_and_the_retry_restarts(tmp_path, capfd) -> None:
    killed = [[_killed(1, 1.0)]]
    hooks = Recoveries()
    controller, groups, _ = make(tmp_path, [lambda tmp, clock: NoProcessGroup(tmp, clock, killed),
                                            lambda tmp, clock: ReplacingGroup(tmp, clock, [[ok(0, "a"), ok(1, "b")]])],
                                 recovery="replace", max_retries=1, callbacks=[hooks])  # fmt: skip
    assert controller.run() == ["a", "b"]
    assert controller.state == SUCCESS and controller.attempt == 2
    why = "no process could take its place (BlockingIOError: [Errno 11] Resource temporarily unavailable)"
    assert groups[0].refused == [(1, "SIGKILL", why)]
    assert [(r.outcome, r.reason) for r in hooks.seen] == [("refused", why)]
    assert f"rank 1 failed (SIGKILL); not replaced in place: {why}" in capfd.readouterr().err


class Recoveries(ControllerCallback):
    def __init__(self) -> None:
        self.seen: list = []

    def on_recovery(self, group, attempt, recovery) -> None:
        self.seen.append(recovery)


def test_each_recovery_is_told_to_the_hooks_and_the_caller_as_it_goes(tmp_path, capfd) -> None:
    script = [[], [_killed(1, 1.0)], [], [], [], [ok(0, "a"), ok(1, "b")]]
    back = {4: Recovered(generation=1, rank=1, resumed_step=29, steps_lost=0, at=3.5)}
    hooks = Recoveries()
    controller, _, _ = make(tmp_path, [lambda tmp, clock: ReplacingGroup(tmp, clock, script, back=back)],
                            recovery="replace", callbacks=[hooks])  # fmt: skip
    assert controller.run() == ["a", "b"]
    assert [r.outcome for r in hooks.seen] == ["replacing", "recovered"]
    done = hooks.seen[-1]
    assert controller.recoveries == [done]
    assert (done.attempt, done.number, done.rank, done.cause, done.old_pid, done.new_pid, done.generation) == (
        1, 1, 1, "SIGKILL", 1001, 4242, 1)  # fmt: skip
    assert (done.resumed_step, done.steps_lost, done.recovered_at, done.seconds_lost) == (29, 0, 3.5, 2.5)
    err = capfd.readouterr().err
    assert ("rank 1 (SIGKILL) is back: every rank went on after step 29, 2.50 s after the death; 0 steps trained "
            "again (pid 1001 -> 4242)") in err  # fmt: skip


def test_a_recovery_the_attempt_ends_before_is_failed_and_a_refusal_is_recorded_with_its_reason(tmp_path) -> None:
    hooks = Recoveries()
    script = [[_killed(1, 1.0)], [], [raised(0, RuntimeError("lost again"), 2.0)]]  # never back: rank 0 fails
    controller, _, _ = make(tmp_path, [lambda tmp, clock: ReplacingGroup(tmp, clock, script)], recovery="replace",
                            callbacks=[hooks])  # fmt: skip
    with pytest.raises(RuntimeError):
        controller.run()
    assert [r.outcome for r in hooks.seen] == ["replacing", "refused", "failed"]
    replaced, refused, failed = hooks.seen
    assert (refused.number, refused.rank, refused.cause) == (2, 0, "RuntimeError")
    assert refused.reason.startswith("it raised RuntimeError (an error of its own happens again")
    assert (failed.number, failed.rank, failed.new_pid) == (1, 1, 4242)
    assert failed.reason.startswith("the attempt ended before the rank was back (RuntimeError: ")
    assert [r.outcome for r in controller.recoveries] == ["failed", "refused"]


def test_a_recovery_report_round_trips_and_anything_else_is_refused() -> None:
    report = Recovered(generation=1, rank=0, resumed_step=29, steps_lost=1, at=12.5)
    assert Recovered.parse(report.to_bytes()) == report
    good = {"generation": 1, "rank": 0, "resumed_step": 29, "steps_lost": 0, "at": 1.0}
    for bad in [b"\xff", b"null", json.dumps({**good, "rank": True}).encode(), json.dumps({**good, "at": "1"}).encode(),
                json.dumps({k: v for k, v in good.items() if k != "at"}).encode(),
                json.dumps({**good, "steps_lost": 1.5}).encode()]:
        with pytest.raises(ValueError):
            Recovered.parse(bad)


def test_a_spare_assignment_round_trips_and_names_a_ranks_own_variables_only() -> None:
    assignment = Assignment(1, 2, 3, {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r"})
    assert Assignment.parse(assignment.to_bytes()) == assignment
    good = {"rank": 1, "generation": 2, "incarnation": 3, "env": {"RANK": "1"}}
    for bad in [{**good, "env": {"LD_PRELOAD": "/tmp/x.so"}}, {**good, "env": {"RANK": 1}}, {**good, "env": ["RANK"]},
                {**good, "rank": "1"}, {k: v for k, v in good.items() if k != "incarnation"}]:
        with pytest.raises(ValueError):
            Assignment.parse(json.dumps(bad).encode())


def test_a_notice_round_trips_and_anything_else_is_refused() -> None:
    notice = Notice("replace", 2, 1, "SIGKILL")
    assert Notice.parse(notice.to_bytes()) == notice
    for bad in [b"[1]", json.dumps({"action": "run", "generation": 0, "rank": 1, "cause": "", "reason": ""}).encode(),
                json.dumps({"action": "stop", "generation": "0", "rank": 1, "cause": "", "reason": ""}).encode(),
                json.dumps({"action": "stop", "generation": 0, "rank": 1, "cause": "", "reason": "", "x": 1}).encode()]:
        with pytest.raises(ValueError):
            Notice.parse(bad)


def test_a_fault_hits_one_incarnation_and_recovery_is_checked() -> None:
    assert parse_fault("kill:rank=1:step=20:incarnation=2").incarnation == 2
    assert parse_fault("kill:rank=1:step=20").incarnation == 1
    assert parse_fault("kill:rank=1:step=20:incarnation=all").incarnation is None
    assert parse_fault("kill:rank=1:step=20:incarnation=2").describe() == "'kill:rank=1:step=20:incarnation=2'"
    with pytest.raises(LaunchConfigError, match="incarnation must be an integer >= 1"):
        parse_fault("kill:rank=1:step=20:incarnation=0")
    with pytest.raises(LaunchConfigError, match="recovery must be 'restart'"):
        make_options(recovery="respawn")
    with pytest.raises(LaunchConfigError, match="on this machine only"):
        make_options(recovery="replace", remote="ray://127.0.0.1:10001")
    with pytest.raises(LaunchConfigError, match="drop keep_warm"):
        make_options(recovery="replace", keep_warm=60)
    with pytest.raises(LaunchConfigError, match=r"spares=1 keeps processes ready .* needs recovery='replace'"):
        make_options(spares=1)
    for bad in (-1, 9, 1.5, True, "1"):
        with pytest.raises(LaunchConfigError, match="spares must be a whole number from 0 to 8"):
            make_options(recovery="replace", spares=bad)
    assert make_options(recovery="replace", spares=2).spares == 2


def test_a_fault_of_the_first_incarnation_is_not_armed_in_a_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet import faults

    monkeypatch.setenv(faults.FAULTS_ENV, json.dumps([{"action": "kill", "rank": 1, "step": 5},
                                                      {"action": "exit", "rank": 1, "step": 7, "incarnation": 2}]))
    monkeypatch.setenv("GPUFLEET_INCARNATION", "2")
    try:
        faults.arm(1)
        assert [f.action for f in faults._armed] == ["exit"]
    finally:
        faults.disarm()
