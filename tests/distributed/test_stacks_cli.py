"""``gpufleet stacks RUN_ID`` shows each rank's frame of a running call or workload."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.cli import main


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
    from gpufleet.workload.store import RunStore
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
    assert "no running process of run" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_short_prefix_is_refused(capsys):
    assert main(["stacks", "2026"]) == 1
    assert "at least 6 characters" in capsys.readouterr().err
