"""A workload node's log: every line of a rank whole and prefixed with its rank, no torchrun banner."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpufleet.launch.node.ranklines import RankLines
from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, wait_state, write_workload

TRAIN = """
import os, sys
rank = int(os.environ["RANK"])
print(f"rank {rank} logdir {os.environ['PET_LOG_DIR']}")
for i in range(1000):
    # print() writes the text and the newline apart: unbuffered, another rank's line could land between
    print(f"rank {rank} line {i:04d} " + "x" * (i % 50))
    if i % 100 == 0:
        print(f"rank {rank} warning {i}", file=sys.stderr)
sys.stdout.write(f"rank {rank} last words")  # no newline at the end
"""


def test_two_ranks_printing_1000_lines_each_never_share_a_line(
    tmp_path: Path, home: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = tmp_path / "tmp"  # the node guard's temporary folders go here
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    command = "torchrun --nproc-per-node=$LOCAL_WORLD_SIZE --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT train.py"
    wl = write_workload(code, compute={"accelerator_type": "CPU_2", "num_accelerators": 2}, command=command,
                        code_source={"root_path": "."})  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, err
    run = wait_state(store, out.strip(), timeout=120)
    assert run.state == "SUCCESS", run.message
    log = Path(run.attempts[-1].log_paths()[0]).read_text()
    pattern = re.compile(r"\[rank (\d)\] rank (\d) (line (\d{4}) (x*)|warning \d+|last words|logdir (\S+))")
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in log.splitlines():
        m = pattern.fullmatch(line)
        assert m, f"a line that is not one rank's whole line: {line!r}"
        assert m.group(1) == m.group(2), line  # the prefix names the rank that wrote it
        if m.group(6):
            assert Path(m.group(6)).parent == tmp, line  # torchrun's folder was the guard's own
        if m.group(4):
            seen[int(m.group(1))].append(int(m.group(4)))
            assert len(m.group(5)) == int(m.group(4)) % 50, line
    assert seen == {0: list(range(1000)), 1: list(range(1000))}  # every line, in each rank's order
    assert log.count("last words") == 2
    assert "OMP_NUM_THREADS" not in log  # torchrun's banner stays away (the node sets it)
    assert not list(tmp.glob("gpufleet-ranks-*"))  # the guard removed torchrun's folder


def test_a_secret_printed_by_a_torchrun_rank_is_masked_in_its_lines(
    tmp_path: Path, home: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    value = "gf-rank-secret-" + os.urandom(6).hex()
    monkeypatch.setenv("GF_TEST_RANK_SECRET", value)
    code = tmp_path / "code"
    code.mkdir()
    (code / "show.py").write_text('import os; print("token:", os.environ["API_TOKEN"], "rank", os.environ["RANK"])\n')
    command = "torchrun --nproc-per-node=$LOCAL_WORLD_SIZE --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT show.py"
    wl = write_workload(code, compute={"accelerator_type": "CPU_2", "num_accelerators": 2}, command=command,
                        code_source={"root_path": "."}, secrets={"API_TOKEN": {"env": "GF_TEST_RANK_SECRET"}})  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, err
    run = wait_state(store, out.strip(), timeout=120)
    assert run.state == "SUCCESS", run.message
    log = Path(run.attempts[-1].log_paths()[0]).read_text()
    assert "[rank 0] token: *** rank 0" in log and "[rank 1] token: *** rank 1" in log, log
    assert value not in log


def _rank_file(folder: str, local_rank: int, stream: str = "stdout.log") -> Path:
    path = Path(folder) / "run_abc" / "attempt_0" / str(local_rank) / stream
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def test_partial_lines_are_held_until_whole_and_written_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "node-1.log"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        lines = RankLines(fd, first_rank=4, mask=lambda b: b.replace(b"hunter2", b"***"))
        r0, r1 = _rank_file(lines.folder, 0), _rank_file(lines.folder, 1, "stderr.log")
        with open(r0, "ab") as a, open(r1, "ab") as b:
            a.write(b"hello ")
            a.flush()
            lines._copy(final=False)
            assert out.read_bytes() == b""  # half a line is held back
            a.write(b"world\nprogress 10%\rprogress 20%\r")
            b.write(b"password hunter2\r")
            a.flush()
            b.flush()
            lines._copy(final=False)
            # a "\r" at the end may be the first half of "\r\n": that line waits for the next byte
            assert out.read_bytes() == b"[rank 4] hello world\n[rank 4] progress 10%\r"
            b.write(b"\nno newline")
            b.flush()
        lines.stop()
        assert out.read_bytes() == (b"[rank 4] hello world\n[rank 4] progress 10%\r[rank 4] progress 20%\r"
                                    b"[rank 5] password ***\r\n[rank 5] no newline\n")  # fmt: skip
        assert not os.path.exists(lines.folder)
    finally:
        os.close(fd)


def test_turned_off_by_the_environment() -> None:
    assert RankLines.for_node({"GPUFLEET_RANK_PREFIX": "0"}, 1) is None
    assert RankLines.for_node({"PET_TEE": "3"}, 1) is None  # the user asked torchrun for its own
    lines = RankLines.for_node({"NODE_RANK": "2", "LOCAL_WORLD_SIZE": "8"}, 1)
    assert lines is not None and lines.first_rank == 16
    assert lines.child_env() == {"PET_REDIRECTS": "3", "PET_LOG_DIR": lines.folder}
    lines.stop()


def test_a_sigkilled_guards_folder_goes_when_the_next_guard_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # seen: every guard killed with SIGKILL left an empty /tmp/gpufleet-ranks-* folder for good
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import psutil

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    guard = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.launch.node.guard", "--", "bash", "-c", "sleep 60"],
        env={**os.environ, "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"gpufleet-ranks-{guard.pid}-*")):
            assert guard.poll() is None and time.monotonic() < deadline, "the guard made no folder"
            time.sleep(0.05)
    finally:
        command = psutil.Process(guard.pid).children(recursive=True)
        guard.send_signal(signal.SIGKILL)
        guard.wait()
        for p in command:  # the guard's command, orphaned by the kill
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert list(tmp_path.glob(f"gpufleet-ranks-{guard.pid}-*"))  # a killed guard cannot remove it
    live = tmp_path / f"gpufleet-ranks-{os.getpid()}-live"  # a live guard's folder (this process)
    live.mkdir()
    other = tmp_path / "gpufleet-ranks-notapid"
    other.mkdir()
    lines = RankLines(1)
    try:
        assert not list(tmp_path.glob(f"gpufleet-ranks-{guard.pid}-*"))
        assert live.is_dir() and other.is_dir() and Path(lines.folder).is_dir()
    finally:
        lines.stop(drain=False)
    assert not Path(lines.folder).exists()
