"""Fixtures of the workload tests: a private store per test, and no run left running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.runs.liveness import kill_run_processes
from gpufleet.runs.store import RunStore
from tests.workload.helpers import wait_no_processes


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private GPUFLEET_HOME; fails the test if any of its runs left a process running."""
    h = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(h))
    yield h
    if not (h / "runs.db").exists():
        return
    store = RunStore(h)
    leftovers = {}
    for run in store.list(states=None, limit=None):
        left = wait_no_processes(run.id)
        if left:
            leftovers[run.id] = [(p.pid, p.cmdline()) for p in left]
            kill_run_processes(run.id, grace_period_s=0.5)
    if leftovers:
        pytest.fail(f"runs left processes running: {leftovers}")


@pytest.fixture
def store(home: Path) -> RunStore:
    """The run store in the private home."""
    return RunStore(home)
