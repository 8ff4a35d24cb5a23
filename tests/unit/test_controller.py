"""The controller's transitions, driven by a scripted worker group: no processes at all."""

from __future__ import annotations

import threading

import cloudpickle
import pytest

from gpufleet.errors import (
    EXCEPTION,
    STOPPED,
    DistributedTimeoutError,
    LaunchConfigError,
    RankFailure,
    RunCanceledError,
    WorkerExitError,
    WorkerGroupError,
)
from gpufleet.launch import failures
from gpufleet.launch.controller import Controller, ControllerCallback
from gpufleet.launch.group import GroupStartCanceled, GroupStatus, WorkerGroup
from gpufleet.launch.policy import RetryPolicy
from gpufleet.launch.spec import LaunchSpec
from gpufleet.results import RunDir
from gpufleet.states import CANCELED, FAILED, RUNNING, SUCCESS, TIMEDOUT


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ok(rank: int, value: object, t: float = 0.0) -> tuple[int, dict]:
    return rank, {"status": "ok", "rank": rank, "time": t, "value": cloudpickle.dumps(value)}


def raised(rank: int, exc: BaseException, t: float) -> tuple[int, RankFailure]:
    return rank, RankFailure(
        rank=rank, kind=EXCEPTION, time=t, exc_type=type(exc).__name__, message=str(exc),
        traceback=f"Traceback: {exc}", exc_bytes=cloudpickle.dumps(exc),
        secondary=failures.is_secondary(type(exc).__name__, str(exc)),
    )


def exited(rank: int, code: int, t: float) -> tuple[int, RankFailure]:
    return rank, RankFailure(rank=rank, kind="exit", time=t, exit_code=code)


class FakeGroup(WorkerGroup):
    """A worker group whose polls replay a script: each poll adds the next step's outcomes.

    Every poll advances the fake clock by the time the controller let it wait.
    """

    def __init__(self, tmp_path, clock: FakeClock, steps: list[list[tuple]], num_ranks: int = 2,
                 start_error: BaseException | None = None, poll_error: BaseException | None = None) -> None:  # fmt: skip
        spec = LaunchSpec(f"fake-{len(steps)}-{id(self)}", num_ranks)
        super().__init__(spec, RunDir.create(str(tmp_path), spec.run_id))
        self.clock = clock
        self.steps = list(steps)
        self.start_error = start_error
        self.poll_error = poll_error
        self.results: dict[int, dict] = {}
        self.failures: dict[int, RankFailure] = {}
        self.started = False
        self.stops: list[tuple[str, float, bool]] = []
        self.closed: list[bool] = []
        self.polls = 0

    def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.started = True
        self.started_at = self.clock.now

    def _status(self) -> GroupStatus:
        return GroupStatus(self.spec.world_size, dict(self.results), dict(self.failures))

    def poll(self, wait_s: float) -> GroupStatus:
        self.polls += 1
        self.clock.now += max(wait_s, 0.01)
        if self.poll_error is not None:
            raise self.poll_error
        if self.steps:
            for rank, record in self.steps.pop(0):
                target = self.results if isinstance(record, dict) else self.failures
                target[rank] = record
        return self._status()

    def stop(self, reason: str, grace_period_s: float, dump_stacks: bool = False) -> GroupStatus:
        self.stops.append((reason, grace_period_s, dump_stacks))
        for rank in range(self.spec.world_size):
            if rank not in self.results and rank not in self.failures:
                self.failures[rank] = RankFailure(rank=rank, kind=STOPPED, time=self.clock.now, message=reason)
        return self._status()

    def close(self, succeeded: bool) -> None:
        self.closed.append(succeeded)


