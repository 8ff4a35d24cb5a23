"""Tracking never takes CPU from the ranks it waits for: import slots, and background threads at a lower priority."""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet.launch import worker
from gpufleet.results import RunDir


def _hold(path: Path) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_rank_waiting_for_a_slot_goes_on_once_the_run_is_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two cores: one import at a time
    late = tmp_path / "late-env.json"
    importing = _hold(tmp_path / "import-slot-0.lock")  # rank 0 imports torch for the store
    got: list[bool] = []

    def rank_1() -> None:
        with worker._import_slot(RunDir(tmp_path), 1, str(late), must=False) as slot:
            got.append(slot)

    waiting = threading.Thread(target=rank_1)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and got == []  # the run is not open yet: it waits for the slot
    late.write_text("{}")  # the caller opened the run
    waiting.join(60)
    assert got == [False]  # it went on without importing beside rank 0
    os.close(importing)
    with worker._import_slot(RunDir(tmp_path), 1, str(tmp_path / "not-yet.json"), must=False) as slot:
        assert slot is True  # a free slot is taken


def test_with_more_cores_than_ranks_nobody_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    held = _hold(tmp_path / "import-slot-0.lock")  # rank 0 importing
    got: list[bool] = []

    def ranks() -> None:
        for rank in range(1, 8):
            with worker._import_slot(RunDir(tmp_path), rank, str(tmp_path / "late-env.json"), must=False) as slot:
                got.append(slot)

    try:
        others = threading.Thread(target=ranks, daemon=True)
        others.start()
        others.join(60)
        assert got == [True] * 7  # each took a slot of its own at once, beside rank 0
    finally:
        os.close(held)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread nice values are Linux's")
def test_tracking_background_threads_yield_the_cpu_and_leave_the_rest_alone() -> None:
    from gpufleet.tracking.runs import yield_cpu_to_training

    seen: dict[str, int] = {}

    def background() -> None:
        yield_cpu_to_training()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=background)
    t.start()
    t.join(5)
    assert seen["thread"] == min(19, before + 10)  # the tracking thread runs at a lower priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller keeps its own
