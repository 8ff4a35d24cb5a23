"""Low items: settings that could never work, and state that cannot be written, are clear errors."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from gpufleet import distributed, errors
from gpufleet.private import UnsafeStateError
from gpufleet.runs.store import RunStore
from tests.workload.helpers import REPO, cli, write_workload

CPU = {"gpus": 1, "gpu_type": "cpu", "tracking": False, "stream_logs": False}


def _one() -> int:
    return 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, True])
def test_grace_period_that_is_not_a_finite_number_is_refused(bad):
    with pytest.raises(errors.LaunchConfigError, match=r"grace_period_s must be a finite number of seconds >= 0"):
        distributed(_one, grace_period_s=bad, **CPU)


@pytest.mark.parametrize("bad", [1e-9, 0.5, float("nan")])
def test_a_hang_timeout_shorter_than_the_progress_reports_is_refused(bad):
    with pytest.raises(errors.LaunchConfigError, match=r"hang_timeout must be .* at least 1"):
        distributed(_one, hang_timeout=bad, **CPU)


def _checkpoint_errors(roots: list[str]) -> list[str]:
    from gpufleet.checkpoint import CheckpointError, CheckpointManager

    said = []
    for root in roots:
        try:
            CheckpointManager(root)
        except CheckpointError as e:
            said.append(str(e))
    return said


def test_a_checkpoint_folder_that_is_a_file_is_a_clear_error(tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("not a folder")
    (said,) = distributed(_checkpoint_errors, **CPU).distributed([str(target), str(target / "run1")])
    assert len(said) == 2, said  # was: FileExistsError, NotADirectoryError
    assert f"{target} is a file, not a folder; give root= a folder path" in said[0]
    assert f"{target / 'run1'} lies under {target}, which is a file" in said[1]


def test_a_read_only_home_is_a_clear_error(tmp_path, monkeypatch):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only file system here: {done.stderr.decode().strip()}")
    try:
        monkeypatch.setenv("GPUFLEET_HOME", str(readonly / ".gpufleet"))
        with pytest.raises(UnsafeStateError, match=r"cannot be created: Read-only file system.*GPUFLEET_HOME"):
            distributed(_one, **CPU).distributed()
        rc = subprocess.run([sys.executable, "-m", "gpufleet.cli", "list"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "GPUFLEET_HOME": str(readonly / ".gpufleet")}, timeout=60)  # fmt: skip
        assert rc.returncode == 2 and "Read-only file system" in rc.stderr and "Traceback" not in rc.stderr, rc.stderr
    finally:
        subprocess.run(["umount", str(readonly)], capture_output=True)


def test_logs_follow_of_a_run_deleted_meanwhile_says_so(tmp_path, home, store: RunStore, capsys):
    wl = write_workload(tmp_path, command="echo the-follower-shows-this; sleep 60")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.strip().splitlines()[-1]
    follower = subprocess.Popen([sys.executable, "-m", "gpufleet.cli", "logs", run_id, "--follow"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    shown = threading.Event()

    def read_lines() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            if "the-follower-shows-this" in line:
                shown.set()

    reader = threading.Thread(target=read_lines, daemon=True)
    reader.start()
    try:
        # the follower has read the run's row once it shows the command's line, however slow its start
        assert shown.wait(120), "the follower never showed the run's log"
        with sqlite3.connect(home / "runs.db") as db:
            db.execute("DELETE FROM attempts WHERE run_id = ?", (run_id,))
            db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
        follower.wait(timeout=60)
        assert follower.stderr is not None
        said = follower.stderr.read()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        reader.join(10)
        cli(capsys, "cancel", "--all")
        from gpufleet.runs.liveness import kill_run_processes

        kill_run_processes(run_id, grace_period_s=0.5)
    assert follower.returncode == 1, said
    assert "Traceback" not in said and f"run {run_id} was removed from the run store while it was followed" in said
