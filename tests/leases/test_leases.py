"""GPU leases across processes, on fake GPUs (``GPUFLEET_FAKE_GPUS=2``): the same lease code as real ones."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.errors import GPUUnavailableError
from gpufleet.launch.gpus import list_gpus
from gpufleet.launch.leasing.leases import GpuRequest, Holder, acquire, gpu_uses, wanted

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "leases"
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(folder))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield folder


class Holders:
    """Lease-holding processes of one test; every one is ended when the test ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, run_id: str, count: int = 1, wait: float = 30, hold: float | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:  # fmt: skip
        argv = [sys.executable, "-m", "tests.leases.holder", run_id, str(count), str(wait)]
        proc = subprocess.Popen(argv + ([str(hold)] if hold is not None else []), cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {})})  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    yield h
    h.close()


def got(proc: subprocess.Popen[str]) -> tuple[int, ...]:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("GOT "), line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    return tuple(int(i) for i in line[4:].split(","))


def test_two_processes_get_different_gpus_and_a_third_waits_for_one(holders: Holders) -> None:
    a, b = holders.start("run-a"), holders.start("run-b")
    gpus_a, gpus_b = got(a), got(b)
    assert {gpus_a, gpus_b} == {(0,), (1,)}
    c = holders.start("run-c", wait=30)
    assert c.stderr is not None
    waiting = c.stderr.readline() + c.stderr.readline() + c.stderr.readline()
    assert "run run-c waits for 1 GPU (2 of 2 busy)" in waiting, waiting
    assert "run run-a (call, pid" in waiting and "run run-b (call, pid" in waiting, waiting
    assert c.poll() is None  # still waiting
    assert a.stdin is not None
    a.stdin.close()  # run-a ends: its GPU goes to run-c
    assert got(c) == gpus_a
    assert a.wait(10) == 0


def test_a_waiting_run_takes_a_released_gpu_at_once_not_at_its_next_try(holders: Holders) -> None:
    # the hand-off was a polling interval; a waiter now wakes when the holder's flock goes
    a = holders.start("run-a", count=2)
    assert got(a) == (0, 1)
    waiter = holders.start("run-waiter", wait=600, env={"LEASE_RETRY_S": "600"})  # no try for 5-15 min
    assert waiter.stderr is not None and "waits for 1 GPU" in waiter.stderr.readline()
    assert wanted(list_gpus())  # a waiting run is seen by idle holders (warm ranks give their GPUs back)
    assert a.stdin is not None
    a.stdin.close()
    assert waiter.stdout is not None
    ready, _, _ = select.select([waiter.stdout], [], [], 30)  # without the wake-up: its next try in minutes
    assert ready, "the waiting run did not take the released GPU"
    assert got(waiter) in {(0,), (1,)}
    assert a.wait(10) == 0


def test_a_holder_killed_with_sigkill_frees_its_gpus(holders: Holders) -> None:
    a = holders.start("run-killed", count=2)
    assert got(a) == (0, 1)
    assert all(use.held and use.holder and use.holder.run_id == "run-killed" for use in gpu_uses())
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    with acquire(GpuRequest(count=2, wait_s=5), Holder("run-next", "call")) as lease:  # no clean-up needed
        assert lease.indices == (0, 1)
    assert all(use.free for use in gpu_uses())


def test_gpu_wait_expiry_names_the_holder(holders: Holders) -> None:
    a = holders.start("run-holding", count=2)
    got(a)
    start = time.monotonic()
    with pytest.raises(GPUUnavailableError) as info:
        acquire(GpuRequest(count=1, wait_s=0.5), Holder("run-late", "call"))
    assert 0.5 <= time.monotonic() - start < 30  # it waited the 0.5 s asked for, then gave up
    message = str(info.value)
    assert "run run-late could not get 1 GPU" in message
    assert f"GPU 0: run run-holding (call, pid {a.pid}, user " in message
    assert "gpu_wait" in message


def test_twenty_processes_racing_for_two_gpus_never_double_book(holders: Holders, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    procs = [holders.start(f"race-{i}", wait=60, hold=0.05, env={"LEASE_MARKERS": str(markers)}) for i in range(20)]
    deadline = time.monotonic() + 90
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        outputs.append(out)
        assert p.returncode == 0, out + err
    assert all(o.startswith("GOT ") for o in outputs), outputs
    assert not any("DOUBLE" in o for o in outputs), outputs
    assert sorted({o.split()[1] for o in outputs}) == ["0", "1"]


def test_every_free_gpu_and_named_gpus_and_outside_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    with acquire(GpuRequest(count=None, wait_s=0), Holder("run-all", "call")) as lease:
        assert lease.indices == (0, 1)  # gpus=None: every free GPU
    with acquire(GpuRequest(named=(1,), wait_s=0), Holder("run-named", "call")) as one:
        assert one.indices == (1,)
        with acquire(GpuRequest(count=None, wait_s=0), Holder("run-rest", "call")) as rest:
            assert rest.indices == (0,)  # the free ones only
    monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", "0=1")  # pid 1 computes on GPU 0, outside gpufleet
    with acquire(GpuRequest(count=1, wait_s=0), Holder("run-beside", "call")) as lease:
        assert lease.indices == (1,)
        with pytest.raises(GPUUnavailableError, match=r"GPU 0: pid 1 \(.*\) outside gpufleet"):
            acquire(GpuRequest(count=1, wait_s=0), Holder("run-none", "call"))


def test_a_cancel_ends_the_wait(holders: Holders) -> None:
    import threading

    got(holders.start("run-holding", count=2))
    abort = threading.Event()
    threading.Timer(0.3, abort.set).start()
    start = time.monotonic()
    with pytest.raises(KeyError, match="canceled"):
        acquire(GpuRequest(count=1, wait_s=120), Holder("run-canceled", "call"), abort=abort,
                canceled=lambda: KeyError("canceled"))  # fmt: skip
    assert time.monotonic() - start < 60  # the cancel ended the 120 s wait
