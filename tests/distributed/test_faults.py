"""Faults injected on purpose: kill, exit, hang and slow a rank at a step or after a time."""

from __future__ import annotations

import time

import pytest

from gpufleet import distributed, errors, runtime
from gpufleet.faults import FAULTS_ENV, parse_fault

CPU = {"gpus": 2, "gpu_type": "cpu", "tracking": False, "stream_logs": False, "grace_period_s": 1.0, "timeout": 120}


def _steps(n: int, pause_s: float = 0.05) -> float:
    """``n`` reported steps with an all-reduce each; returns how long they took on this rank."""
    import torch
    import torch.distributed as dist

    runtime.setup()
    started = time.monotonic()
    for _ in range(n):
        time.sleep(pause_s)
        dist.all_reduce(torch.ones(1))
        runtime.report_step()
    return time.monotonic() - started


def _env_of_rank() -> str | None:
    import os

    return os.environ.get(FAULTS_ENV)


def test_kill_a_rank_at_a_step():
    f = distributed(_steps, faults=["kill:rank=1:step=3"], **CPU)
    with pytest.raises(errors.WorkerSignalError, match="rank 1 of 2 failed first: killed by signal SIGKILL") as info:
        f.distributed(10)
    assert "gpufleet: injected fault: kill at step 3" in info.value.failures[1].log_tail


def test_exit_with_a_code_after_a_time():
    f = distributed(_steps, faults=[{"action": "exit", "rank": 0, "after": 0.5, "code": 7}], **CPU)
    with pytest.raises(errors.WorkerExitError, match="rank 0 of 2 failed first: process exited with code 7"):
        f.distributed(10_000, 0.01)


def test_hang_a_rank_and_the_watchdog_names_it():
    f = distributed(_steps, faults=["hang:rank=0:step=2"], hang_timeout=3.0, **CPU)
    with pytest.raises(errors.DistributedHangError) as info:
        f.distributed(50)
    assert info.value.rank == 0
    assert "rank 0 missing from all_reduce" in str(info.value) and "_steps" in str(info.value)


def _until_told(stop_file: str) -> int:
    """Loop in the rank's own code until ``stop_file`` exists; returns how many turns it took."""
    import os

    turns = 0
    while not os.path.exists(stop_file):
        time.sleep(0.02)
        turns += 1
    return turns


def test_hang_after_a_time_stops_the_ranks_own_code(tmp_path):
    # seen: "injected fault: hang at 1 s after the start" was logged from the timer's thread, and
    # the rank's own code went on: the call returned normally
    stop = tmp_path / "stop"
    handle = distributed(_until_told, faults=["hang:rank=1:after=1"], **CPU).submit(str(stop))
    try:
        deadline = time.monotonic() + 120
        while "gpufleet: injected fault: hang at 1 s after the start" not in handle.logs(1):
            assert time.monotonic() < deadline and not handle.done(), handle.logs(1)
            time.sleep(0.1)
        stop.touch()  # rank 0 returns at once; the hung rank 1 never sees it
        with pytest.raises(TimeoutError):
            handle.result(timeout=5)
        assert handle.status == "RUNNING"
    finally:
        handle.cancel()


def test_slow_a_rank_by_a_factor():
    # rank 1's steps take 4 times as long; rank 0 waits for it in each all-reduce. Sleeps are
    # lower bounds, so are these: 8 steps of at least 0.2 s, and rank 1 sleeps 3 times each
    # step's length after steps 2..8; rank 0's last all-reduce waits for rank 1's sleeps after
    # steps 2..7 (one of them spared here: the ranks' clocks start a moment apart).
    fast, slow = distributed(_steps, faults=["slow:rank=1:factor=4"], **CPU).distributed(8, 0.2)
    assert slow >= 8 * 0.2 + 7 * 3 * 0.2 - 0.05, slow  # 5.8 s; 1.6 s unslowed
    assert fast >= 8 * 0.2 + 5 * 3 * 0.2, fast  # 4.6 s


def test_a_run_without_faults_sets_nothing_and_faults_hit_the_first_attempt_only():
    assert distributed(_env_of_rank, **CPU).distributed() == [None, None]
    from gpufleet.faults import faults_env, parse_faults

    faults = parse_faults(["kill:rank=1:step=30", "slow:factor=2:attempt=2", {"action": "exit", "after": 5, "attempt": None}])
    assert "kill" in faults_env(faults, 1)[FAULTS_ENV] and "slow" not in faults_env(faults, 1)[FAULTS_ENV]
    assert "kill" not in faults_env(faults, 2)[FAULTS_ENV] and "exit" in faults_env(faults, 2)[FAULTS_ENV]


