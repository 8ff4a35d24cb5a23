"""``gpufleet stacks RUN_ID`` shows each rank's frame of a running call or workload."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.cli import main
from gpufleet.errors import RunCanceledError


def _waits_in_a_named_function() -> None:
    import time

    def deep_in_user_code() -> None:
        time.sleep(300)

    deep_in_user_code()


def _stacks(capsys, run_id: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["stacks", run_id])
    return code, capsys.readouterr().out


def test_stacks_of_a_running_call(capsys):
    handle = distributed(_waits_in_a_named_function, gpus=2, gpu_type="cpu", tracking=False, stream_logs=False,
                         grace_period_s=1.0, timeout=120).submit()  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline and out.count("deep_in_user_code") < 2:
            code, out = _stacks(capsys, handle.run_id[:-2])  # a unique prefix works too
            time.sleep(0.5)
        assert code == 0
        assert "=== rank 0 (pid" in out and "=== rank 1 (pid" in out
        assert out.count("deep_in_user_code") >= 2 and "test_stacks_cli.py" in out
    finally:
        handle.cancel()


def test_stacks_of_a_workload_shows_torchruns_children(tmp_path: Path, monkeypatch, capsys):
    from gpufleet.runs.store import RunStore
    from tests.workload.helpers import write_workload

    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "train.py").write_text(
        "import time\n\ndef training_step_that_waits():\n    time.sleep(300)\n\ntraining_step_that_waits()\n"
    )
    wl = write_workload(
        code_dir, compute={"accelerator_type": "CPU_2", "num_accelerators": 2}, code_source={"root_path": "."},
        command="torchrun --nproc_per_node=$LOCAL_WORLD_SIZE --master_port=$MASTER_PORT train.py\n",
    )
    assert main(["run", "-f", str(wl), "--no-tracking"]) == 0
    run_id = capsys.readouterr().out.split()[0]
    try:
        deadline = time.monotonic() + 90
        out = ""
        while time.monotonic() < deadline and out.count("training_step_that_waits") < 2:
            time.sleep(1.0)
            _, out = _stacks(capsys, run_id)
        assert "=== rank 0" in out and "=== rank 1" in out, out
        assert out.count("training_step_that_waits") >= 2
    finally:
        main(["cancel", run_id])
        RunStore(str(tmp_path / "home"))  # the store is still readable after the cancel


def test_stacks_of_an_unknown_run_says_so(capsys):
    assert main(["stacks", "20991231-no-such-run"]) == 1
    err = capsys.readouterr().err
    assert "no run '20991231-no-such-run' in the run store" in err and "gpufleet list --all-status" in err
    assert "Ray" not in err


def test_stacks_reads_only_the_runs_of_this_store(tmp_path: Path, capsys):
    import os
    import subprocess

    handle = distributed(_waits_in_a_named_function, gpus=2, gpu_type="cpu", tracking=False, stream_logs=False,
                         grace_period_s=1.0, timeout=120).submit()  # fmt: skip
    # a process of another store's run whose id shares the prefix (another GPUFLEET_HOME, say)
    other_id = handle.run_id[:-2] + "zz"
    other = subprocess.Popen([sys.executable, "-c", "import time\ndef other_stores_rank():\n    time.sleep(120)\nother_stores_rank()"],
                             env={**os.environ, "GPUFLEET_RUN_ID": other_id, "RANK": "0"})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline and out.count("deep_in_user_code") < 2:
            code, out = _stacks(capsys, handle.run_id[:-2])  # the prefix names this store's run only
            time.sleep(0.5)
        assert code == 0 and out.count("deep_in_user_code") >= 2, out
        assert str(other.pid) not in out and "other_stores_rank" not in out
        assert main(["stacks", other_id]) == 1
        assert f"no run {other_id!r} in the run store" in capsys.readouterr().err
        assert main(["stacks", handle.run_id, "--home", str(tmp_path / "another-home")]) == 1
        assert f"no run {handle.run_id!r} in the run store {tmp_path / 'another-home'}" in capsys.readouterr().err
    finally:
        other.kill()
        other.wait()
        handle.cancel()
    with pytest.raises(RunCanceledError):
        handle.result(30)
    assert main(["stacks", handle.run_id]) == 1
    assert f"run {handle.run_id} is CANCELED: none of its processes runs any more" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_short_prefix_is_refused(capsys):
    assert main(["stacks", "2026"]) == 1
    assert "at least 6 characters" in capsys.readouterr().err