class Recorder(ControllerCallback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def before_start(self, group, attempt):
        self.events.append(("before", attempt))
        group.add_env({"MLFLOW_RUN_ID": f"m{attempt}"})

    def after_start(self, group, attempt):
        self.events.append(("after", attempt, group.spec.env.get("MLFLOW_RUN_ID")))

    def on_end(self, group, attempt, state, error):
        self.events.append(("end", attempt, str(state), type(error).__name__ if error else None))


def make(tmp_path, scripts, clock=None, **kwargs):
    """A controller whose attempt ``n`` (from 1) replays ``scripts[n]`` (a list: its ``n``-th item);
    returns it and the groups made."""
    clock = clock or FakeClock()
    if isinstance(scripts, list):
        scripts = dict(enumerate(scripts, 1))
    groups: list[FakeGroup] = []

    def make_group(attempt: int) -> FakeGroup:
        script = scripts[attempt]
        group = script(tmp_path, clock) if callable(script) else FakeGroup(tmp_path, clock, script)
        groups.append(group)
        return group

    kwargs.setdefault("timeout_s", None)
    policy = {k: kwargs.pop(k) for k in ("max_retries", "retry_on", "timeout_per_attempt", "backoff_s", "cancel_wins", "recovery")
              if k in kwargs}  # fmt: skip
    return Controller(make_group, clock=clock, poll_s=0.02, policy=RetryPolicy(**policy), **kwargs), groups, clock


def test_success_returns_values_in_rank_order_and_calls_every_hook(tmp_path):
    rec = Recorder()
    c, groups, _ = make(tmp_path, [[[], [ok(1, "b")], [ok(0, "a")]]], callbacks=[rec])
    c.start()
    assert c.state == RUNNING
    assert c.run() == ["a", "b"]
    assert c.state == SUCCESS and c.finished.is_set()
    assert groups[0].stops == [] and groups[0].closed == [True]
    assert rec.events == [("before", 1), ("after", 1, "m1"), ("end", 1, "SUCCESS", None)]


class RunningRecorder(ControllerCallback):
    def __init__(self, controller_of) -> None:
        self.events: list[tuple] = []
        self.controller_of = controller_of

    def after_start(self, group, attempt):
        self.events.append(("after", attempt))

    def on_running(self, group, attempt):
        self.events.append(("running", attempt, str(self.controller_of().state)))

    def on_end(self, group, attempt, state, error):
        self.events.append(("end", attempt, str(state)))


class PlacedLater(FakeGroup):
    """A group that places its ranks at a later poll (as on Ray or Slurm): not started until then."""

    starts_at_once = False

    def _status(self) -> GroupStatus:
        return GroupStatus(self.spec.world_size, dict(self.results), dict(self.failures), started=self.polls > 0)


@pytest.mark.parametrize("at_once", [True, False])
def test_the_running_hook_comes_once_before_the_end_also_for_a_call_done_at_its_first_poll(tmp_path, at_once):
    # a recorder marks the run RUNNING, with its placement, from this hook: a call on Slurm whose
    # ranks were done by the first poll that saw them must get it too (a poll of its own missed it)
    script = [[ok(0, "a"), ok(1, "b")]]
    group_cls = FakeGroup if at_once else PlacedLater
    holder: list[Controller] = []
    rec = RunningRecorder(lambda: holder[0])
    c, _, _ = make(tmp_path, {1: lambda tmp, clock: group_cls(tmp, clock, script)}, callbacks=[rec])
    holder.append(c)
    assert c.run() == ["a", "b"]
    assert rec.events == [("after", 1), ("running", 1, "RUNNING"), ("end", 1, "SUCCESS")]


def test_first_failure_settles_then_stops_and_groups_the_same_error(tmp_path):
    script = [[raised(1, ValueError("bad batch"), t=5.0)], [], [raised(0, ValueError("bad batch"), t=6.0)]]
    c, groups, _ = make(tmp_path, [script])
    with pytest.raises(ValueError, match="bad batch") as info:
        c.run()
    group = groups[0]
    assert len(group.stops) == 1 and "after rank 1 failed" in group.stops[0][0]
    assert group.polls == 3  # it waited for rank 0 to report before stopping
    notes = "\n".join(info.value.__notes__)
    assert "rank 1 of 2 failed first" in notes and "same error as the root cause" in notes
    assert c.state == FAILED and group.closed == [False]


def test_settle_window_ends_after_a_second_when_a_rank_never_reports(tmp_path):
    c, groups, clock = make(tmp_path, [[[exited(0, 3, t=1.0)]]])
    start = clock.now
    with pytest.raises(WorkerExitError, match="exited with code 3"):
        c.run()
    assert 1.0 <= clock.now - start < 1.2
    assert groups[0].failures[1].kind == STOPPED


def test_root_cause_is_the_earliest_primary_failure_not_a_secondary_one(tmp_path):
    script = [[raised(1, RuntimeError("Connection closed by peer"), t=1.0), raised(0, KeyError("step 7"), t=2.0)]]
    c, _, _ = make(tmp_path, [script])
    with pytest.raises(KeyError) as info:
        c.run()
    err = info.value.gpufleet_error
    assert err.rank == 0 and err.root_cause.exc_type == "KeyError"
    assert err.failures[1].secondary


def test_root_cause_by_time_among_primary_failures(tmp_path):
    script = [[raised(0, ValueError("late"), t=9.0), raised(1, TypeError("early"), t=3.0)]]
    c, _, _ = make(tmp_path, [script])
    with pytest.raises(TypeError, match="early"):
        c.run()


def test_timeout_stops_with_stack_dumps_and_raises_timeout_error(tmp_path):
    c, groups, _ = make(tmp_path, [[]], timeout_s=0.5)
    with pytest.raises(DistributedTimeoutError, match="ran past its timeout of 0.5 s") as info:
        c.run()
    assert c.state == TIMEDOUT
    reason, _, dump = groups[0].stops[0]
    assert dump and "timeout" in reason
    assert set(info.value.failures) == {0, 1}


def test_cancel_from_another_thread_stops_with_its_grace(tmp_path):
    c, groups, _ = make(tmp_path, [[[]] * 100000], grace_period_s=7.0)
    c.start()
    group = groups[0]
    t = threading.Timer(0.05, lambda: c.cancel("canceled by the user", grace_period_s=2.5))
    t.start()
    with pytest.raises(RunCanceledError, match="canceled by the user"):
        c.run()
    t.join()
    assert c.state == CANCELED and group.stops == [("canceled by the user", 2.5, False)]
    assert group.abort.is_set()


def test_cancel_before_run_ends_canceled_without_waiting(tmp_path):
    c, groups, _ = make(tmp_path, [[[]] * 100000], grace_period_s=3.0)
    c.start()
    c.cancel()
    with pytest.raises(RunCanceledError):
        c.run()
    assert groups[0].polls == 0 and groups[0].stops[0][1] == 3.0


def test_cancel_after_the_end_changes_nothing(tmp_path):
    c, _, _ = make(tmp_path, [[[ok(0, 1), ok(1, 2)]]])
    assert c.run() == [1, 2]
    c.cancel()
    assert c.state == SUCCESS and c.outcome() == [1, 2]


def test_retry_with_time_left_runs_a_new_attempt(tmp_path):
    rec = Recorder()
    c, groups, _ = make(
        tmp_path, [[[exited(1, 1, t=1.0), ok(0, "x")]], [[ok(0, "a"), ok(1, "b")]]],
        max_retries=1, timeout_s=60.0, callbacks=[rec],
    )
    assert c.run() == ["a", "b"]
    assert len(groups) == 2 and groups[0].run_id != groups[1].run_id
    assert [e for e in rec.events if e[0] == "end"] == [("end", 1, "FAILED", "WorkerExitError"), ("end", 2, "SUCCESS", None)]


def test_a_calls_timeout_covers_its_retries(tmp_path):
    """The retry gets what the first attempt left of the call's timeout, not a timeout of its own."""
    def fails_after_4_s(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [[]] * 200 + [[exited(0, 1, t=1.0), exited(1, 1, t=1.0)]])

    c, groups, clock = make(tmp_path, [fails_after_4_s, []], max_retries=3, timeout_s=8.0)
    start = clock.now
    with pytest.raises(DistributedTimeoutError, match="ran past its timeout of 8 s"):
        c.run()
    assert len(groups) == 2 and c.state == TIMEDOUT
    assert 4.0 <= groups[1].started_at - start and groups[1].stops[0][2]  # the retry, stopped with its stacks
    assert 8.0 <= clock.now - start < 8.5  # a deadline per attempt would have ended it at about 12 s


def test_retry_refused_with_under_a_second_left(tmp_path, caplog):
    def slow_failure(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [[]] * 40 + [[exited(0, 1, t=1.0)]])

    c, groups, _ = make(tmp_path, [slow_failure, [[ok(0, 1), ok(1, 1)]]], max_retries=3, timeout_s=2.0)
    with pytest.raises(WorkerExitError):
        c.run()
    assert len(groups) == 1
    assert "not retried" in caplog.text


def test_retries_are_not_spent_on_a_cancel_or_a_timeout(tmp_path):
    c, groups, _ = make(tmp_path, [[], []], max_retries=2, timeout_s=0.3)
    with pytest.raises(DistributedTimeoutError):
        c.run()
    assert len(groups) == 1


def test_workload_policy_retries_a_timeout_with_a_fresh_deadline(tmp_path):
    c, groups, _ = make(
        tmp_path, {1: [], 2: [[ok(0, None), ok(1, None)]]}, max_retries=1, timeout_s=0.3,
        timeout_per_attempt=True, retry_on=(FAILED, TIMEDOUT),
    )
    assert c.run() == [None, None]
    assert len(groups) == 2 and c.attempt == 2


def test_retries_stop_at_max_retries(tmp_path):
    fail = [[exited(0, 1, t=1.0), exited(1, 1, t=1.0)]]
    c, groups, _ = make(tmp_path, [fail, fail, fail], max_retries=2)
    with pytest.raises(WorkerExitError):
        c.run()
    assert len(groups) == 3


def test_keyboard_interrupt_stops_every_rank_and_is_raised_again(tmp_path, capsys):
    def interrupted(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], poll_error=KeyboardInterrupt())

    rec = Recorder()
    c, groups, _ = make(tmp_path, [interrupted], grace_period_s=9.0, callbacks=[rec])
    with pytest.raises(KeyboardInterrupt):
        c.run()
    assert c.state == CANCELED and isinstance(c.error, RunCanceledError)
    assert groups[0].stops[0][1] == 2.0  # at most 2 s of grace after Ctrl-C
    assert "interrupted; stopping all 2 ranks" in capsys.readouterr().err
    assert rec.events[-1] == ("end", 1, "CANCELED", "RunCanceledError")


