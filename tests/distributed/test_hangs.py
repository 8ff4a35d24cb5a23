"""The hang watchdog names the rank that never came, the collective, and each rank's line."""

from __future__ import annotations

import re
import time

import pytest

from gpufleet import distributed, errors, runtime

CPU = {"gpus": 2, "gpu_type": "cpu", "tracking": False, "stream_logs": False, "grace_period_s": 1.0}
HANG_S = 4.0


def _rank_1_sleeps_outside_the_collective() -> None:
    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.ones(4)
    dist.all_reduce(t)  # collective #1: both ranks
    if runtime.get_global_rank() == 1:
        time.sleep(600)  # rank 1 never comes to collective #2
    dist.all_reduce(t)


def _rank_1_loops_forever() -> None:
    import torch
    import torch.distributed as dist

    runtime.setup()
    dist.all_reduce(torch.ones(2))
    if runtime.get_global_rank() == 1:
        x = 0
        while True:  # stuck in its own code
            x += 1
    dist.barrier()


def _ranks_in_different_collectives() -> None:
    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.ones(8)
    dist.all_reduce(t)
    if runtime.get_global_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(torch.ones(3), src=1)


def _slow_but_moving(steps: int, pause_s: float) -> int:
    import torch
    import torch.distributed as dist

    runtime.setup()
    for _ in range(steps):
        time.sleep(pause_s)
        dist.all_reduce(torch.ones(1))
    return steps


def _run_hung(fn):
    started = time.monotonic()
    with pytest.raises(errors.DistributedHangError) as info:
        distributed(fn, hang_timeout=HANG_S, timeout=120, **CPU).distributed()
    return info.value, time.monotonic() - started


def test_a_rank_sleeping_outside_the_collective_is_named_with_its_line():
    err, took = _run_hung(_rank_1_sleeps_outside_the_collective)
    assert took < 60  # the watchdog's 4 s after start-up, long before the call's 120 s timeout
    text = str(err)
    assert "rank 1 missing from all_reduce #2 [[4]], which rank 0 waits in" in text
    assert "time.sleep(600)  # rank 1 never comes to collective #2" in text  # rank 1's own line
    assert "rank 0: waiting in all_reduce #2" in text and "dist.all_reduce(t)" in text
    assert err.rank == 1 and isinstance(err, errors.DistributedTimeoutError)
    assert "hang-report.txt" in text


def test_a_rank_stuck_in_a_loop_of_its_own_code_is_named():
    err, _ = _run_hung(_rank_1_loops_forever)
    assert err.rank == 1
    assert "rank 1 missing from barrier" in str(err)
    # its stack was taken somewhere in the loop: on the loop's line or on the line inside it
    assert re.search(r"rank 1: missing from barrier .* in _rank_1_loops_forever: (while True:|x \+= 1)", str(err)), str(err)


def test_ranks_waiting_in_different_collectives_are_called_mismatched():
    err, _ = _run_hung(_ranks_in_different_collectives)
    text = str(err)
    assert "mismatched collectives" in text
    assert "rank 0 in allreduce #2 [[8]]" in text.replace("all_reduce", "allreduce")
    assert "rank 1 in broadcast #2 [[3]]" in text


def test_slow_training_that_moves_is_never_flagged():
    # 8 s in all, longer than the 6 s watchdog; a step every second, a sixth of it (a loaded
    # machine stretches a step, never by seconds)
    f = distributed(_slow_but_moving, hang_timeout=6.0, timeout=120, **CPU)
    assert f.distributed(8, 1.0) == [8, 8]


def test_stacks_on_demand_show_each_ranks_frame():
    handle = distributed(_rank_1_sleeps_outside_the_collective, hang_timeout=300, timeout=120, **CPU).submit()
    try:
        deadline = time.monotonic() + 60
        stacks: dict[int, str] = {}
        while time.monotonic() < deadline:
            stacks = handle.stacks()
            if all("_rank_1_sleeps_outside_the_collective" in stacks.get(r, "") for r in (0, 1)):
                break  # both ranks are in the function (not still importing torch)
            time.sleep(0.5)
        assert set(stacks) == {0, 1}
        assert "_rank_1_sleeps_outside_the_collective" in stacks[1] and "test_hangs.py" in stacks[1]
        assert "_rank_1_sleeps_outside_the_collective" in stacks[0]
    finally:
        handle.cancel()


def test_hang_timeout_is_checked():
    for bad in (0, -1, float("inf"), "10"):
        with pytest.raises(errors.LaunchConfigError, match="hang_timeout must be"):
            distributed(_slow_but_moving, hang_timeout=bad, **CPU)
