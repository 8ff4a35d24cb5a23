"""One recorder for both kinds of run, driven by the controller over scripted groups (no ranks run).

A call's attempts are runs of their own and a workload's are rows of one run; the same hooks
record both, with attempts numbered from 1 alike, and differ only where the kind says so.
"""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from gpufleet import distributed
from gpufleet.errors import RunCanceledError, WorkerExitError
from gpufleet.launch.controller import Controller
from gpufleet.launch.policy import RetryPolicy
from gpufleet.runs.calls import END_WAIT_S, CallKind
from gpufleet.runs.liveline import render_status
from gpufleet.runs.liveness import get_run
from gpufleet.runs.recorder import RunRecorder
from gpufleet.runs.records import RunRecord
from gpufleet.runs.store import RunStore
from gpufleet.runs.view import runs_table, status_line
from gpufleet.states import CANCEL_REASON, CANCELED, FAILED, RUNNING, SUCCESS
from gpufleet.workload.attempts import WorkloadKind
from tests.unit.test_controller import FakeClock, FakeGroup, exited, ok
from tests.workload.store_lock import store_locked

FAIL = [[exited(0, 3, t=1.0), exited(1, 3, t=1.0)]]
WIN = [[ok(0, "a"), ok(1, "b")]]


def _train(x: int) -> int:
    return x


def _call_kind() -> CallKind:
    return CallKind(distributed(gpus=2, gpu_type="cpu", max_retries=1, name="train")(_train), "local")


def _controller(tmp_path: Path, scripts: list, recorder: RunRecorder, policy: RetryPolicy) -> Controller:
    clock = FakeClock()

    def make_group(attempt: int) -> FakeGroup:
        return FakeGroup(tmp_path, clock, scripts[attempt - 1])

    return Controller(make_group, timeout_s=None, policy=policy, callbacks=[recorder], clock=clock, poll_s=0.02)


def _workload_run(store: RunStore, tmp_path: Path) -> RunRecord:
    run = RunRecord(id="20260101-000000-wl-aaaaaa", experiment="wl", state=RUNNING, created_at=time.time(),
                    config={}, run_dir=str(tmp_path), num_nodes=1, world_size=2, max_attempts=2)  # fmt: skip
    store.create_run(run)
    return run


def test_a_call_and_a_workload_whose_first_attempt_fails_both_record_attempts_1_and_2(store: RunStore, tmp_path: Path) -> None:
    call = RunRecorder(_call_kind(), store)
    c = _controller(tmp_path, [FAIL, WIN], call, RetryPolicy.for_call(1))
    assert c.run() == ["a", "b"]
    runs = sorted(store.list(states=None, filters={"kind": "call"}), key=lambda r: r.config["attempt"])
    assert [(r.config["attempt"], r.state, [a.attempt for a in r.attempts]) for r in runs] == [
        (1, FAILED, [1]), (2, SUCCESS, [2])]  # fmt: skip
    assert runs[1].config["call_id"] == runs[0].id and runs[0].message.startswith("WorkerExitError: ")
    first = runs[0].attempts[0]  # the attempt row ends with its run, with the run's message
    assert first.state == FAILED and first.ended_at and first.message == runs[0].message

    log = io.StringIO()
    run = _workload_run(store, tmp_path)
    workload = RunRecorder(WorkloadKind(None), store, run_id=run.id, log=log, max_attempts=2)
    c = _controller(tmp_path, [FAIL, WIN], workload, RetryPolicy.for_workload(2))
    assert c.run() == ["a", "b"]
    stored = store.get(run.id)
    assert [(a.attempt, a.state, a.exit_code) for a in stored.attempts] == [(1, FAILED, 3), (2, SUCCESS, 0)]
    assert stored.attempts[0].message.startswith("node 0 exited with code 3")
    assert stored.state == RUNNING  # the supervisor, not the recorder, ends a workload's run
    assert "gpufleet: attempt 1 ended FAILED; retrying (2/2)" in log.getvalue()
    # both recorders know how each attempt ended, by the same numbers
    assert sorted(call.ends) == sorted(workload.ends) == [1, 2]
    assert [e.state for e in call.ends.values()] == [e.state for e in workload.ends.values()] == [FAILED, SUCCESS]
    # and every view numbers the second attempt 2, for both kinds
    for record in (store.get(runs[1].id), stored):
        assert record.attempt == 2
        assert "| attempt 2/2 |" in status_line(record)
        shown = io.StringIO()
        Console(file=shown, width=200).print(render_status(record))
        assert "attempt 2/2" in shown.getvalue()
        table = io.StringIO()
        runs_table([record], out=table)
        assert "2/2" in table.getvalue().splitlines()[1].split()


def test_a_calls_end_goes_to_its_outcome_file_while_the_store_is_locked(home: Path, tmp_path: Path) -> None:
    store = RunStore(home, wait_s=0.2)
    recorder = RunRecorder(_call_kind(), store, end_wait_s=END_WAIT_S)
    clock = FakeClock()
    groups: list[FakeGroup] = []

    def make_group(attempt: int) -> FakeGroup:
        groups.append(FakeGroup(tmp_path, clock, FAIL))
        return groups[-1]

    c = Controller(make_group, timeout_s=None, callbacks=[recorder], clock=clock, poll_s=0.02)
    c.start()  # its run row is made while the store is free
    with store_locked(home):
        start = time.monotonic()
        with pytest.raises(WorkerExitError):
            c.run()
        took = time.monotonic() - start
    outcome = json.loads((groups[0].run_dir.path / "outcome.json").read_text())
    assert outcome["state"] == FAILED and outcome["message"].startswith("WorkerExitError: ")
    assert took < END_WAIT_S + 5  # bounded: the call is not held up by the store
    assert store.get(groups[0].run_id).state == RUNNING  # the store never learned the end...
    assert get_run(store, groups[0].run_id).state == FAILED  # ...which the next CLI read records


