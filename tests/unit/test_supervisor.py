"""The supervisor core of every stored run (a workload's, a detached call's), over a scripted run: no processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.runs.records import RunRecord
from gpufleet.runs.store import RunStore
from gpufleet.runs.supervisor import Supervisor
from gpufleet.states import CANCEL_REASON, CANCELED, FAILED, PENDING, RunState


class ScriptedRun:
    """Waits for a cancel (or raises ``error``) and returns what the supervisor says stopped it."""

    def __init__(self, sup: Supervisor, error: Exception | None = None) -> None:
        self.sup, self.error = sup, error
        self.cancel_set_at_start: bool | None = None
        self.ended_with: list[RunState] = []

    def run(self) -> tuple[RunState, int | None, str | None]:
        self.cancel_set_at_start = self.sup.cancel_event.is_set()
        if self.error is not None:
            raise self.error
        assert self.sup.cancel_event.wait(30), "no cancel reached the run"
        return CANCELED, None, self.sup.cancel_reason

    def ended(self, state: RunState) -> None:
        self.ended_with.append(state)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield RunStore(tmp_path / "home")
    for s, h in handlers.items():  # the supervisor's handlers go with the test
        signal.signal(s, h)


def _supervisor(store: RunStore, tmp_path: Path, state: RunState = PENDING) -> Supervisor:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store.create_run(RunRecord(id="20260101-000000-sup-aaaaaa", experiment="sup", state=state, created_at=time.time(),
                               config={}, run_dir=str(run_dir), num_nodes=1, world_size=1, max_attempts=1))  # fmt: skip
    return Supervisor("20260101-000000-sup-aaaaaa", str(store.home))


@pytest.mark.parametrize(("signum", "reason"), [(signal.SIGTERM, CANCEL_REASON),
                                                (signal.SIGINT, "canceled (SIGINT to the supervisor)")])  # fmt: skip
def test_a_signal_to_the_supervisor_cancels_its_run_with_the_one_reason(
    store: RunStore, tmp_path: Path, signum: int, reason: str
) -> None:
    sup = _supervisor(store, tmp_path)
    run = ScriptedRun(sup)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signum)).start()
    assert sup.main(run) == 0
    stored = store.get(sup.run.id)
    assert (stored.state, stored.message, stored.supervisor_pid) == (CANCELED, reason, os.getpid())
    outcome = json.loads((sup.run_dir / "outcome.json").read_text())  # written before the store, for a busy one
    assert (outcome["state"], outcome["message"]) == (CANCELED, reason)
    assert run.cancel_set_at_start is False and run.ended_with == [CANCELED]


def test_a_cancel_stored_before_the_supervisor_started_is_read_as_it_starts(store: RunStore, tmp_path: Path) -> None:
    sup = _supervisor(store, tmp_path)
    store.request_cancel(sup.run.id)
    run = ScriptedRun(sup)
    sup.main(run)
    assert run.cancel_set_at_start is True and store.get(sup.run.id).state == CANCELED


def test_a_cancel_stored_while_it_runs_reaches_the_run_through_the_heartbeat(store: RunStore, tmp_path: Path) -> None:
    sup = _supervisor(store, tmp_path)
    threading.Timer(0.3, lambda: store.request_cancel(sup.run.id)).start()
    run = ScriptedRun(sup)
    sup.main(run)
    stored = store.get(sup.run.id)
    assert (stored.state, stored.message) == (CANCELED, CANCEL_REASON) and stored.heartbeat_at is not None


def test_a_run_that_breaks_is_failed_with_its_error_and_one_that_ended_before_it_started_never_runs(
    store: RunStore, tmp_path: Path
) -> None:
    sup = _supervisor(store, tmp_path)
    run = ScriptedRun(sup, error=ValueError("the payload is broken"))
    sup.main(run)
    stored = store.get(sup.run.id)
    assert (stored.state, stored.message) == (FAILED, "run failed: the payload is broken")
    assert run.ended_with == [FAILED]

    late = Supervisor(sup.run.id, str(store.home))  # its run is no longer PENDING (a second supervisor, say)
    never = ScriptedRun(late)
    assert late.main(never) == 0
    assert never.cancel_set_at_start is None and never.ended_with == [CANCELED]
    assert store.get(sup.run.id).state == FAILED  # unchanged
