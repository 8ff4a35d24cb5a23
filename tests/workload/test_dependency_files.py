"""``environment.dependencies`` with requirement files, index options and ``--no-build-isolation``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.launch.node.envs import env_hash, pip_arguments
from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, cli_json, tiny_wheel, write_workload


def _simple_index(folder: Path, name: str, value: str) -> str:
    """A PEP 503 index in ``folder`` holding one wheel of ``name``; returns its file:// URL."""
    project = folder / "simple" / name
    project.mkdir(parents=True)
    wheel = tiny_wheel(project, name, value)
    (project / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    (folder / "simple" / "index.html").write_text(f'<html><body><a href="{name}/">{name}</a></body></html>\n')
    return (folder / "simple").as_uri()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    code = tmp_path / "project"
    (code / "wheels").mkdir(parents=True)
    tiny_wheel(code / "wheels", "gfreqdemo", "from the requirements file")
    (code / "requirements.txt").write_text("gfreqdemo==0.1\n-r more.txt\n")
    (code / "more.txt").write_text("# nothing more yet\n")
    return code


def test_a_requirement_file_and_an_index_are_installed_into_a_cached_environment(
    project: Path, tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    index = _simple_index(tmp_path / "index", "gfindexdemo", "from the index")
    wl = write_workload(
        project,
        code_source={"root_path": "."},
        environment={"dependencies": [
            "-r requirements.txt",  # relative to the code folder
            "--find-links wheels",  # a folder of the code folder
            f"--index-url={index}",  # the only index: nothing is asked of PyPI
            "--no-build-isolation",
            "gfindexdemo==0.1",
        ]},  # fmt: skip
        command="python -c 'import gfreqdemo, gfindexdemo; print(gfreqdemo.VALUE, \"/\", gfindexdemo.VALUE)'",
    )
    plan = cli_json(capsys, "run", "--dry-run", "-f", str(wl))
    ids = []
    for _ in range(2):
        rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
        assert rc == 0, err + out
        assert "[node 0] from the requirements file / from the index" in out
        ids.append(out.splitlines()[0])
    setup = [(Path(store.get(i).run_dir) / "environment.log").read_text() for i in ids]
    assert "building environment" in setup[0] and "reusing environment" in setup[1]
    assert f"envs/{plan['environment_hash']}" in setup[0]  # the dry run's key is the run's
    assert "--no-build-isolation" in setup[0] and str(Path(store.get(ids[0]).run_dir) / "code" / "requirements.txt") in setup[0]

    # a requirement file named by the list's file changes: a new environment
    (project / "more.txt").write_text("# now with a comment\n")
    assert cli_json(capsys, "run", "--dry-run", "-f", str(wl))["environment_hash"] != plan["environment_hash"]
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err + out
    assert "building environment" in (Path(store.get(out.splitlines()[0]).run_dir) / "environment.log").read_text()
    assert len(list((home / "envs").glob("*/.gpufleet-ready"))) == 2


def test_the_key_covers_file_contents_not_the_folder_they_are_read_from(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "req.txt").write_text("numpy\n")
    deps = ["-r req.txt"]
    assert env_hash(deps, a) == env_hash(deps, b)
    (b / "req.txt").write_text("numpy<2\n")
    assert env_hash(deps, a) != env_hash(deps, b)
    assert env_hash(["numpy"]) == env_hash(["numpy"], a)  # lists without files keep their keys
    assert pip_arguments(["-r req.txt", "--index-url=https://x/simple", "--find-links ./w", "-f https://w"], a) == [
        "-r", str(a / "req.txt"), "--index-url", "https://x/simple", "--find-links", str(a / "w"), "-f", "https://w",
    ]  # fmt: skip


def test_requirement_files_must_be_in_the_code_snapshot(
    project: Path, tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    deps = {"dependencies": ["-r requirements.txt"]}
    no_code = write_workload(tmp_path, name="no-code.yaml", environment=deps)
    rc, out, err = cli(capsys, "validate", "-f", str(no_code))
    assert rc == 2 and "environment.dependencies[0]: 'requirements.txt' is read from the code folder" in err
    missing = write_workload(project, name="missing.yaml", code_source={"root_path": "."},
                             environment={"dependencies": ["-r nope.txt"]})  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(missing))
    assert rc == 2 and "requirement file 'nope.txt' does not exist" in err
    left_out = write_workload(project, name="left-out.yaml", environment=deps,
                              code_source={"root_path": ".", "include_paths": ["wheels"]})  # fmt: skip
    for argv in (["validate", "-f", str(left_out)], ["run", "-f", str(left_out)]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2 and "requirement file 'requirements.txt' is not part of the code snapshot" in err, err
    assert store.list(states=None) == []  # refused before a run was stored
    bad = write_workload(project, name="bad.yaml", environment={"dependencies": ["--user", "-r /etc/req.txt"]})
    rc, out, err = cli(capsys, "validate", "-f", str(bad))
    assert rc == 2 and "'--user' is not an allowed pip option" in err and "must be a path relative" in err