def test_a_stored_cancel_request_cancels_a_call_but_is_left_to_a_workloads_supervisor(store: RunStore, tmp_path: Path) -> None:
    endless = [[[]] * 10_000_000]
    call = RunRecorder(_call_kind(), store)
    c = _controller(tmp_path, endless, call, RetryPolicy.for_call(0))
    c.start()
    assert f"gpufleet-registry-{c.group.run_id}" in [t.name for t in threading.enumerate()]  # the call's reader
    store.request_cancel(c.group.run_id)
    with pytest.raises(RunCanceledError, match=CANCEL_REASON):
        c.run()
    assert (store.get(c.group.run_id).state, store.get(c.group.run_id).message) == (CANCELED, CANCEL_REASON)

    run = _workload_run(store, tmp_path)
    workload = RunRecorder(WorkloadKind(None), store, run_id=run.id)
    c = _controller(tmp_path, endless, workload, RetryPolicy.for_workload(1))
    c.start()
    store.request_cancel(run.id)
    watching = [t.name for t in threading.enumerate() if t.name == f"gpufleet-registry-{run.id}"]
    assert watching == [] and not c.canceled and c.state == RUNNING  # nothing of the recorder reads the request
    c.cancel(CANCEL_REASON)
    with pytest.raises(RunCanceledError):
        c.run()
    attempt = store.get(run.id).attempts[0]
    assert (attempt.state, attempt.message) == (CANCELED, CANCEL_REASON)  # the same words as the call's


def test_the_watchdogs_note_is_the_running_runs_message_for_both_kinds(store: RunStore, tmp_path: Path) -> None:
    call = RunRecorder(_call_kind(), store)
    run = _workload_run(store, tmp_path)
    workload = RunRecorder(WorkloadKind(None), store, run_id=run.id)
    for recorder in (call, workload):
        group = FakeGroup(tmp_path, FakeClock(), [])
        recorder.before_start(group, 1)
        recorder.on_watch(group, 1, "rank 1 is busy in train.py:40 while the others wait")
        assert store.get(recorder._run_of(group)).message == "rank 1 is busy in train.py:40 while the others wait"


def test_a_call_interrupted_while_its_ranks_start_is_stored_canceled(store: RunStore, tmp_path: Path) -> None:
    clock = FakeClock()
    recorder = RunRecorder(_call_kind(), store)

    def make_group(attempt: int) -> FakeGroup:
        return FakeGroup(tmp_path, clock, [], start_error=KeyboardInterrupt())

    c = Controller(make_group, timeout_s=None, callbacks=[recorder], clock=clock, poll_s=0.02)
    with pytest.raises(KeyboardInterrupt):
        c.start()
    [run] = store.list(states=None, filters={"kind": "call"})
    assert (c.state, recorder.ends[1].state, run.state, run.attempts[0].state) == (CANCELED,) * 4
    assert run.message == "interrupted (KeyboardInterrupt) before its ranks started"


def test_a_calls_recoveries_are_kept_in_its_attempt_row_and_shown_by_get(store: RunStore, tmp_path: Path) -> None:
    from gpufleet.launch.store import Recovered
    from gpufleet.runs.formats import fmt_time
    from gpufleet.runs.view import run_details
    from tests.unit.test_replace_policy import ReplacingGroup, _killed

    clock = FakeClock()
    script = [[], [_killed(1, 1.0)], [], [], [ok(0, "a"), ok(1, "b")]]
    back = {3: Recovered(generation=1, rank=1, resumed_step=29, steps_lost=0, at=3.25)}
    c = Controller(lambda attempt: ReplacingGroup(tmp_path, clock, script, back=back), timeout_s=None,
                   policy=RetryPolicy.for_call(0, recovery="replace"), callbacks=[RunRecorder(_call_kind(), store)],
                   clock=clock, poll_s=0.02)  # fmt: skip
    assert c.run() == ["a", "b"]
    (run,) = store.list(states=None, filters={"kind": "call"})
    (stored,) = run.attempts[0].recoveries
    assert stored == {"attempt": 1, "number": 1, "rank": 1, "cause": "SIGKILL", "outcome": "recovered", "died_at": 1.0,
                      "old_pid": 1001, "new_pid": 4242, "warm": False, "generation": 1, "resumed_step": 29, "steps_lost": 0,
                      "recovered_at": 3.25, "seconds_lost": 2.25, "reason": None}  # fmt: skip
    shown = io.StringIO()
    run_details(run, out=shown)
    assert (f"recovery 1 of attempt 1 at {fmt_time(1.0)}: rank 1 (SIGKILL) is back: every rank went on after step 29, "
            "2.25 s after the death; 0 steps trained again (pid 1001 -> 4242)\n") in shown.getvalue()
    assert json.loads(json.dumps(run.to_dict()))["attempts"][0]["recoveries"] == [stored]  # what -o json prints


def test_a_stored_recovery_that_is_not_one_is_shown_as_it_is_and_breaks_no_view() -> None:
    from gpufleet.runs.formats import recovery_lines

    broken = {"attempt": 1, "number": 1, "rank": 1, "cause": "SIGKILL", "outcome": "recovered", "died_at": "soon",
              "seconds_lost": None}  # fmt: skip
    assert recovery_lines([{"x": 1}, broken, "text"]) == [
        "recovery (not a record gpufleet writes): {'x': 1}",
        f"recovery (not a record gpufleet writes): {broken!r}",
        "recovery (not a record gpufleet writes): 'text'",
    ]
