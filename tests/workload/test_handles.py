"""One handle family: a submitted call, a detached call and a workload run answer the same questions
the same way (status, done, wait, logs, stacks, cancel, result), and ``gpufleet wait`` exits with the end."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpufleet import RunHandle, StoredRunHandle, distributed, run_handle
from gpufleet.errors import RunCanceledError, WorkerGroupError
from gpufleet.runs.store import RunStore
from tests.workload.helpers import (
    SLEEPER,
    cli,
    cli_process,
    detach_script,
    wait_no_processes,
    wait_until,
    write_workload,
)

pytestmark = pytest.mark.usefixtures("home")


@pytest.fixture(autouse=True)
def _no_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")


@distributed(gpus=2, gpu_type="cpu", tracking=False, stream_logs=False)
def sleeper() -> None:
    import time

    print("waiting", flush=True)
    time.sleep(120)


#: A workload whose one rank (under torchrun) prints "waiting" and sleeps, as the calls' ranks do.
SLEEPY_RANK = "import time\nprint('waiting', flush=True)\ntime.sleep(120)\n"
TORCHRUN = ("torchrun --nnodes=1 --nproc_per_node=1 --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT "
            "sleepy_rank.py")  # fmt: skip


def _start(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    if kind == "submitted call":
        return sleeper.submit()
    if kind == "detached call":
        return run_handle(detach_script(tmp_path, SLEEPER))
    (tmp_path / "sleepy_rank.py").write_text(SLEEPY_RANK)
    workload = write_workload(tmp_path, code_source={"root_path": "."}, command=TORCHRUN)
    code, out, err = cli(capsys, "run", "-f", str(workload), "--no-tracking")
    assert code == 0, err
    return run_handle(out.strip()[:12])  # a unique prefix will do


@pytest.mark.parametrize("kind", ["submitted call", "detached call", "workload"])
def test_every_kind_of_run_is_followed_and_canceled_through_the_same_handle(
    kind: str, tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = _start(kind, tmp_path, capsys)
    assert isinstance(handle, RunHandle if kind == "submitted call" else StoredRunHandle)
    wait_until("rank 0 prints", lambda: "waiting" in handle.logs(0), timeout=90)
    assert (handle.status, handle.done(), handle.wait(0.1)) == ("RUNNING", False, "RUNNING")
    with pytest.raises(TimeoutError, match=f"run {handle.run_id} is still RUNNING after 0.1 s"):
        handle.result(0.1)
    stacks = handle.stacks()
    where = {"submitted call": "sleeper", "detached call": "train", "workload": "sleepy_rank.py"}[kind]
    assert 0 in stacks and where in stacks[0], stacks  # where rank 0 is now: in its own code
    assert Path(handle.run_dir).is_dir()
    handle.cancel(wait=60)
    assert (handle.done(), handle.status, handle.wait()) == (True, "CANCELED", "CANCELED")
    with pytest.raises(RunCanceledError, match=r"canceled by the user"):
        handle.result(10)
    assert store.get(handle.run_id).message == "canceled by the user"
    assert wait_no_processes(handle.run_id) == []


def test_a_workload_handle_gives_none_for_success_and_the_stored_error_for_failure(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    ends = {}
    for name, command in (("ok", "echo fine"), ("bad", "echo doomed >&2; exit 7")):
        code, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, f"{name}.yaml", command=command)),
                             "--no-tracking")  # fmt: skip
        assert code == 0, err
        ends[name] = run_handle(out.strip())
    assert ends["ok"].result(60) is None and ends["ok"].status == "SUCCESS"
    assert "fine" in ends["ok"].logs(0)
    with pytest.raises(WorkerGroupError, match=rf"run {ends['bad'].run_id} ended FAILED: node 0 exited with code 7"):
        ends["bad"].result(60)


def test_gpufleet_wait_exits_with_the_code_of_the_runs_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, command="exit 7")), "--no-tracking")
    failing = out.strip()
    waited = cli_process("wait", failing, "--timeout", "60")
    assert waited.returncode == 1 and waited.stdout.startswith(f"{failing}\tFAILED\tnode 0 exited with code 7")
    call_id = detach_script(tmp_path, textwrap.dedent("""
        from gpufleet import distributed

        @distributed(gpus=1, gpu_type="cpu", tracking=False)
        def train():
            return 1
    """))
    assert cli_process("wait", call_id).returncode == 0
    code, out, err = cli(capsys, "run", "-f", str(write_workload(tmp_path, "slow.yaml", command="sleep 120")),
                         "--no-tracking")  # fmt: skip
    slow = out.strip()
    still = cli_process("wait", slow, "--timeout", "0.5")
    assert still.returncode == 3 and still.stdout.split() in ([slow, "PENDING"], [slow, "RUNNING"])
    canceled = cli_process("cancel", slow)
    assert canceled.returncode == 0, canceled.stderr
    assert cli_process("wait", slow).returncode == 130
    assert wait_no_processes(slow) == []
