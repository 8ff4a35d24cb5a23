"""A run store locked by another process never changes a run's outcome, and never hangs the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    cli,
    cli_process,
    wait_for_text,
    wait_no_processes,
    wait_state,
    write_workload,
)
from tests.workload.store_lock import ALL, WRITES, store_locked


def test_a_run_that_ends_while_the_store_is_locked_still_succeeds(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command ends while another process holds the store; it was recorded FAILED ("database is locked")."""
    # the supervisor gives up on each write after a second: it has to retry to record the outcome
    monkeypatch.setenv("GPUFLEET_SUPERVISOR_STORE_WAIT_S", "1")
    wl = write_workload(tmp_path, command="echo started; sleep 1; echo done")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.strip()
    run = wait_state(store, run_id, ("RUNNING",))
    run_dir = Path(run.run_dir)
    wait_for_text(run_dir / "attempts" / "1" / "node-0.log", "started")
    with store_locked(home, WRITES):
        wait_for_text(run_dir / "attempts" / "1" / "node-0.log", "done")
        deadline = time.monotonic() + 30
        while not (run_dir / "outcome.json").exists():
            assert time.monotonic() < deadline, (run_dir / "supervisor.log").read_text()
            time.sleep(0.1)
        assert store.get(run_id).state == "RUNNING"  # the store could not learn it yet
        # a read shows the outcome at once, from the run's folder
        t0 = time.monotonic()
        shown = cli_process("get", run_id, "-o", "json", env={"GPUFLEET_STORE_WAIT_S": "90"}, timeout=120)
        assert shown.returncode == 0, shown.stderr
        assert "up to 90 s" not in shown.stderr and time.monotonic() - t0 < 60  # it did not wait the 90 s
        got = json.loads(shown.stdout)
        assert got["state"] == "SUCCESS" and got["exit_code"] == 0, got
        listed = cli_process("list", "--all-status", "-o", "json", env={"GPUFLEET_STORE_WAIT_S": "90"}, timeout=120)
        assert listed.returncode == 0 and json.loads(listed.stdout)[0]["state"] == "SUCCESS", listed.stderr
        wait_for_text(run_dir / "supervisor.log", "could not record the outcome in the run store yet")
        time.sleep(2.5)  # longer than the supervisor's wait for one write
        assert store.get(run_id).state == "RUNNING"
    # the supervisor records it itself once the lock is gone
    run = wait_state(store, run_id, timeout=30)
    assert run.state == "SUCCESS" and run.exit_code == 0 and run.message is None, (run.state, run.message)
    assert [a.state for a in run.attempts] == ["SUCCESS"]
    log = (run_dir / "supervisor.log").read_text()
    assert f"run {run_id} finished: SUCCESS" in log and "Traceback" not in log
    assert wait_no_processes(run_id) == []
    assert cli(capsys, "get", run_id, "-o", "json")[0] == 0


def test_reads_go_on_while_another_process_writes(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """`BEGIN EXCLUSIVE` elsewhere stops writers only: list and get answer at once (every command waited 60 s)."""
    wl = write_workload(tmp_path, command="true")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking", "--watch")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    with store_locked(home, WRITES):
        for argv in (["list", "--all-status"], ["get", run_id], ["logs", run_id]):
            t0 = time.monotonic()
            done = cli_process(*argv, env={"GPUFLEET_STORE_WAIT_S": "90"}, timeout=120)
            assert done.returncode == 0, done.stderr
            assert "busy" not in done.stderr and time.monotonic() - t0 < 60  # it did not wait the 90 s
    assert wait_no_processes(run_id) == []


def test_list_waits_for_a_locked_store_then_says_so(home: Path, store: RunStore) -> None:
    """Past the wait (GPUFLEET_STORE_WAIT_S), a clear error and exit 2; it hung 60 s and printed a traceback."""
    with store_locked(home, ALL):
        t0 = time.monotonic()
        done = cli_process("list", env={"GPUFLEET_STORE_WAIT_S": "1.5"}, timeout=60)
        took = time.monotonic() - t0
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == "gpufleet: the run store is busy (locked by another process); waiting up to 1.5 s...", lines
    assert len(lines) == 2 and lines[1].startswith("error: the run store ") and "stayed busy" in lines[1], lines
    assert 1.5 <= took < 45  # it gave up after the 1.5 s asked for (it used to hang 60 s)
    # and once the lock is gone, it answers
    assert cli_process("list").returncode == 0
