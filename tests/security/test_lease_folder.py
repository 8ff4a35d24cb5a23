"""Item: the GPU lease folder and its lock files, as a neighbour would abuse them (fake GPUs)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from gpufleet.errors import GPUUnavailableError
from gpufleet.launch.gpus import GPUInfo
from gpufleet.launch.leasing import leases
from gpufleet.launch.leasing.leases import (
    GpuRequest,
    Holder,
    LeaseDirError,
    acquire,
    lease_dir,
    try_lease,
)
from tests.workload.helpers import REPO, cli

GPUS = [GPUInfo(0, "Fake GPU", "GPU-fake-0000", 1 << 30), GPUInfo(1, "Fake GPU", "GPU-fake-0001", 1 << 30)]


@pytest.fixture(autouse=True)
def _no_nvml(monkeypatch):
    monkeypatch.setenv("GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES", "1")
    monkeypatch.delenv("GPUFLEET_LEASE_DIR", raising=False)
    monkeypatch.setattr(leases, "_warned_private", False, raising=False)


def _as(user, *argv: str) -> None:
    done = user.run(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=30)
    assert done.returncode == 0, err


def test_a_lease_folder_another_user_made_first_is_not_trusted(second_user, shared_tmp, monkeypatch, tmp_path):
    """Its owner may rename lock files in it (sticky or not): two runs would hold one GPU."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GPUFLEET_FAKE_GPUS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", shared_tmp)  # the default folder: <tmp>/gpufleet-gpu-leases
    shared = Path(shared_tmp) / "gpufleet-gpu-leases"
    _as(second_user, "/bin/sh", "-c", f"mkdir {shared} && chmod 1777 {shared}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = acquire(GpuRequest(count=1, wait_s=0), Holder("run-a", "call"), gpus=GPUS[:1])
    try:
        used = lease_dir()
        assert used == tmp_path / "home" / "gpu-leases" and (used.stat().st_mode & 0o777) == 0o700
        said = [str(w.message) for w in caught]
        assert len(said) == 1 and f"{shared} belongs to {second_user.name}" in said[0], said
        # the owner tries to swap the lock file away; the second run must still find the GPU taken
        _as(second_user, "/bin/sh", "-c", f"mv {shared}/gpu-GPU-fake-0000.lock {shared}/moved 2>/dev/null; true")
        second, busy = try_lease(GpuRequest(count=1, wait_s=0), Holder("run-b", "call"), GPUS[:1])
        assert second is None and busy[0].holder is not None and busy[0].holder.run_id == "run-a"
        monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(shared))  # named on purpose: an error, not a fallback
        with pytest.raises(LeaseDirError, match=rf"{shared} \(GPUFLEET_LEASE_DIR\) belongs to {second_user.name}"):
            lease_dir()
    finally:
        first.release()