@pytest.mark.parametrize("bad, why", [
    ("explode:rank=1", "not one of kill, hang, exit, slow"),
    ("kill:rank=1", "exactly one of step=N or after=SECONDS"),
    ("kill:step=3:after=2", "exactly one of"),
    ("kill:step=zero", "step='zero' is not an integer"),
    ("slow:factor=0.5", "factor from 1 to 1000"),
    ("kill:rank=-1:step=2", "rank must be an integer >= 0"),
    ({"action": "kill", "when": 3}, "a fault is a dict"),
])  # fmt: skip
def test_a_fault_that_could_never_fire_is_refused_before_launch(bad, why):
    with pytest.raises(errors.LaunchConfigError, match=why):
        parse_fault(bad)
    with pytest.raises(errors.LaunchConfigError, match=why):
        distributed(_steps, faults=[bad], **CPU)


@pytest.mark.parametrize("bad, why", [
    ("kill:rank=1:after=nan", "after must be a number of seconds from 0 to"),
    ("hang:rank=1:after=inf", "after must be a number of seconds from 0 to"),  # would never fire
    ("kill:rank=1:after=1e300", "after must be a number of seconds from 0 to"),  # overflowed the rank's timer
    ("slow:rank=1:factor=nan", "factor from 1 to 1000"),  # crashed the rank inside gpufleet
    ("slow:rank=1:factor=1e308", "factor from 1 to 1000"),  # OverflowError inside gpufleet's sleep
    ("exit:rank=1:step=2:code=256", "exit code from 0 to 255"),  # 256 would be reported as exit 0
    ("kill:rank=1:rank=0:step=2", "rank is given twice"),
    ("kill:rank=1:step=2:code=3", "kill takes no code"),
    ("slow:rank=1:step=3", "slow takes no step"),
    ({"action": "kill", "rank": True, "step": 2}, "rank must be an integer"),
    ({"action": "kill", "rank": 1, "after": "5"}, "after must be a number of seconds"),
    ("kill:rank=5:step=3", "rank 5 does not exist: the run has 2 ranks"),
    ("kill:rank=1:step=3:attempt=3", "attempt 3 never runs: the run makes at most 1 attempt"),
])  # fmt: skip
def test_odd_values_and_faults_this_run_cannot_fire_are_refused_before_launch(bad, why):
    with pytest.raises(errors.LaunchConfigError, match=why):
        distributed(_steps, faults=[bad], **CPU)


def test_every_wrong_fault_is_named_at_once_and_retries_make_later_attempts_valid():
    with pytest.raises(errors.LaunchConfigError) as info:
        distributed(_steps, faults=["kill:rank=1:after=nan", "exit:step=2:code=256"], **CPU)
    assert "'kill:rank=1:after=nan'" in str(info.value) and "'exit:step=2:code=256'" in str(info.value)
    distributed(_steps, faults=["kill:rank=1:step=3:attempt=2", "slow:factor=2:attempt=all"], max_retries=1, **CPU)
    with pytest.raises(errors.LaunchConfigError, match="rank 2 does not exist"):  # gpus=None: known at launch
        distributed(_steps, faults=["kill:rank=2:step=3"], **{**CPU, "gpus": None}).distributed(3)


def _plain_torch_steps(n: int) -> int:
    """A loop that uses nothing of gpufleet: its own process group, a plain optimizer."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    dist.destroy_process_group()
    return n


def test_a_step_fault_fires_in_a_loop_that_counts_only_torch_optimizer_steps():
    f = distributed(_plain_torch_steps, faults=["kill:rank=1:step=3"], **CPU)
    with pytest.raises(errors.WorkerSignalError, match="rank 1 of 2 failed first: killed by signal SIGKILL") as info:
        f.distributed(50)
    assert "gpufleet: injected fault: kill at step 3" in info.value.failures[1].log_tail


def _two_steps() -> None:
    runtime.report_step()
    runtime.report_step()


def test_a_fault_that_did_not_fire_is_told_in_the_ranks_log():
    handle = distributed(_two_steps, faults=["kill:rank=1:step=5", "exit:rank=0:after=600"], **CPU).submit()
    handle.result(timeout=120)  # nothing fired: the call succeeds, and the ranks' logs say why
    deadline = time.monotonic() + 30  # the lines come as each rank exits, after its result
    logs = {}
    while time.monotonic() < deadline and not all("never fired" in logs.get(r, "") for r in (0, 1)):
        time.sleep(0.2)
        logs = {r: handle.logs(r) for r in (0, 1)}
    assert "gpufleet: injected fault 'kill:rank=1:step=5' never fired: this rank counted 2 steps" in logs[1]
    assert "gpufleet: injected fault 'exit:rank=0:after=600' never fired: this rank ended" in logs[0]
    assert "'kill:rank=1" not in logs[0] and "'exit:rank=0" not in logs[1]  # each rank tells its own
