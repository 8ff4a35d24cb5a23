"""`gpufleet get/list/logs | head -1`: output into a closed pipe ends quietly, exit code 141 as git's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import REPO, cli, wait_state, write_workload


def _into_closed_pipe(argv: list[str], read_lines: int) -> tuple[int, list[str], str]:
    """Run ``gpufleet ARGV`` with stdout a pipe that is closed after ``read_lines`` lines (0: a pipe
    whose reader is gone before the process starts, so that its first write fails whatever its speed)."""
    if read_lines == 0:
        reader, writer = os.pipe()
        os.close(reader)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "gpufleet.cli", *argv], stdout=writer,
                                    stderr=subprocess.PIPE, cwd=REPO, env=dict(os.environ))  # fmt: skip
        finally:
            os.close(writer)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
        return proc.wait(timeout=60), [], err
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline().decode() for _ in range(read_lines)]
    proc.stdout.close()  # the reader goes away, as `head -1` does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return proc.wait(timeout=60), lines, err


@pytest.fixture
def finished_run(tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> str:
    """A finished run whose log (about 2 MB) cannot fit in a pipe's buffer."""
    command = f"{sys.executable} -c \"import sys; sys.stdout.write(''.join(f'line {{i}}' + chr(10) for i in range(200000)))\""
    rc, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, command=command)), "--no-tracking")
    assert rc == 0, err
    run = wait_state(store, out.strip())
    assert run.state == "SUCCESS", run.message
    return run.id


def test_get_list_and_logs_into_a_closed_pipe_end_quietly(finished_run: str) -> None:
    # the log is larger than a pipe holds: `logs` is still writing when its reader goes
    for argv in (["logs", finished_run], ["logs", finished_run, "--follow"]):
        code, lines, err = _into_closed_pipe(argv, read_lines=1)
        assert lines[0].endswith("line 0\n"), (argv, lines)
        assert (code, err) == (141, ""), (argv, code, err)
    # `get` and `list` print a few lines: a pipe closed before they write is the same case
    for argv in (["get", finished_run], ["list", "--all-status"], ["get", finished_run, "-o", "json"]):
        code, _, err = _into_closed_pipe(argv, read_lines=0)
        assert (code, err) == (141, ""), (argv, code, err)
        assert "Traceback" not in err


def test_output_into_an_open_pipe_or_a_file_is_unchanged(finished_run: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "get", finished_run], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0 and finished_run in done.stdout, done
    out = tmp_path / "logs.txt"
    with open(out, "w") as f:
        code = subprocess.run([sys.executable, "-m", "gpufleet.cli", "logs", finished_run], stdout=f, cwd=REPO,
                              timeout=60).returncode  # fmt: skip
    assert code == 0
    assert out.read_text().splitlines()[-1] == "[node 0] line 199999"


def test_advise_into_a_closed_pipe_ends_quietly() -> None:
    # `gpufleet advise ... | head -1`: its table is written by rich, which ends with exit 1 on its own
    argv = ["advise", "--model-params", "8B", "--gpus", "8", "--gpu-memory", "80GB"]
    code, lines, err = _into_closed_pipe(argv, read_lines=1)
    assert "8.00B parameters" in lines[0]
    # the table is smaller than a pipe holds: whether it was all written before the reader went
    # depends on the machine's speed; written, it exits 0, else 141, and quietly either way
    assert code in (0, 141) and err == "", (code, err)
    code, _, err = _into_closed_pipe(argv, read_lines=0)  # the reader gone before the first write
    assert (code, err) == (141, ""), (code, err)
