"""`gpufleet logs --lines N` reads the end of a log, not the whole file."""

from __future__ import annotations

import random
import sys
import tracemalloc
from pathlib import Path

import pytest

from gpufleet.runs import view
from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, cli_json, wait_state, write_workload

FILLER_MB = 50


def _big_log(path: Path, tail: list[str], megabytes: int = FILLER_MB) -> Path:
    block = "".join(f"filler line {i:06d} " + "x" * 80 + "\n" for i in range(10_000)).encode()  # 1 MB: 10,000 lines of 100 bytes
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(block)
        f.write("".join(line + "\n" for line in tail).encode())
    return path


class _CountingFile:
    """A binary file that adds up the bytes read through it."""

    total = 0

    def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
        self._f = f

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        _CountingFile.total += len(data)
        return data

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._f, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def test_the_last_lines_of_a_large_log_come_from_a_few_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tail = [f"last line {i} é" for i in range(7)]
    log = _big_log(tmp_path / "node-0.log", tail)
    assert log.stat().st_size > FILLER_MB * 10**6
    _CountingFile.total = 0
    monkeypatch.setattr(view, "open", lambda p, mode="r": _CountingFile(open(p, mode)), raising=False)
    tracemalloc.start()
    try:
        lines = view.tail_lines(log, 5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines == tail[-5:]
    assert _CountingFile.total <= 2 * view.LOG_BLOCK  # the file is 50 MB: read from its end only
    assert peak < 4 * view.LOG_BLOCK + 256 * 1024, f"peak {peak} bytes"


def test_more_lines_than_the_file_holds_and_edge_cases(tmp_path: Path) -> None:
    p = tmp_path / "log"
    assert view.tail_lines(p, 5) == [] and list(view.iter_lines(p)) == []  # missing file
    p.write_bytes(b"")
    assert view.tail_lines(p, 5) == [] and view.tail_lines(p, None) == []
    p.write_bytes(b"a\nb\nc")
    assert view.tail_lines(p, 10) == ["a", "b", "c"] and view.tail_lines(p, 0) == []
    assert view.tail_lines(p, 2, block_size=1) == ["b", "c"]
    p.write_bytes(b"one\r\ntwo\rthree\n\n")  # progress bars end lines with a lone \r
    assert view.tail_lines(p, None) == ["one", "two", "three", ""]
    assert view.tail_lines(p, 3, block_size=2) == ["two", "three", ""]


@pytest.mark.parametrize("seed", range(40))
def test_any_block_size_gives_what_reading_the_whole_file_gives(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = [b"a", b"b", b"\n", b"\r", b"\r\n", "é".encode(), b"\xff"]
    data = b"".join(rnd.choice(alphabet) for _ in range(rnd.randrange(0, 80)))
    p = tmp_path / "log"
    p.write_bytes(data)
    whole = [line.decode("utf-8", "replace") for line in data.splitlines()]
    for block_size in (1, 2, 3, 5, 8, 64):
        assert list(view.iter_lines(p, block_size)) == whole, (data, block_size)
        for n in (1, 2, 3, 7, 100):
            assert view.tail_lines(p, n, block_size) == whole[-n:], (data, block_size, n)


def test_logs_lines_of_a_run_with_a_large_log(tmp_path: Path, home: Path, store: RunStore,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    command = (f"{sys.executable} -c \"import sys; sys.stdout.write(('y' * 99 + chr(10)) * 200000); "
               "print(chr(10).join(f'end {i}' for i in range(7)))\"")  # fmt: skip
    wl = write_workload(tmp_path, command=command)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--no-tracking")
    assert rc == 0, err
    run = wait_state(store, out.strip())
    assert run.state == "SUCCESS", run.message
    tracemalloc.start()
    try:
        rc, out, err = cli(capsys, "logs", run.id, "--lines", "5")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rc == 0, err
    assert out.splitlines() == [f"[node 0] end {i}" for i in range(2, 7)]
    assert peak < 8 * 2**20, f"peak {peak} bytes for a 20 MB log"
    doc = cli_json(capsys, "logs", run.id, "--lines", "2")
    assert doc["logs"][0]["lines"] == ["end 5", "end 6"]
