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


def _steady_then(fault: str) -> None:
    import ctypes
    import os
    import signal

    import torch
    import torch.distributed as dist

    runtime.setup()
    for _ in range(6):  # rank 1's last progress record (once a second) has it past its first steps
        time.sleep(0.5)
        dist.all_reduce(torch.ones(4))
        runtime.report_step()
    if runtime.get_global_rank() == 1:
        if fault == "sleep":
            time.sleep(600)  # FAULT sleep
        elif fault == "gil":
            libc = ctypes.PyDLL(None)
            while True:
                libc.sleep(600)  # FAULT gil: holds the GIL
        elif fault == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # FAULT sigstop
    dist.all_reduce(torch.ones(4))


def _long_phases_and_a_busy_rank(root: str) -> str:
    import os
    from pathlib import Path

    import numpy as np
    import torch
    import torch.distributed as dist

    from gpufleet.checkpoint import CheckpointManager

    def steps(n: int) -> None:
        for _ in range(n):
            time.sleep(0.3)
            dist.all_reduce(torch.ones(4))
            runtime.report_step()

    runtime.setup()
    rank = runtime.get_global_rank()
    if rank == 0:
        time.sleep(5)  # a model load before the first step, rank 1 waits
    dist.barrier()
    steps(5)
    with runtime.section("eval"):
        if rank == 0:
            time.sleep(5)  # a long evaluation
        dist.barrier()
    # steps enough for the watchdog to learn their pace after the section (it reads the ranks'
    # progress once a second, and skips the first step after a section): a loaded machine once
    # left it nothing learned after two steps, and then only hang_timeout would have spoken
    steps(8)
    # rank 1 computes until the watchdog has said so, while rank 0 waits in the barrier; the bound
    # (200 s) is only a backstop: the watchdog speaks after twice the slowest step it saw
    if rank == 1:
        note = Path(os.environ["GPUFLEET_RUN_DIR"]) / "watchdog.json"
        t0, x = time.monotonic(), np.random.rand(200, 200)
        # Until the watchdog's busy note (not any earlier note that merely says "(busy)"); one line,
        # so that a stack sampled in the loop's test or in its work is on the BUSY line either way.
        while time.monotonic() - t0 < 200 and "busy in its own code" not in (note.read_text() if note.exists() else ""): x = np.tanh(x @ x)  # BUSY numpy  # noqa: E701, E501
    dist.barrier()
    steps(2)

    class SlowState:
        def state_dict(self) -> dict:
            if rank == 0:
                time.sleep(5)  # a slow checkpoint save on rank 0
            return {"x": 1}

        def load_state_dict(self, state: dict) -> None:
            pass

    CheckpointManager(root, model=torch.nn.Linear(2, 2), stateful={"slow": SlowState()}).save(9)
    steps(2)
    return "done"


@pytest.fixture
def small_fast_limit(monkeypatch):
    """The fast path's floor at 5 s and 2 x the slowest step (the defaults: 25 s and 8 x)."""
    monkeypatch.setenv("GPUFLEET_HANG_FLOOR_S", "5")
    monkeypatch.setenv("GPUFLEET_HANG_FACTOR", "2")


@pytest.mark.parametrize(("fault", "doing"), [
    ("gil", "its progress reporter has not run"), ("sigstop", "(stopped: SIGSTOP or SIGTSTP)"),
])  # fmt: skip (a plain sleep: the tests below and tests/unit/test_hang_watchdog.py)
def test_a_steady_state_hang_is_called_after_the_learned_limit_with_its_line(small_fast_limit, fault, doing):
    started = time.monotonic()
    with pytest.raises(errors.DistributedHangError) as info:
        distributed(_steady_then, hang_timeout=150, timeout=140, **CPU).distributed(fault)
    took = time.monotonic() - started
    text = str(info.value)
    assert took < 120, text  # the fast path, long before hang_timeout=150 s
    assert "the limit learned from this run" in text
    assert "rank 1 missing from all_reduce #7 [[4]], which rank 0 waits in" in text
    assert "rank 0: waiting in all_reduce #7 [[4]]" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("  rank 1: "))
    assert f"# FAULT {fault}" in line and "in its own code at " in line and "test_hangs.py" in line
    assert "after all_reduce #6 [[4]]" in line and doing in line, line
    assert info.value.rank == 1


def test_long_phases_and_a_busy_rank_are_never_called_hangs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("GPUFLEET_HANG_FLOOR_S", "3")  # each phase (5 s) is longer than the learned limit
    monkeypatch.setenv("GPUFLEET_HANG_FACTOR", "2")
    with caplog.at_level("WARNING", logger="gpufleet.launch.hangwatch.watchdog"):
        out = distributed(_long_phases_and_a_busy_rank, hang_timeout=300, timeout=280, **CPU).distributed(
            str(tmp_path / "ckpt"))
    assert out == ["done", "done"]
    busy = [r.getMessage() for r in caplog.records if "busy in its own code" in r.getMessage()]
    assert busy and "rank 1 at " in busy[0] and "# BUSY numpy" in busy[0], caplog.text
    assert "not called a hang before hang_timeout=300 s" in busy[0]


def _run_hung(fn):
    started = time.monotonic()
    with pytest.raises(errors.DistributedHangError) as info:
        distributed(fn, hang_timeout=HANG_S, timeout=120, **CPU).distributed()
    return info.value, time.monotonic() - started


def test_a_rank_sleeping_outside_the_collective_is_named_with_its_line():
    err, took = _run_hung(_rank_1_sleeps_outside_the_collective)
    assert took < 90  # the watchdog, long before the call's timeout of 120 s
    text = str(err)
    assert "rank 1 missing from all_reduce #2 [[4]], which rank 0 waits in" in text
    assert "time.sleep(600)  # rank 1 never comes to collective #2" in text  # rank 1's own line
    assert "rank 0: waiting in all_reduce #2" in text and "dist.all_reduce(t)" in text
    assert "in its own code at " in text and "after all_reduce #1 [[4]] (idle)" in text
    assert err.rank == 1 and isinstance(err, errors.DistributedTimeoutError)
    assert "hang-report.txt" in text


def test_a_rank_stuck_in_a_loop_of_its_own_code_is_named():
    err, _ = _run_hung(_rank_1_loops_forever)
    assert err.rank == 1
    text = str(err)
    assert "rank 1 missing from barrier" in text and "after all_reduce #1 [[2]] (busy)" in text
    # its stack was taken somewhere in the loop: on the loop's line or on the line inside it
    assert re.search(r"in _rank_1_loops_forever: (while True:|x \+= 1)", text), text


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
