"""State folders stay private, foreign ones are refused before anything is read, a full disk is named."""

from __future__ import annotations

import os
import stat

import pytest

from gpufleet import distributed, errors
from gpufleet.private import UnsafeStateError

CPU = {"gpus": 2, "gpu_type": "cpu", "tracking": False, "stream_logs": False}


def _rank() -> int:
    return int(os.environ["RANK"])


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_state_folders_and_logs_are_private(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # as an older version (or a hand-made folder) left it
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    handle = distributed(_rank, **CPU).submit()
    assert handle.result(timeout=120) == [0, 1]
    run_dir = handle.run_dir
    assert _mode(home) == 0o700 and _mode(home / "runs") == 0o700 and _mode(run_dir) == 0o700
    assert _mode(os.path.join(run_dir, "rank-0.log")) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user (chown)")
def test_a_runs_folder_of_another_user_is_refused_before_anything_is_read(tmp_path):
    foreign = tmp_path / "shared-runs"
    foreign.mkdir()
    planted = foreign / "outcome-0.pkl"
    planted.write_bytes(b"not to be read")
    os.chown(foreign, 54321, 54321)  # another user's folder: they could plant pickles in it
    f = distributed(_rank, runs_dir=str(foreign), **CPU)
    with pytest.raises(UnsafeStateError, match=r"owned by uid 54321, not by you") as info:
        f.distributed()
    assert isinstance(info.value, errors.GpufleetError)
    assert sorted(p.name for p in foreign.iterdir()) == ["outcome-0.pkl"]  # no run folder was made


def test_a_runs_folder_others_may_write_is_refused(tmp_path):
    open_folder = tmp_path / "world-writable"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    with pytest.raises(UnsafeStateError, match=r"may be written by others \(mode 0777\).*chmod 700"):
        distributed(_rank, runs_dir=str(open_folder), **CPU).distributed()


def test_a_state_folder_that_is_a_file_is_a_clear_error(tmp_path, monkeypatch):
    home = tmp_path / "not-a-folder"
    home.write_text("oops")
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    with pytest.raises(UnsafeStateError, match="is not a folder|a part of its path is a file"):
        distributed(_rank, **CPU).distributed()


def _fill_the_disk_then_return() -> int:
    """The outcome write fails as on a full disk (the function's own work is done)."""
    import errno

    from gpufleet import results

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    results.write_atomic = full
    return 1


def test_a_full_disk_is_named_in_the_error_with_the_folder(tmp_path):
    f = distributed(_fill_the_disk_then_return, runs_dir=str(tmp_path), **CPU)
    with pytest.raises(errors.WorkerExitError) as info:
        f.distributed()
    text = str(info.value)
    assert "out of disk space" in text and "No space left on device" in text
    assert str(tmp_path) in text  # the folder that is full


def _listening_addresses() -> list[str]:
    import psutil
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    runtime.setup()
    t = torch.ones(1)
    dist.all_reduce(t)
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})


def test_a_one_machine_run_listens_on_loopback_only():
    # torch's own rank 0 store (and gloo) would listen on every interface, unauthenticated
    assert distributed(_listening_addresses, **CPU).distributed() == [["127.0.0.1"], ["127.0.0.1"]]
