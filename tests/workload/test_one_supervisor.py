"""A detached call and a workload run are stored runs under the same supervisor: the same fields,
the same attempts, one id for every attempt, the same handle answers from any process."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from gpufleet import run_handle
from gpufleet.errors import RunCanceledError, WorkerGroupError
from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    SLEEPER,
    cli,
    cli_json,
    cli_process,
    detach_script,
    wait_no_processes,
    wait_state,
    wait_until,
    write_workload,
)

pytestmark = pytest.mark.usefixtures("home")

#: What a user follows a run by: set for a finished run of either kind.
FOLLOWED = ("id", "state", "kind", "run_dir", "created_at", "started_at", "ended_at", "supervisor_pid",
            "heartbeat_at", "exit_code", "max_attempts", "attempts", "log_paths", "duration_s")  # fmt: skip
ATTEMPT = ("attempt", "state", "started_at", "ended_at", "log_dir", "nodes", "exit_code")


@pytest.fixture(autouse=True)
def _no_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")


def test_a_detached_call_and_a_workload_run_show_the_same_fields_in_get_json(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    call_id = detach_script(tmp_path, """
        from gpufleet import distributed

        @distributed(gpus=2, gpu_type="cpu", tracking=False)
        def train():
            print("trained", flush=True)

    """)
    code, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, command="echo trained")), "--no-tracking")
    assert code == 0, err
    workload_id = out.strip()
    got = {}
    for run_id in (call_id, workload_id):
        wait_state(store, run_id)
        got[run_id] = cli_json(capsys, "get", run_id)
        assert wait_no_processes(run_id) == []
    call, workload = got[call_id], got[workload_id]
    assert (call["kind"], workload["kind"]) == ("call", "workload")
    assert sorted(call) == sorted(workload)
    for run in (call, workload):
        missing = [k for k in FOLLOWED if run[k] in (None, [], {})]
        assert missing == [] and run["state"] == "SUCCESS" and run["exit_code"] == 0, (run["kind"], missing)
        [attempt] = run["attempts"]
        assert [k for k in ATTEMPT if attempt[k] in (None, [])] == [] and attempt["attempt"] == 1, attempt
        assert attempt["log_dir"] == str(Path(run["run_dir"]) / "attempts" / "1")
        assert {"node_rank", "pid", "log_path"} <= set(attempt["nodes"][0])
        assert all(Path(p).read_text() for p in run["log_paths"]) and "trained" in Path(run["log_paths"][0]).read_text()
        code, setup, _ = cli(capsys, "logs", run["id"], "--setup")  # the supervisor's own log, for both
        assert code == 0 and f"run {run['id']} finished: SUCCESS" in setup, setup


def test_a_detached_call_and_a_workload_whose_first_attempt_fails_both_report_attempts_1_and_2(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    call_id = detach_script(tmp_path, """
        from gpufleet import distributed

        @distributed(gpus=2, gpu_type="cpu", tracking=False, max_retries=1)
        def train():
            import os
            if os.environ["GPUFLEET_ATTEMPT"] == "1":
                raise RuntimeError("attempt 1 fails")
            return int(os.environ["GPUFLEET_ATTEMPT"])

    """)
    wl = write_workload(tmp_path, command='test "$GPUFLEET_ATTEMPT" = 2 || exit 3', max_retries=1)
    code, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert code == 0, err
    workload_id = out.strip()
    for run_id in (call_id, workload_id):
        run = wait_state(store, run_id)
        stored = cli_json(capsys, "get", run_id)
        assert stored["state"] == "SUCCESS", stored
        assert [(a["attempt"], a["state"]) for a in stored["attempts"]] == [(1, "FAILED"), (2, "SUCCESS")]
        assert [a.log_dir for a in run.attempts] == [str(Path(run.run_dir) / "attempts" / n) for n in ("1", "2")]
        assert wait_no_processes(run_id) == []
    assert "RuntimeError: attempt 1 fails" in store.get(call_id).attempts[0].message
    assert run_handle(call_id).result(30) == [2, 2]  # one id for both attempts: the handle sees the last
    assert len(store.list(states=None, filters={"kind": "call"})) == 1  # not a record per attempt


def test_a_detached_run_goes_on_after_the_script_and_is_followed_with_logs(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = detach_script(tmp_path, """
        from gpufleet import distributed

        @distributed(gpus=2, gpu_type="cpu", tracking=False)
        def train(seconds=2):
            import time
            from gpufleet import runtime
            time.sleep(seconds)
            print("done on rank", runtime.get_global_rank(), flush=True)
            return runtime.get_global_rank()
    """)
    code, out, err = cli(capsys, "logs", run_id, "--follow")  # until it ends
    assert code == 0 and "done on rank 0" in out and "done on rank 1" in out, out + err
    run = wait_state(store, run_id)
    assert run.state == "SUCCESS" and run.origin["path"] == str(tmp_path / "script.py")
    assert wait_no_processes(run_id) == []
    handle = run_handle(run_id)  # found again from another process by its id
    assert handle.result(30) == [0, 1] and handle.status == "SUCCESS"


def test_a_detached_handle_reads_stacks_and_cancels_a_running_call_from_another_process(
    tmp_path: Path, store: RunStore
) -> None:
    call_id = detach_script(tmp_path, SLEEPER)
    handle = run_handle(call_id)  # this process did not start it
    wait_until("rank 1 prints", lambda: "waiting" in handle.logs(1), timeout=60)
    assert handle.status == "RUNNING" and not handle.done() and handle.pid
    stacks = handle.stacks()
    assert sorted(stacks) == [0, 1] and all("train" in stack for stack in stacks.values()), stacks
    handle.cancel(wait=60)
    assert handle.done() and handle.status == "CANCELED"
    assert store.get(call_id).message == "canceled by the user"
    assert wait_no_processes(call_id) == []
    with pytest.raises(RunCanceledError, match=r"the run was canceled \(canceled by the user\)"):
        handle.result(30)


def test_a_cancel_from_another_terminal_ends_a_detached_call_and_a_workload_the_same_way(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    call_id = detach_script(tmp_path, SLEEPER)
    code, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, command="sleep 120")), "--no-tracking")
    assert code == 0, err
    workload_id = out.strip()
    for run_id in (call_id, workload_id):
        wait_state(store, run_id, ("RUNNING",), timeout=60)
    start = time.monotonic()
    cancel = cli_process("cancel", call_id, workload_id, "-o", "json")  # another terminal
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert [r["state"] for r in json.loads(cancel.stdout)] == ["CANCELED", "CANCELED"]
    assert time.monotonic() - start < 45  # both sleep 120 s: stopped, not waited for
    ends = []
    for run_id in (call_id, workload_id):
        run = store.get(run_id)
        ends.append((run.state, run.message, run.attempts[-1].state, run.attempts[-1].message))
        assert wait_no_processes(run_id) == []
    assert ends == [("CANCELED", "canceled by the user", "CANCELED", "canceled by the user")] * 2
    with pytest.raises(RunCanceledError, match=r"the run was canceled \(canceled by the user\)"):
        run_handle(call_id).result(30)


def test_a_detached_call_whose_supervisor_was_killed_is_failed_and_its_result_raises_not_waits(
    tmp_path: Path, store: RunStore
) -> None:
    run_id = detach_script(tmp_path, SLEEPER)
    handle = run_handle(run_id)
    wait_until("rank 0 prints", lambda: "waiting" in handle.logs(0), timeout=60)
    pid = handle.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # the supervisor, as the out-of-memory killer would
    started = time.monotonic()
    with pytest.raises(WorkerGroupError, match=rf"run {run_id} ended FAILED without a result \(its supervisor, pid {pid}, "
                                               rf"is gone\): run failed: its supervisor process \(pid {pid}\) died"):  # fmt: skip
        handle.result(timeout=100)  # before: waited out the whole timeout (without one: for ever)
    assert time.monotonic() - started < 100
    assert handle.status == "FAILED"  # before: RUNNING for ever
    assert store.get(run_id).state == "FAILED"
    assert wait_no_processes(run_id) == []
