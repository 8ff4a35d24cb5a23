"""A cancel ends a run CANCELED whenever it comes: at once after `run`, and between two attempts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    REPO,
    cli,
    wait_for_text,
    wait_no_processes,
    wait_state,
    write_workload,
)
from tests.workload.store_lock import release, store_locked


def test_cancel_right_after_run_cancels(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    """The supervisor may not have its SIGTERM handler yet: it was killed, and the run FAILED, before."""
    wl = write_workload(tmp_path, command="echo started; sleep 60")
    for _ in range(5):
        rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
        assert rc == 0, out + err
        run_id = out.strip()
        rc, out, err = cli(capsys, "cancel", run_id)
        assert rc == 0 and out.split() == [run_id, "CANCELED"], out + err
        run = wait_state(store, run_id)
        assert run.state == "CANCELED", run.message
        assert run.message in ("canceled by the user before it started", "canceled by the user"), run.message
        assert wait_no_processes(run_id) == []
        assert "Traceback" not in (Path(run.run_dir) / "supervisor.log").read_text()


RETRIED = (
    'echo "attempt $GPUFLEET_ATTEMPT"; '
    'if [ "$GPUFLEET_ATTEMPT" = 1 ]; then '
    'while [ ! -e "$GPUFLEET_RUN_DIR/go" ]; do sleep 0.1; done; exit 3; fi; '
    "sleep 60"
)


def test_cancel_between_two_attempts_cancels(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attempt 1 fails with retries left; the cancel comes before attempt 2 starts: CANCELED, no attempt 2.

    The supervisor is held between the attempts by a lock on the run store (it waits to record
    attempt 1's end); `gpufleet cancel` signals it there, then waits for the store itself.
    """
    wl = write_workload(tmp_path, command=RETRIED, max_retries=2)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.strip()
    run = wait_state(store, run_id, ("RUNNING",))
    run_dir = Path(run.run_dir)
    wait_for_text(run_dir / "attempts" / "1" / "node-0.log", "attempt 1")
    deadline = time.monotonic() + 30
    while not store.get(run_id).attempts[0].nodes:  # the supervisor's last write before the attempt ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancel_err = tmp_path / "cancel.err"
    with store_locked(home) as holder:
        (run_dir / "go").touch()  # attempt 1 fails now
        # the supervisor waits for the store to record attempt 1's end: it is between the attempts
        wait_for_text(run_dir / "supervisor.log", "the run store is busy")
        with open(cancel_err, "w") as errors:
            cancel = subprocess.Popen(
                [sys.executable, "-m", "gpufleet.cli", "cancel", run_id], stdout=subprocess.PIPE, stderr=errors,
                text=True, cwd=REPO, env={**os.environ, "GPUFLEET_STORE_WAIT_S": "60"},
            )  # fmt: skip
        try:
            # it signaled the supervisor, and now waits to store the request
            wait_for_text(cancel_err, "the run store is busy (locked by another process); waiting")
            release(holder)
            out, _ = cancel.communicate(timeout=60)
        finally:
            if cancel.poll() is None:
                cancel.kill()
                cancel.wait()
    assert cancel.returncode == 0, out + cancel_err.read_text()
    assert out.split() == [run_id, "CANCELED"], out
    run = wait_state(store, run_id)
    assert run.state == "CANCELED", (run.state, run.message)
    assert "before attempt 2" in run.message and "attempt 1 ended FAILED" in run.message, run.message
    assert [a.attempt for a in run.attempts] == [1]
    assert not (run_dir / "attempts" / "2" / "node-0.log").exists()
    assert wait_no_processes(run_id) == []