def _ps(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufleet.cli", "ps"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env}, timeout=60)  # fmt: skip


def test_a_fifo_or_link_planted_as_a_lock_file_blocks_only_its_gpu_and_not_ps(second_user, shared_tmp, monkeypatch,
                                                                              tmp_path):  # fmt: skip
    folder = Path(shared_tmp) / "leases"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(folder))
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")
    fifo = folder / "gpu-GPU-fake-0000.lock"
    _as(second_user, "/usr/bin/mkfifo", "-m", "666", str(fifo))  # only its maker (or root) may remove it now
    done = _ps({})  # it hung opening the FIFO before
    assert done.returncode == 0, done.stderr
    assert f"{fifo} is not a plain file, made by {second_user.name}" in done.stdout, done.stdout
    # every free GPU: the other one; the planted one by name: a clear error, not a LeaseDirError
    fakes = leases.list_gpus()
    with acquire(GpuRequest(count=None, wait_s=0), Holder("run-a", "call"), gpus=fakes) as lease:
        assert lease.indices == (1,)
    with pytest.raises(GPUUnavailableError, match=rf"GPU 0: its lock file {fifo} is not a plain file, made by"):
        acquire(GpuRequest(named=(0,), wait_s=0), Holder("run-b", "call"), gpus=fakes)
    os.unlink(fifo)
    (folder / "target").write_text("")
    os.link(folder / "target", fifo)
    with pytest.raises(GPUUnavailableError, match="is a second link to another file"):
        acquire(GpuRequest(named=(0,), wait_s=0), Holder("run-b", "call"), gpus=fakes)
    os.unlink(fifo)
    # a folder of that name (seen: every caller failed with a LeaseDirError, ps said "no GPU")
    _as(second_user, "/usr/bin/mkdir", "-m", "777", str(fifo))
    done = _ps({})
    assert done.returncode == 0, done.stderr
    assert f"{fifo} is a folder, made by {second_user.name}" in done.stdout, done.stdout
    with acquire(GpuRequest(count=None, wait_s=0), Holder("run-a", "call"), gpus=fakes) as lease:
        assert lease.indices == (1,)
    with pytest.raises(GPUUnavailableError, match=rf"GPU 0: its lock file {fifo} is a folder, made by {second_user.name}"):
        acquire(GpuRequest(named=(0,), wait_s=0), Holder("run-b", "call"), gpus=fakes)


def test_a_holder_record_with_terminal_escapes_is_printed_escaped(monkeypatch, tmp_path, capsys):
    folder = tmp_path / "leases"
    folder.mkdir()
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(folder))
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    record = {"run_id": "x\x1b[2J\x1b[31mowned", "kind": "call\r", "pid": 1, "user": "\u202eevil", "since": 0}
    fd = os.open(folder / "gpu-GPU-fake-0000.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.write(fd, json.dumps(record).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)  # held: ps reads the record
        rc, out, err = cli(capsys, "ps")
    finally:
        os.close(fd)
    assert rc == 0, err
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    # the record's pid and user are not this process's: the lock's are shown, the claim marked (escaped)
    assert f"run x\\x1b[2J\\x1b[31mowned (call\\r, pid {os.getpid()}, user {leases.user_name()}" in out, out
    assert "its lock record claims pid 1, user \\u202eevil, which the lock disproves" in out, out


HOLD_AND_CLAIM = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, json.dumps({"run_id": "trusted-run", "kind": "call", "pid": 1, "user": "root", "since": time.time()}).encode())
print("HELD", os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_holder_claiming_to_be_someone_else_is_shown_as_who_holds_the_lock(second_user, shared_tmp, monkeypatch,
                                                                          tmp_path):  # fmt: skip
    # seen: a user who held a GPU's lock wrote "user root, pid 1": ps and a waiter showed it as fact
    folder = Path(shared_tmp) / "leases"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    monkeypatch.setenv("GPUFLEET_LEASE_DIR", str(folder))
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "1")
    holder = second_user.run("/usr/bin/python3", "-c", HOLD_AND_CLAIM, str(folder / "gpu-GPU-fake-0000.lock"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    pid = None
    try:
        line = holder.stdout.readline()
        assert line.startswith("HELD "), line + holder.stderr.read()
        pid = int(line.split()[1])
        done = _ps({})
        assert done.returncode == 0, done.stderr
        shown = f"run trusted-run (call, pid {pid}, user {second_user.name}, since"
        assert shown in done.stdout and "its lock record claims pid 1, user root, which the lock disproves" in done.stdout, done.stdout
        with pytest.raises(GPUUnavailableError) as info:
            acquire(GpuRequest(count=1, wait_s=0), Holder("run-b", "call"), gpus=leases.list_gpus())
        assert shown in str(info.value) and "claims pid 1, user root" in str(info.value), str(info.value)
    finally:
        if pid is not None:
            os.kill(pid, 9)  # runuser's child: a kill of runuser does not reach it
        holder.kill()
        holder.communicate(timeout=30)
