"""Run store liveness rules, code snapshots without git, and per-run dependency environments."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.runs.liveness import get_run, list_runs
from gpufleet.runs.store import PENDING, RUNNING, RunRecord, RunStore
from gpufleet.workload.snapshot import list_files
from tests.workload.helpers import (
    cli,
    tiny_wheel,
    wait_for_text,
    wait_no_processes,
    wait_state,
    write_workload,
)


def _record(store: RunStore, run_id: str, **fields: object) -> RunRecord:
    rec = RunRecord(
        id=run_id, experiment="x", state=PENDING, created_at=time.time(), config={}, run_dir="/nonexistent",
        num_nodes=1, world_size=1, max_attempts=1,
    )  # fmt: skip
    for k, v in fields.items():
        setattr(rec, k, v)
    return store.create_run(rec)[0]


def test_runs_whose_supervisor_is_gone_are_failed_when_a_command_reads_them(store: RunStore) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    _record(store, "r-dead", state=RUNNING, supervisor_pid=dead.pid, supervisor_started=time.time() - 5,
            heartbeat_at=time.time())  # fmt: skip
    _record(store, "r-never", created_at=time.time() - 3600)
    _record(store, "r-young")  # just submitted: its supervisor may still be starting
    alive = subprocess.Popen(["sleep", "120"])
    try:
        import psutil

        _record(store, "r-stale", state=RUNNING, supervisor_pid=alive.pid,
                supervisor_started=psutil.Process(alive.pid).create_time(), heartbeat_at=time.time() - 3600)  # fmt: skip
        assert store.get("r-dead").state == RUNNING  # the store's own reads never act
        assert get_run(store, "r-dead").state == "FAILED"
        assert "supervisor process" in get_run(store, "r-dead").message
        assert get_run(store, "r-never").message.endswith("never started; nothing of it is left running")
        assert get_run(store, "r-young").state == PENDING
        stale = get_run(store, "r-stale")
        assert stale.state == "FAILED" and "no heartbeat" in stale.message
        assert alive.wait(timeout=60) == -9  # the hung supervisor was killed
        assert [r.id for r in list_runs(store)] == ["r-young"]
    finally:
        alive.kill()
        alive.wait()


def test_pid_reuse_is_not_mistaken_for_a_live_supervisor(store: RunStore) -> None:
    import os

    # our own pid, but "started" at another time: another process that reused the pid
    _record(store, "r-reused", state=RUNNING, supervisor_pid=os.getpid(), supervisor_started=1.0,
            heartbeat_at=time.time())  # fmt: skip
    assert get_run(store, "r-reused").state == "FAILED"


def test_get_accepts_a_unique_prefix_and_names_missing_runs(store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    _record(store, "abcdef-1", state="SUCCESS")
    _record(store, "abcdef-2", state="SUCCESS")
    _record(store, "abcxyz-3", state="SUCCESS")
    assert store.get("abcxyz").id == "abcxyz-3"
    rc, out, err = cli(capsys, "get", "abcdef")
    assert rc == 2 and "is ambiguous" in err  # test_run_ids.py has the other rules
    rc, out, err = cli(capsys, "get", "zzzzzz")
    assert rc == 1 and "'zzzzzz' does not exist" in err and "gpufleet list --all-status" in err
    rc, out, err = cli(capsys, "list", "--filter", "colour=red")
    assert rc == 2 and "cannot filter on 'colour'" in err
    rc, out, err = cli(capsys, "list", "--filter", "state=DONE")
    assert rc == 2 and "unknown state(s) DONE" in err


def test_snapshot_without_git_respects_gitignore(tmp_path: Path) -> None:
    root = tmp_path / "code"
    (root / "pkg" / "data").mkdir(parents=True)
    (root / ".gitignore").write_text("*.log\n/data-root/\n")
    (root / "pkg" / ".gitignore").write_text("data/\n!keep.log\n")
    for rel in ["train.py", "run.log", "pkg/mod.py", "pkg/data/x.bin", "pkg/keep.log"]:
        (root / rel).write_text(rel)
    assert list_files(root) == [".gitignore", "pkg/.gitignore", "pkg/keep.log", "pkg/mod.py", "train.py"]
    assert list_files(root, ["pkg"]) == ["pkg/.gitignore", "pkg/keep.log", "pkg/mod.py"]


def test_dependencies_install_into_a_cached_layered_environment(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tiny_wheel(tmp_path, "gftiny", "from the run environment")
    wl = write_workload(
        tmp_path,
        environment={"dependencies": [f"gftiny @ {wheel.as_uri()}"]},
        # the new package and the packages of the current environment are both importable
        command="python -c 'import gftiny, yaml, psutil; print(gftiny.VALUE)'",
    )
    ids = []
    for _ in range(2):
        rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
        assert rc == 0, err + out
        assert "[node 0] from the run environment" in out
        ids.append(out.splitlines()[0])
    setup = [(Path(store.get(i).run_dir) / "environment.log").read_text() for i in ids]
    assert "building environment" in setup[0] and "reusing environment" in setup[1]
    assert len(list((home / "envs").glob("*/.gpufleet-ready"))) == 1
    # without the dependency, the current environment does not have the package
    plain = write_workload(tmp_path, name="plain.yaml", command="python -c 'import gftiny'")
    rc, out, err = cli(capsys, "run", "-f", str(plain), "--watch", "--no-tracking")
    assert rc == 1 and "ModuleNotFoundError" in out
    wait_state(store, out.splitlines()[0])


def test_list_limits_newest_first_and_filters(store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    now = time.time()
    for i, (state, experiment) in enumerate([("SUCCESS", "a"), ("FAILED", "a"), ("SUCCESS", "b"), ("TIMEDOUT", "b")]):
        _record(store, f"run-{i}", state=state, experiment=experiment, created_at=now + i)

    def listed(*argv: str) -> list[str]:
        rc, out, err = cli(capsys, "list", "--all-status", *argv, "-o", "json")
        assert rc == 0, err
        return [r["id"] for r in json.loads(out)]

    assert listed() == ["run-3", "run-2", "run-1", "run-0"]
    assert listed("--limit", "2") == ["run-3", "run-2"]
    assert listed("--filter", "state=FAILED,TIMEDOUT") == ["run-3", "run-1"]
    assert listed("--filter", "experiment=a", "--filter", "state=SUCCESS") == ["run-0"]
    assert listed("--filter", "id=run-2") == ["run-2"]


def test_cancel_while_dependencies_install_stops_pip_and_cancels(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cancel during a long ``pip install`` stops pip at once (it failed the run after pip's retries before)."""
    import socket

    server = socket.socket()  # accepts connections and never answers: pip waits on it
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    url = f"http://127.0.0.1:{server.getsockname()[1]}/gfslow-0.1-py3-none-any.whl"
    try:
        wl = write_workload(tmp_path, environment={"dependencies": [f"gfslow @ {url}"]}, command="true")
        rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
        assert rc == 0, out + err
        run_id = out.splitlines()[0]
        log = Path(store.get(run_id).run_dir) / "environment.log"
        wait_for_text(log, " -m pip ")  # pip's command line: pip is starting (before it, venv's)
        t0 = time.monotonic()
        rc, out, err = cli(capsys, "cancel", run_id)
        assert rc == 0, out + err
        run = wait_state(store, run_id, timeout=60)
        assert run.state == "CANCELED", (run.state, run.message, log.read_text()[-2000:])
        assert time.monotonic() - t0 < 90  # pip would have waited for the silent server 180 s
        assert "while its environment was being built" in (run.message or "")
        assert "stopped pip" in log.read_text()
        assert wait_no_processes(run_id) == []
    finally:
        server.close()
