"""Every folder of a tracked call's state is 0700 and every file 0600, whatever the caller's umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet import distributed, runtime
from gpufleet.private import private_dir
from gpufleet.tracking.runs import default_artifact_root, default_tracking_uri
from gpufleet.tracking.store import ensure_default_store

pytest.importorskip("mlflow")


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask of a shell (022): what is private is so because gpufleet made it so."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _fails_on_rank_one_after_logging_an_artifact() -> None:
    import time

    import mlflow

    runtime.setup()
    runtime.report_step()
    time.sleep(1.5)  # the progress files are written meanwhile
    if runtime.get_global_rank() == 1:
        mlflow.log_text("written by a rank", "notes/rank-1.txt")  # with the rank's umask
        raise ValueError("rank 1 gives up")


def test_a_failed_tracked_calls_files_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_umask: None) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # gpufleet's default store, in the home
    # The store is built first, by the code a call's tracking runs: its schema takes 1.5-3 s on a quiet
    # machine and more than the tracking wait (30 s) on a loaded one, when the call goes on untracked
    # and has no artifacts to check. The bound has tests of its own (tests/security/test_tracking_server_down.py).
    private_dir(home)
    ensure_default_store(Path(default_tracking_uri().removeprefix("sqlite:///")), default_artifact_root())
    f = distributed(_fails_on_rank_one_after_logging_an_artifact, gpus=2, gpu_type="cpu", hang_timeout=30,
                    stream_logs=False)  # fmt: skip
    handle = f.submit()
    with pytest.raises(ValueError):
        handle.result(timeout=120)
    run_dir = Path(handle.run_dir)
    assert sorted(p.name for p in run_dir.glob("progress-*.json")) == ["progress-0.json", "progress-1.json"]
    artifacts = list((home / "mlartifacts").rglob("*"))
    assert any(p.name == "error.txt" for p in artifacts) and any(p.name == "rank-1.txt" for p in artifacts)
    modes = {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in [home, *home.rglob("*")]}
    wrong = {p: m for p, m in modes.items() if m != (oct(0o700) if Path(p).is_dir() else oct(0o600))}
    assert wrong == {}
