"""Code snapshot guards: refused roots, state folders left out, symbolic links, size limits."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from gpufleet.workload import snapshot as snap
from gpufleet.workload.snapshot import Limits, SnapshotError, list_files, scan
from tests.workload.helpers import cli, wait_state, write_workload


def _project(folder: Path, files: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {"train.py": "print('hi')\n", "pkg/mod.py": "X = 1\n"}).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


def _git_init(folder: Path) -> None:
    subprocess.run(["git", "init", "-q", str(folder)], check=True)


@pytest.fixture(params=["git", "no-git"])
def mode(request: pytest.FixtureRequest) -> str:
    """Both ways of listing a code folder: ``git ls-files`` and the .gitignore walk."""
    return request.param


def _make(tmp_path: Path, mode: str, files: dict[str, str] | None = None) -> Path:
    root = _project(tmp_path / "proj", files)
    if mode == "git":
        _git_init(root)
    return root


def _all_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())


# ------------------------------------------------------------------ refused roots


@pytest.mark.parametrize("which", ["/", "home"])
def test_the_file_system_root_and_the_home_folder_are_refused_by_every_command(
    which: str, tmp_path: Path, home: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    if which == "home":
        fake_home = _project(tmp_path / "me")
        monkeypatch.setenv("HOME", str(fake_home))
        root, said = str(fake_home), "is your home folder"
    else:
        root, said = "/", "is the root of the file system"
    wl = write_workload(tmp_path, code_source={"root_path": root})
    for argv in (["validate", "-f", str(wl)], ["run", "--dry-run", "-f", str(wl)], ["run", "-f", str(wl)]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2, (argv, out, err)
        assert f"code_source.root_path: {root!r} {said}, not a code folder" in err
        assert "point root_path at it" in err and "Traceback" not in err
    rc, out, err = cli(capsys, "run", "--dry-run", "-f", str(wl), "-o", "json")
    doc = json.loads(out)
    assert doc["valid"] is False and doc["problems"][0]["path"] == "code_source.root_path"
    assert store.list(states=None, limit=None) == []  # refused before a run was recorded


def test_a_state_folder_is_refused_as_a_root(tmp_path: Path) -> None:
    state = tmp_path / "state"
    RunStore(state)
    with pytest.raises(SnapshotError, match=r"is a gpufleet state folder \(it holds runs.db\)"):
        scan(state)


# ------------------------------------------------------------------ state folders


def test_a_state_folder_inside_the_code_folder_is_never_copied(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _make(tmp_path, mode)
    state = root / ".gpufleet-state"  # GPUFLEET_HOME inside the code folder, not ignored
    monkeypatch.setenv("GPUFLEET_HOME", str(state))
    RunStore(root / "old-home")  # another state folder, e.g. an earlier GPUFLEET_HOME
    (root / "old-home" / "workloads" / "r1" / "code").mkdir(parents=True)
    (root / "old-home" / "workloads" / "r1" / "code" / "train.py").write_text("old")
    wl = write_workload(root, code_source={"root_path": "."}, command="ls -R . > /dev/null")
    store = RunStore(state)
    sizes = []
    for _ in range(2):
        rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
        assert rc == 0, err
        run = wait_state(store, out.strip())
        assert run.state == "SUCCESS", run.message
        code = Path(run.run_dir) / "code"
        assert _all_files(code) == ["pkg/mod.py", "train.py", "workload.yaml"]
        sizes.append(sum(p.stat().st_size for p in code.rglob("*") if p.is_file()))
    assert len(set(sizes)) == 1  # no snapshot holds the earlier ones
    assert list_files(root) == ["pkg/mod.py", "train.py", "workload.yaml"]


def test_the_state_folder_given_by_home_is_left_out_too(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    (root / "state" / "envs").mkdir(parents=True)  # no runs.db yet: known only as the store's home
    (root / "state" / "envs" / "lib.py").write_text("")
    assert list_files(root) == ["pkg/mod.py", "state/envs/lib.py", "train.py"]
    assert list_files(root, exclude=[root / "state"]) == ["pkg/mod.py", "train.py"]


def test_a_code_folder_inside_the_state_folder_is_still_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("GPUFLEET_HOME", str(state))
    RunStore(state)
    code = _project(state / "workloads" / "r1" / "code")  # re-running from an earlier snapshot
    assert list_files(code) == ["pkg/mod.py", "train.py"]


# ------------------------------------------------------------------ symbolic links


def test_links_inside_the_root_stay_links(tmp_path: Path, mode: str) -> None:
    root = _make(tmp_path, mode, {"train.py": "x", "configs/base.yaml": "a: 1\n", "data/keep.txt": "k"})
    os.symlink("train.py", root / "main.py")
    os.symlink(root / "configs", root / "pkg")  # an absolute link to a folder inside the root
    os.symlink("../configs/base.yaml", root / "data" / "base.yaml")
    entries = {e.rel: e for e in scan(root)}
    assert sorted(entries) == ["configs/base.yaml", "data/base.yaml", "data/keep.txt", "main.py", "pkg", "train.py"]
    dest = tmp_path / "snap"
    assert snap.snapshot(root, dest) == 6
    assert os.readlink(dest / "main.py") == "train.py"
    assert os.readlink(dest / "pkg") == "configs"  # made relative: it works in the snapshot
    assert os.readlink(dest / "data" / "base.yaml") == "../configs/base.yaml"
    assert (dest / "pkg" / "base.yaml").read_text() == "a: 1\n"
    assert not (dest / "pkg").resolve().is_relative_to(root)


def test_links_leaving_the_root_are_refused_and_named(
    tmp_path: Path, mode: str, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = _project(tmp_path / "shared", {"secret.txt": "s", "lib/util.py": "u"})
    root = _make(tmp_path, mode)
    os.symlink(outside / "secret.txt", root / "secret.txt")
    os.symlink("../shared/lib", root / "lib")  # a folder: used to give 0 files silently
    with pytest.raises(SnapshotError) as e:
        scan(root)
    text = str(e.value)
    assert "lib is a symbolic link to '../shared/lib', outside root_path" in text
    assert f"secret.txt is a symbolic link to '{outside / 'secret.txt'}', outside root_path" in text
    wl = write_workload(tmp_path, code_source={"root_path": "proj"})
    for argv in (["run", "--dry-run", "-f", str(wl)], ["validate", "-f", str(wl)], ["run", "-f", str(wl)]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2 and "secret.txt is a symbolic link" in err and "Traceback" not in err, (argv, err)
    (root / ".gitignore").write_text("secret.txt\nlib\n")  # left out: fine
    assert list_files(root) == [".gitignore", "pkg/mod.py", "train.py"]


def test_a_link_to_a_folder_holding_it_is_a_loop_and_refused(tmp_path: Path, mode: str) -> None:
    root = _make(tmp_path, mode)
    os.symlink("..", root / "pkg" / "up")
    with pytest.raises(SnapshotError, match="pkg/up is a symbolic link to '..', a folder that holds the link itself"):
        scan(root)


# ------------------------------------------------------------------ limits


def test_the_file_limit_names_the_count_and_the_override(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _make(tmp_path, mode, {f"f{i:02d}.py": "" for i in range(12)})
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_FILES", "10")
    with pytest.raises(SnapshotError) as e:
        scan(root)
    assert "more than 10 files to copy under" in str(e.value) and "stopped counting at 11" in str(e.value)
    assert "set GPUFLEET_SNAPSHOT_MAX_FILES=<count> (0: no limit)" in str(e.value)
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_FILES", "12")
    assert len(scan(root)) == 12
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_FILES", "0")
    assert len(scan(root)) == 12


def test_the_size_limit_names_the_size_the_largest_file_and_the_override(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _make(tmp_path, mode, {"train.py": "x", "model.bin": "w" * 5000})
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_BYTES", "4KiB")
    with pytest.raises(SnapshotError) as e:
        scan(root)
    assert "more than 4.0 KiB to copy under" in str(e.value) and "the largest: model.bin, 4.9 KiB" in str(e.value)
    assert "set GPUFLEET_SNAPSHOT_MAX_BYTES=<size, e.g. 4GiB>" in str(e.value)
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_BYTES", "1M")
    assert [x.rel for x in scan(root)] == ["model.bin", "train.py"]


def test_listing_stops_as_soon_as_a_limit_is_passed(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _make(tmp_path, mode, {f"d{d}/f{i}.txt": "" for d in range(20) for i in range(100)})
    added = []
    real_add = snap._Scan.add
    monkeypatch.setattr(snap._Scan, "add", lambda self, rel: (added.append(rel), real_add(self, rel))[1])
    with pytest.raises(SnapshotError, match="more than 50 files"):
        scan(root, limits=Limits(max_files=50))
    assert len(added) == 51  # of 2,000


def test_limits_of_a_real_submission_are_clean_cli_errors(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _project(tmp_path / "proj", {f"f{i}.py": "" for i in range(5)})
    wl = write_workload(tmp_path, code_source={"root_path": "proj"})
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_FILES", "3")
    for argv in (["run", "--dry-run", "-f", str(wl)], ["run", "-f", str(wl)], ["validate", "-f", str(wl)]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert "cannot snapshot the code: code_source: more than 3 files" in err and "Traceback" not in err
    assert RunStore(home).list(states=None, limit=None) == []  # refused before a run was recorded
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_MAX_FILES", "lots")
    rc, out, err = cli(capsys, "run", "--dry-run", "-f", str(wl))
    assert rc == 2 and "GPUFLEET_SNAPSHOT_MAX_FILES='lots' is not a limit" in err
    monkeypatch.delenv("GPUFLEET_SNAPSHOT_MAX_FILES")
    rc, out, err = cli(capsys, "run", "--dry-run", "-f", str(wl), "-o", "json")
    assert rc == 0 and json.loads(out)["code_files"] == 5
