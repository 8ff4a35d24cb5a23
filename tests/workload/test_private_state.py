"""gpufleet's state is private: folders 0700, files 0600, and a folder it cannot trust is refused.

A home folder that is someone else's, writable by others, a file or read-only, and a damaged
``runs.db``, end every command with one ``error:`` line and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import REPO, cli, wait_no_processes, wait_state, write_workload

OTHER_UID = 54321


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask of a shell (022): what is private is so because gpufleet made it so."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_state_folders_and_files_are_private(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str], open_umask: None
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.sh").write_text("echo hello\n")
    (code / "conf").mkdir()
    (code / "conf" / "run.sh").write_text("echo run\n")
    os.chmod(code / "conf" / "run.sh", 0o755)  # an executable of the code folder stays one, for the user
    wl = write_workload(
        code, code_source={"root_path": "."},
        command='umask > "$GPUFLEET_RUN_DIR/umask.txt"; echo made > "$GPUFLEET_CHECKPOINT_DIR/made.txt"; sh train.sh',
    )  # fmt: skip
    assert not home.exists()
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    store = RunStore(home)
    run = wait_state(store, run_id)
    run_dir = Path(run.run_dir)
    folders = [home, home / "workloads", run_dir, run_dir / "code", run_dir / "code" / "conf", run_dir / "attempts" / "1",
               run_dir / "checkpoints"]  # fmt: skip
    assert {str(p): oct(_mode(p)) for p in folders} == {str(p): oct(0o700) for p in folders}
    files = [
        home / "runs.db", run_dir / "supervisor.log", run_dir / "outcome.json", run_dir / "hyperparameters.yaml",
        run_dir / "workload.yaml", run_dir / "attempts" / "1" / "node-0.log", run_dir / "checkpoints" / "made.txt",
        run_dir / "code" / "train.sh",  # the snapshot, copied by `gpufleet run` (a shell's umask)
    ]  # fmt: skip
    assert {str(p): oct(_mode(p)) for p in files} == {str(p): oct(0o600) for p in files}
    assert _mode(run_dir / "code" / "conf" / "run.sh") == 0o700
    # the supervisor's umask (077) is what the run's commands start with
    assert (run_dir / "umask.txt").read_text().strip() == "0077"
    db = sqlite3.connect(home / "runs.db")  # while a connection is open, the -wal and -shm files exist
    try:
        db.execute("SELECT COUNT(*) FROM runs").fetchone()
        for suffix in ("-wal", "-shm"):
            assert _mode(Path(f"{home / 'runs.db'}{suffix}")) == 0o600
    finally:
        db.close()
    assert wait_no_processes(run_id) == []


def test_an_open_home_of_ours_is_tightened(home: Path, capsys: pytest.CaptureFixture[str], open_umask: None) -> None:
    home.mkdir(mode=0o755)
    RunStore(home)
    os.chmod(home, 0o755)
    os.chmod(home / "runs.db", 0o644)
    rc, out, err = cli(capsys, "list")
    assert rc == 0, err
    assert _mode(home) == 0o700 and _mode(home / "runs.db") == 0o600


def _can_bind_read_only(tmp_path: Path) -> str | None:
    """Why a read-only bind mount cannot be made here (None when it can)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "unshare or mount is missing"
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && ! touch "$0/x" 2>/dev/null', str(probe)],
        capture_output=True, text=True,
    )  # fmt: skip
    return None if done.returncode == 0 else f"no read-only bind mount here: {done.stderr.strip()}"


def _unusable_home(tmp_path: Path, case: str) -> tuple[Path, str, list[str]]:
    """A state folder gpufleet must refuse; returns it, what the error says, and a command prefix."""
    home = tmp_path / "state"
    prefix: list[str] = []
    if case == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        home.mkdir(mode=0o700)
        os.chown(home, OTHER_UID, OTHER_UID)
        return home, f"is owned by uid {OTHER_UID}, not by you", prefix
    if case == "writable by others":
        home.mkdir()
        os.chmod(home, 0o777)
        return home, "may be written by others (mode 0777)", prefix
    if case == "a file":
        home.write_text("not a folder")
        return home, "is not a folder", prefix
    if case == "read-only":
        home.mkdir(mode=0o700)
        if os.geteuid() != 0:
            os.chmod(home, 0o500)
        else:  # root writes through permissions: the folder is mounted read-only for the command
            why = _can_bind_read_only(tmp_path)
            if why:
                pytest.skip(why)
            prefix = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && shift && exec "$@"', str(home), "--"]
        return home, "is read-only for you", prefix
    assert case == "a damaged runs.db"
    home.mkdir(mode=0o700)
    (home / "runs.db").write_bytes(b"this is no SQLite database\n" * 200)
    return home, "is damaged or not a SQLite database (file is not a database)", prefix


@pytest.mark.parametrize("case", ["another user's", "writable by others", "a file", "read-only", "a damaged runs.db"])
def test_an_unusable_home_is_refused_with_one_line(tmp_path: Path, case: str) -> None:
    home, says, prefix = _unusable_home(tmp_path, case)
    before = sorted(p.name for p in home.iterdir()) if home.is_dir() and os.access(home, os.R_OK) else None
    db_bytes = (home / "runs.db").read_bytes() if case == "a damaged runs.db" else None
    wl = write_workload(tmp_path, command="echo must not run > ran.txt")
    for argv in (["list"], ["get", "20260101-000000-x"], ["cancel", "--all"], ["run", "-f", str(wl), "--no-tracking"]):
        done = subprocess.run(
            [*prefix, sys.executable, "-m", "gpufleet.cli", *argv],
            capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, "GPUFLEET_HOME": str(home)},
        )  # fmt: skip
        assert done.returncode == 2, (argv, done.returncode, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == "", (argv, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (argv, lines)
    # nothing was written there
    if case == "a damaged runs.db":
        assert (home / "runs.db").read_bytes() == db_bytes
    if before is not None:
        assert sorted(p.name for p in home.iterdir()) == before
    assert not (tmp_path / "ran.txt").exists()


def test_a_workload_runs_folder_writable_by_others_is_refused(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    (home / "workloads").mkdir()
    os.chmod(home / "workloads", 0o777)
    wl = write_workload(tmp_path)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 2 and out == "", out + err
    assert err.startswith("error: the workload runs folder") and "may be written by others" in err, err
    assert store.list(states=None) == [] and list((home / "workloads").iterdir()) == []


def test_an_environments_folder_writable_by_others_is_refused(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    (home / "envs").mkdir()
    os.chmod(home / "envs", 0o777)
    wl = write_workload(tmp_path, environment={"dependencies": ["gfnever==0.1"]}, command="echo ran")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, out + err
    run = wait_state(store, out.strip())
    assert run.state == "FAILED" and "the environments folder" in run.message, run.message
    assert "may be written by others" in run.message
    assert list((home / "envs").iterdir()) == [] and run.attempts == []
    assert wait_no_processes(run.id) == []
