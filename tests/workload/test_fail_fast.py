"""A workload's command runs with ``set -eo pipefail``: its first failing line ends the node and names itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from gpufleet.workload.nodes import failed_line, node_script
from tests.workload.helpers import cli, write_workload


def _run(command: str, tmp: Path) -> tuple[int, str, Path]:
    log = tmp / "node.log"
    with open(log, "wb") as f:
        proc = subprocess.run(
            ["bash", "-c", node_script(command)], stdout=f, stderr=subprocess.STDOUT, timeout=30
        )
    return proc.returncode, log.read_text(), log


@pytest.mark.parametrize(
    ("command", "code", "line"),
    [
        ("false\necho after", 1, (1, "false")),
        (
            "echo a\nls /no/such/folder | cat\necho after",
            2,
            (2, "ls /no/such/folder | cat"),
        ),  # pipefail
        (
            "f() {\n  exit_with() { return $1; }\n  exit_with 4\n}\nf\necho after",
            4,
            (3, "exit_with 4"),
        ),
        ("(\n  echo in\n  false\n)\necho after", 1, (3, "false")),  # the subshell's own line
    ],
)
def test_first_failing_line_ends_the_script_and_is_named(
    command: str, code: int, line: tuple[int, str], tmp_path: Path
) -> None:
    rc, text, log = _run(command, tmp_path)
    assert rc == code
    assert "after" not in text
    assert failed_line(log, command) == line


@pytest.mark.parametrize(
    "command",
    [
        "set +e\nfalse\necho after",  # the documented opt-out
        "if false; then :; fi\nfalse || true\nx=$(false; echo sub)\necho after",  # tested commands do not end it
    ],
)
def test_opted_out_or_tested_failures_go_on(command: str, tmp_path: Path) -> None:
    rc, text, log = _run(command, tmp_path)
    assert rc == 0 and "after" in text
    assert failed_line(log, command) is None


def test_an_explicit_exit_names_no_line(tmp_path: Path) -> None:
    rc, _, log = _run("echo hi\nexit 3", tmp_path)
    assert rc == 3 and failed_line(log, "echo hi\nexit 3") is None


def test_failed_first_line_fails_the_run_and_names_the_line(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path, command="echo preparing\nfalse\necho training on stale data")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 1, err
    run = store.get(out.splitlines()[0])
    assert run.state == "FAILED" and run.exit_code == 1
    assert "node 0 exited with code 1 at line 2 of the command: `false`" in (run.message or "")
    assert "at line 2 of the command: `false`" in (run.attempts[0].message or "")
    assert "training on stale data" not in out
    assert "[node 0] gpufleet: the command failed at line 2 (exit code 1): false" in out
    rc, text, _ = cli(capsys, "get", run.id)
    assert "at line 2 of the command: `false`" in text


def test_set_plus_e_opts_out(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path, command="set +e\nfalse\necho went on")
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    assert "[node 0] went on" in out
    assert store.get(out.splitlines()[0]).state == "SUCCESS"
