"""Processes outside gpufleet on a GPU: a rank of another run is not one, and an idle CUDA context blocks nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpufleet.launch.gpus import list_gpus
from gpufleet.launch.leasing.gpu_processes import foreign_processes


def test_ranks_of_gpufleet_runs_are_not_foreign(monkeypatch):
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, "GPUFLEET_RUN_ID": "20261201-000000-other-abcdef"},
                            start_new_session=True)  # fmt: skip
    try:
        # seen on one H200: another caller's rank was named "outside gpufleet" instead of its run
        monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", f"0={rank.pid},1=1")
        gpus = list_gpus()
        found = foreign_processes(gpus)
        assert [p.pid for procs in found.values() for p in procs] == [1]  # pid 1 is outside gpufleet
    finally:
        rank.kill()
        rank.wait()


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_an_idle_cuda_context_outside_gpufleet_is_shown_and_not_waited_for(monkeypatch, tmp_path, capsys):
    # seen on one H200: a notebook that had put one tensor on the GPU (0.5 GiB, 0 %) made every
    # gpus=1 caller wait out gpu_wait and fail with "GPU 0: pid N (python3, user root) outside gpufleet"
    import json

    from gpufleet import distributed
    from gpufleet.cli import main as cli
    from gpufleet.errors import GPUUnavailableError
    from gpufleet.launch.leasing.leases import gpu_uses

    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", "0=1:512:0")  # pid 1: a bare context, idle
    call = distributed(_visible, gpus=1, gpu_wait=0, stream_logs=False, keep_warm=False)
    assert call.distributed() == ["0"]
    deadline = time.monotonic() + 30
    while not gpu_uses()[0].free:  # the call's lease ends once its rank has exited
        assert time.monotonic() < deadline, gpu_uses()
        time.sleep(0.05)
    [use] = gpu_uses()
    assert [p.pid for p in use.beside] == [1]
    assert cli(["ps", "-o", "json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpus"][0]
    assert gpu["free"] and gpu["outside_gpufleet"] == [] and gpu["beside"][0]["pid"] == 1
    assert "outside gpufleet, idle (0.5 GiB, 0 %)" in gpu["used_by"]
    for busy in ("0=1:4096:0", "0=1:512:85", "0=1"):  # memory, compute, or use unknown: busy
        monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", busy)
        with pytest.raises(GPUUnavailableError, match=r"GPU 0: pid 1 \(.*\) outside gpufleet"):
            call.distributed()
    monkeypatch.setenv("GPUFLEET_FOREIGN_GPU_MEMORY_MIB", "8192")  # the thresholds are settings
    monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", "0=1:4096:0")
    assert call.distributed() == ["0"]


def test_the_callers_own_process_tree_is_never_outside_gpufleet(monkeypatch):
    # the caller's context (a notebook kernel) and that of the kernel or shell that started it
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    monkeypatch.setenv("GPUFLEET_FAKE_GPU_PROCESSES", f"0={os.getpid()},0={os.getppid()}")
    assert foreign_processes(list_gpus()) == {}
