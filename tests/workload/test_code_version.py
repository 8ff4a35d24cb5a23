"""The code version of a run: git commit, branch and dirty flag, in the run store and as MLflow tags."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gpufleet.codeversion import code_version, describe
from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, cli_json, write_workload


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    code = tmp_path / "repo"
    code.mkdir()
    _git(code, "init", "-q", "-b", "main")
    (code / "train.py").write_text("print('training')\n")
    write_workload(code, code_source={"root_path": "."}, command="python train.py")
    _git(code, "add", "-A")
    _git(code, "commit", "-q", "-m", "first")
    return code


def test_clean_and_dirty_checkouts_are_recorded(
    repo: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    rc, out, err = cli(capsys, "run", "-f", str(repo / "workload.yaml"), "--watch", "--no-tracking")
    assert rc == 0, err
    clean = cli_json(capsys, "get", out.splitlines()[0])
    assert clean["config"]["code_version"] == {"commit": head, "branch": "main", "dirty": False, "path": "."}
    rc, text, _ = cli(capsys, "get", clean["id"])
    assert re.search(rf"code version +{head[:12]} \(main\)\n", text)

    (repo / "train.py").write_text("print('changed')\n")  # an uncommitted change: dirty
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    rc, out, err = cli(capsys, "run", "-f", str(repo / "workload.yaml"), "--watch")
    assert rc == 0, err
    dirty = cli_json(capsys, "get", out.splitlines()[0])
    assert dirty["config"]["code_version"] == {"commit": head, "branch": "main", "dirty": True, "path": "."}
    rc, text, _ = cli(capsys, "get", dirty["id"])
    assert f"{head[:12]} (main, dirty)" in text
    tags = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(dirty["mlflow_run_ids"][0]).data.tags
    assert tags["gpufleet.git.commit"] == head and tags["gpufleet.git.branch"] == "main"
    assert tags["gpufleet.git.dirty"] == "true" and tags["mlflow.source.git.commit"] == head
    # the run's own workload.yaml stays a valid workload
    rc, _, err = cli(capsys, "validate", "-f", str(Path(dirty["run_dir"]) / "workload.yaml"))
    assert rc == 0, err


def test_untracked_files_make_a_checkout_dirty_and_other_folders_have_no_version(repo: Path, tmp_path: Path) -> None:
    assert code_version(repo)["dirty"] is False
    (repo / "new.py").write_text("")
    assert code_version(repo)["dirty"] is True
    (repo / ".gitignore").write_text("*.log\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "more")
    (repo / "run.log").write_text("ignored")  # what the snapshot leaves out does not count
    assert code_version(repo)["dirty"] is False
    _git(repo, "checkout", "-q", "--detach")
    version = code_version(repo)
    assert version["branch"] is None and describe(version).endswith("(detached HEAD)")
    sub = repo / "sub"
    sub.mkdir()
    assert code_version(sub)["path"] == "sub"
    plain = tmp_path / "plain"
    plain.mkdir()
    assert code_version(plain) is None and describe(None) == "-"


def test_a_folder_outside_git_records_no_version(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, code_source={"root_path": "."})
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    run = cli_json(capsys, "get", out.splitlines()[0])
    assert "code_version" not in run["config"]
    rc, text, _ = cli(capsys, "get", run["id"])
    assert re.search(r"code version +-\n", text)