def test_ctrl_c_while_the_ranks_start_ends_the_run_canceled(tmp_path):
    def starting(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], start_error=KeyboardInterrupt())

    rec = Recorder()
    c, groups, _ = make(tmp_path, [starting], callbacks=[rec])
    with pytest.raises(KeyboardInterrupt):
        c.start()
    assert c.state == CANCELED and isinstance(c.error, RunCanceledError) and groups[0].closed == [False]
    assert "interrupted before its ranks started" in str(c.error)
    assert rec.events[-1] == ("end", 1, "CANCELED", "RunCanceledError")

    # the same when the interrupted start is a retry's
    fail = [[exited(0, 1, t=1.0), exited(1, 1, t=1.0)]]
    rec = Recorder()
    c, groups, _ = make(tmp_path, [fail, starting], max_retries=1, callbacks=[rec])
    with pytest.raises(KeyboardInterrupt):
        c.run()
    assert c.state == CANCELED and len(groups) == 2
    assert [e for e in rec.events if e[0] == "end"] == [("end", 1, "FAILED", "WorkerExitError"),
                                                        ("end", 2, "CANCELED", "RunCanceledError")]  # fmt: skip


def test_a_wrong_setting_raises_at_start_and_ends_the_run_failed(tmp_path):
    def bad(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], start_error=LaunchConfigError("asked for 4 GPUs but the cluster has 2"))

    rec = Recorder()
    c, groups, _ = make(tmp_path, [bad], callbacks=[rec])
    with pytest.raises(LaunchConfigError, match="4 GPUs"):
        c.start()
    assert c.state == FAILED and c.finished.is_set() and groups[0].closed == [False]
    assert rec.events[-1] == ("end", 1, "FAILED", "LaunchConfigError")


