"""The hang watchdog's judgement from recorded progress, stacks and CPU use (a fake clock, no processes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpufleet.errors import LaunchConfigError
from gpufleet.launch.hangwatch.activity import Sample
from gpufleet.launch.hangwatch.watchdog import HangSettings, Watchdog

WAITING = '''Current thread 0x1 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/me/train.py", line 30 in train
  File "/x/site-packages/gpufleet/launch/worker.py", line 110 in run_call
'''
OWN = '''Current thread 0x2 (most recent call first):
  File "/home/me/train.py", line 42 in train
  File "/x/site-packages/gpufleet/launch/worker.py", line 110 in run_call
'''


@dataclass
class Status:
    num_ranks: int
    progress: dict[int, dict[str, Any]]
    results: dict[int, Any] = field(default_factory=dict)


class Group:
    workers_are_ranks = True
    pids = [100, 101]
    run_id = "run-1"

    def __init__(self) -> None:
        self.stack_requests = 0
        self.stacks_now = {0: WAITING, 1: OWN}

    def stacks(self, timeout_s: float = 3.0) -> dict[int, str]:
        self.stack_requests += 1
        return dict(self.stacks_now)


class Run:
    """Two ranks stepping once a second (one all-reduce a step), then whatever the test does."""

    def __init__(self, settings: HangSettings, busy: set[int] | None = None) -> None:
        self.now = 1000.0
        self.cpu = {0: 1.0, 1: 1.0}
        self.busy = busy or set()
        self.group = Group()
        self.dog = Watchdog(settings, clock=lambda: self.now, wall=lambda: self.now, sampler=self._sample)
        self.records = {r: {"time": self.now, "step": 0, "seq": 0, "sections": []} for r in (0, 1)}

    def _sample(self, group: Any, progress: Any, now: float) -> dict[int, Sample]:
        return {r: Sample(now, self.cpu[r]) for r in (0, 1)}

    def tick(self, seconds: float = 1.0, *, step: set[int] = frozenset(), enter: set[int] = frozenset()):  # noqa: B006
        """``seconds`` pass in polls of 0.5 s; then the ranks in ``step`` take a step, those in ``enter`` enter a collective."""
        verdict = None
        for _ in range(int(seconds * 2)):
            self.now += 0.5
            for r in self.busy:
                self.cpu[r] += 0.5  # a core's worth of CPU
            for r in (0, 1):
                self.records[r]["time"] = self.now  # the reporter runs
            verdict = verdict or self.dog.check(Status(2, {r: dict(p) for r, p in self.records.items()}), self.group)
        for r in step:
            self.records[r]["step"] += 1
        for r in enter:
            seq = self.records[r]["seq"] + 1
            self.records[r]["seq"] = seq
            self.records[r]["collectives"] = [{"op": "all_reduce", "seq": seq, "state": "scheduled", "sizes": [[4]]}]
        return verdict

    def steps(self, n: int, seconds: float = 1.0) -> None:
        for _ in range(n):
            assert self.tick(seconds, step={0, 1}, enter={0, 1}) is None

    def wait_for_verdict(self, limit_s: float):
        """Rank 0 enters the next collective, rank 1 does not come; seconds until the verdict."""
        self.tick(0.5, enter={0})
        for half_seconds in range(1, int(limit_s * 2) + 1):
            verdict = self.tick(0.5)
            if verdict is not None:
                return half_seconds / 2, verdict
        return None, None


SETTINGS = HangSettings(long_s=600, floor_s=3, factor=2, window_s=2, recheck_s=1)


def test_a_rank_the_other_waits_for_and_that_does_nothing_is_hung_after_the_learned_limit():
    run = Run(SETTINGS)
    run.steps(6)
    assert run.dog.steady and run.dog.fast_limit() == 3.0  # 2 x a step of 1 s is below the floor
    took, verdict = run.wait_for_verdict(60)
    assert verdict is not None and verdict.fast and 3.0 <= took <= 4.0
    found = verdict.found
    assert found.summary[1] == "rank 1 missing from all_reduce #7 [[4]], which rank 0 waits in"
    assert found.missing[1] == ("missing from all_reduce #7 [[4]]: in its own code at /home/me/train.py:42 in "
                                "train, after all_reduce #6 [[4]] (idle)")  # fmt: skip
    assert found.waiting[0].startswith("waiting in all_reduce #7 [[4]] at /home/me/train.py:30")
    assert "the limit learned from this run: 3 s" in found.summary[0]


def test_the_learned_limit_follows_the_slowest_step():
    run = Run(SETTINGS)
    run.steps(4)
    for seconds in (1.5, 2.0, 3.0, 4.0, 5.0):  # steps slow down 5x, gradually
        run.steps(1, seconds)
    took, verdict = run.wait_for_verdict(60)
    assert run.dog.fast_limit() == 10.0  # 2 x the slowest step, 5 s
    assert verdict is not None and 10.0 <= took <= 11.0


def test_a_pause_below_the_learned_limit_is_no_hang():
    run = Run(SETTINGS)
    run.steps(6)
    run.tick(0.5, enter={0})
    assert run.tick(2.0, step={0, 1}, enter={1}) is None  # rank 1 came after 2.5 s (the limit is 3 s)
    run.steps(3)
    assert run.dog.fast_limit() == 5.0  # that pause is learned


def test_a_busy_rank_is_no_fast_hang_but_named_once_and_judged_at_hang_timeout(caplog):
    run = Run(HangSettings(long_s=30, floor_s=3, factor=2, window_s=2, recheck_s=1), busy={1})
    run.steps(6)
    with caplog.at_level(logging.WARNING, logger="gpufleet.launch.hangwatch.watchdog"):
        took, verdict = run.wait_for_verdict(60)
    assert verdict is not None and not verdict.fast and 30.0 <= took <= 31.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "busy in its own code while the others wait: rank 1 at /home/me/train.py:42 in train" in warnings[0]
    assert "hang_timeout=30 s" in warnings[0]
    assert "(busy)" in verdict.found.missing[1] and "hang_timeout=30 s" in verdict.found.summary[0]


def test_every_rank_busy_is_not_told_as_others_waiting(caplog):
    # one rank on one GPU, busy after its last collective: nobody waits for it
    from types import SimpleNamespace

    run = Run(SETTINGS)
    found = SimpleNamespace(busy={0: "/home/me/train.py:9 in train"}, summary=[])
    with caplog.at_level(logging.WARNING, logger="gpufleet.launch.hangwatch.watchdog"):
        run.dog._tell(SimpleNamespace(run_id="run-1"), found, 25.0, 600.0, num_ranks=1)
    assert run.dog.note.startswith("nothing moved for 25 s: busy in its own code: rank 0 at /home/me/train.py:9")
    assert "while the others wait" not in caplog.records[0].getMessage()


def test_the_note_names_the_busy_rank_while_it_lasts_and_goes_once_it_moves():
    run = Run(SETTINGS, busy={1})
    run.steps(6)
    run.tick(0.5, enter={0})
    assert run.tick(6.0) is None
    assert run.dog.note and "rank 1 at /home/me/train.py:42" in run.dog.note
    run.tick(0.5, step={0, 1}, enter={1})
    run.tick(0.5)
    assert run.dog.note is None


def test_before_the_first_step_only_hang_timeout_counts():
    run = Run(HangSettings(long_s=40, floor_s=3, factor=2, window_s=2, recheck_s=1))
    run.tick(1.0, enter={0, 1})  # a process group, no step yet: a model load on rank 1
    took, verdict = run.wait_for_verdict(60)
    assert verdict is not None and not verdict.fast and 40.0 <= took <= 41.0


@pytest.mark.parametrize("limit_s", [None, 20.0])
def test_a_long_section_turns_the_fast_path_off(limit_s):
    run = Run(HangSettings(long_s=40, floor_s=3, factor=2, window_s=2, recheck_s=1))
    run.steps(6)
    run.records[0]["sections"] = [{"name": "eval", "since": run.now, "limit_s": limit_s}]
    took, verdict = run.wait_for_verdict(60)
    assert verdict is not None and not verdict.fast
    assert (limit_s or 40.0) <= took <= (limit_s or 40.0) + 1.0
    said = "the limit of the section it is in (eval): 20 s" if limit_s else "hang_timeout=40 s"
    assert said in verdict.found.summary[0] and "learned" not in verdict.found.summary[0]


def test_a_section_is_not_learned_as_a_step():
    run = Run(SETTINGS)
    run.steps(6)
    run.records[0]["sections"] = [{"name": "checkpoint save", "since": run.now, "limit_s": None}]
    run.tick(0.5, enter={1})
    assert run.tick(20.0) is None  # rank 0 saves for 20 s while rank 1 waits
    run.records[0]["sections"] = []
    run.tick(0.5, step={0, 1}, enter={0})
    run.steps(2)
    assert run.dog.fast_limit() == 3.0


def test_every_rank_in_its_own_code_is_no_fast_hang():
    run = Run(HangSettings(long_s=20, floor_s=3, factor=2, window_s=2, recheck_s=1))
    run.steps(6)
    run.group.stacks_now = {0: OWN, 1: OWN}
    for _ in range(int(19 * 2)):
        assert run.tick(0.5) is None
    assert "no rank waits in a collective: every rank is in its own code after all_reduce #6 [[4]], which " \
           "completed" in (run.dog.note or "")  # fmt: skip
    verdict = run.tick(2.0)
    assert verdict is not None and not verdict.fast  # at hang_timeout


def test_every_rank_inside_a_collective_that_does_not_complete_is_a_fast_hang():
    run = Run(SETTINGS)
    run.steps(6)
    run.group.stacks_now = {0: WAITING, 1: WAITING}
    run.tick(0.5, enter={0, 1})
    verdict = run.tick(4.0)
    assert verdict is not None and verdict.fast
    assert "every rank is in all_reduce #7 [[4]] and none is missing" in verdict.found.summary[1]


def test_the_fast_limit_is_set_from_the_environment_and_checked():
    assert HangSettings.from_env(600, {}).floor_s == 25.0
    s = HangSettings.from_env(600, {"GPUFLEET_HANG_FLOOR_S": "3", "GPUFLEET_HANG_FACTOR": "4"})
    assert (s.floor_s, s.factor, s.long_s) == (3.0, 4.0, 600)
    for env in ({"GPUFLEET_HANG_FLOOR_S": "soon"}, {"GPUFLEET_HANG_FLOOR_S": "-1"}, {"GPUFLEET_HANG_FACTOR": "0.5"}):
        with pytest.raises(LaunchConfigError, match="must be a number"):
            HangSettings.from_env(600, env)
    run = Run(HangSettings(long_s=600, floor_s=0))  # 0: no fast path
    run.steps(6)
    assert run.dog.fast_limit() is None


def test_a_section_is_in_the_ranks_progress_record_while_it_lasts(tmp_path, monkeypatch):
    from pathlib import Path

    from gpufleet import runtime
    from gpufleet.launch import progress

    monkeypatch.setenv("GPUFLEET_RUN_DIR", str(tmp_path))
    monkeypatch.setattr(progress, "_progress_path", Path("progress-0.json"))
    with runtime.section("eval", limit_s=90):
        record = progress.read_progress(tmp_path, 0)
        assert record is not None and [(s["name"], s["limit_s"]) for s in record["sections"]] == [("eval", 90)]
        assert record["pid"] > 0 and record["cpu_s"] >= 0 and "step" in record  # fields added, none renamed
    assert progress.read_progress(tmp_path, 0)["sections"] == []
    with pytest.raises(ValueError, match="limit_s must be a positive number"):
        runtime.section("eval", limit_s=0)


def test_the_watchdogs_note_is_kept_in_the_run_folder(tmp_path):
    from gpufleet.launch.hangwatch.watchdog import read_note, write_note

    assert read_note(tmp_path) is None
    write_note(tmp_path, "busy in its own code while the others wait: rank 1 at train.py:3")
    assert read_note(tmp_path) == "busy in its own code while the others wait: rank 1 at train.py:3"
    write_note(tmp_path, None)
    assert read_note(tmp_path) is None
    (tmp_path / "watchdog.json").write_text("[1, 2]")  # not the watchdog's: no note
    assert read_note(tmp_path) is None


def test_what_a_rank_did_between_two_looks():
    from gpufleet.launch.hangwatch.activity import judge

    def look(t: float, cpu: float | None, **kw: Any) -> Sample:
        return Sample(t, cpu, **kw)

    assert judge(look(0, 1.0), look(5, 1.01), None, None) == "idle"  # 0.2 % of a core
    assert judge(look(0, 1.0), look(5, 2.0), None, None) == "busy"
    assert judge(look(0, 1.0), look(5, 1.0, stopped=True), None, None) == "stopped"
    assert judge(look(0, 1.0, runnable=True), look(5, 1.0), None, None) == "busy"  # waiting for a core
    assert judge(look(0, 1.0, io_bytes=0), look(5, 1.0, io_bytes=50 << 20), None, None) == "busy"  # reading files
    assert judge(look(0, 1.0), look(5, 1.0), None, {"gpu_util": 95}) == "busy"
    # no process to look at (another machine): the CPU seconds of its own records, while they are written
    assert judge(None, None, {"time": 0, "cpu_s": 3.0}, {"time": 5, "cpu_s": 3.01}) == "idle"
    assert judge(None, None, {"time": 0, "cpu_s": 3.0}, {"time": 5, "cpu_s": 7.0}) == "busy"
    assert judge(None, None, {"time": 5, "cpu_s": 3.0}, {"time": 5, "cpu_s": 3.0}) == "unknown"  # not written since


def test_gpufleet_stacks_shows_the_watchdogs_note_above_the_stacks(tmp_path, monkeypatch, capsys):
    import argparse

    from gpufleet import stacks
    from gpufleet.launch.hangwatch.watchdog import write_note

    write_note(tmp_path, "nothing moved for 31 s: busy in its own code while the others wait: rank 1 at train.py:57")
    found = [{"rank": r, "node_rank": None, "pid": 10 + r, "command": "python", "stack": f"stack of {r}",
              "run_dir": str(tmp_path)} for r in (0, 1)]  # fmt: skip
    monkeypatch.setattr(stacks, "collect", lambda run_id, home=None: ("run-1", found))
    assert stacks.cmd_stacks(argparse.Namespace(run_id="run-1", output="text")) == 0
    out = capsys.readouterr().out
    assert out.startswith("hang watchdog: nothing moved for 31 s: busy in its own code while the others wait: rank 1")
    assert "=== rank 1 (pid 11): python" in out
