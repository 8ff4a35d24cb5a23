"""Replacing a dead rank in place: the policy's answer, the controller acting on it against a
scripted group (no processes), the store's notice and the faults aimed at one incarnation."""

from __future__ import annotations

import json

import pytest

from gpufleet.errors import LaunchConfigError, RankFailure
from gpufleet.faults import parse_fault
from gpufleet.launch.policy import RankLost, RetryPolicy
from gpufleet.launch.store import Notice
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
    """A scripted group that replaces ranks: a replacement clears the rank's failure and the script goes on."""

    replaces_ranks = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replaced: list[tuple[int, str]] = []
        self.refused: list[tuple[int, str, str]] = []
        self.replacements: dict[int, int] = {}

    def replace(self, rank: int, cause: str) -> int:
        self.replaced.append((rank, cause))
        self.replacements[rank] = self.replacements.get(rank, 0) + 1
        self.failures.pop(rank)
        return 4242

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