def test_a_broken_launcher_fails_the_run_with_its_reason(tmp_path):
    def broken(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], poll_error=ConnectionError("cluster connection lost"))

    c, groups, _ = make(tmp_path, [broken, broken, broken], max_retries=2)
    with pytest.raises(WorkerGroupError, match="launcher failed: ConnectionError: cluster connection lost"):
        c.run()
    assert all(g.stops for g in groups) and len(groups) == 1 + 2  # a broken launcher counts as a failed attempt


def test_a_group_that_gives_up_starting_because_of_a_cancel_ends_canceled(tmp_path):
    def giving_up(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], poll_error=GroupStartCanceled("stopped while waiting for room"))

    c, _, _ = make(tmp_path, [giving_up])
    with pytest.raises(RunCanceledError):
        c.run()
    assert c.state == CANCELED


def test_a_failing_hook_never_changes_the_outcome(tmp_path, caplog):
    class Broken(ControllerCallback):
        def on_end(self, group, attempt, state, error):
            raise OSError("tracking store is gone")

    c, _, _ = make(tmp_path, [[[ok(0, 1), ok(1, 2)]]], callbacks=[Broken()])
    assert c.run() == [1, 2]
    assert "tracking store is gone" in caplog.text


def test_a_value_that_cannot_be_unpickled_fails_naming_the_rank(tmp_path):
    bad = {"status": "ok", "rank": 1, "time": 0.0, "value": b"not a pickle"}
    c, _, _ = make(tmp_path, [[[ok(0, 1), (1, bad)]]])
    with pytest.raises(WorkerGroupError, match="rank 1's return value could not be unpickled"):
        c.run()
    assert c.state == FAILED


def test_a_group_that_gives_up_starting_ends_canceled_and_says_so(tmp_path):
    def gives_up(tmp_path, clock):
        return FakeGroup(tmp_path, clock, [], start_error=GroupStartCanceled("waiting for room"))

    rec = Recorder()
    c, groups, _ = make(tmp_path, [gives_up], callbacks=[rec])
    c.cancel("canceled by the user")
    with pytest.raises(RunCanceledError, match="canceled by the user.*before its ranks started"):
        c.start()
    assert c.state == CANCELED and groups[0].closed == [False]
    assert rec.events[-1] == ("end", 1, "CANCELED", "RunCanceledError")


def test_a_per_attempt_deadline_starts_once_the_ranks_started(tmp_path):
    class SlowStart(FakeGroup):
        def start(self):
            self.clock.now += 50.0  # waited for room on a cluster
            super().start()

    c, _, _ = make(
        tmp_path, {1: lambda p, clock: SlowStart(p, clock, [[]] * 10 + [[ok(0, None), ok(1, None)]])},
        timeout_s=5.0, timeout_per_attempt=True,
    )
    assert c.run() == [None, None]


def test_a_preempted_attempt_is_resubmitted_without_spending_a_retry(tmp_path):
    def preempted(tmp_path, clock):
        group = FakeGroup(tmp_path, clock, [[exited(0, 75, t=1.0), exited(1, 75, t=1.0)]])
        group.preempted = "preempted: Slurm signaled job 7 to stop"
        return group

    fail = [[exited(0, 1, t=1.0), exited(1, 1, t=1.0)]]
    c, groups, _ = make(tmp_path, [preempted, preempted, fail, [[ok(0, "a"), ok(1, "b")]]], max_retries=1)
    assert c.run() == ["a", "b"]  # two preemptions and one failure, with a single retry allowed
    assert len(groups) == 4 and c.preemptions == 2
