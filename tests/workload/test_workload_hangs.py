"""The hang watchdog and injected faults for workloads whose ranks use gpufleet under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.workload.store import RunStore
from tests.workload.helpers import cli, write_workload

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)
TRAIN = """
import time
import torch
import torch.distributed as dist
from gpufleet import runtime

runtime.setup()
t = torch.ones(4)
for step in range(1, 6):
    dist.all_reduce(t)
    runtime.report_step()
    if runtime.get_global_rank() == 1 and step == 2:
        time.sleep(600)  # rank 1 stops coming
dist.destroy_process_group()
"""


def _project(tmp_path: Path, **fields) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    return write_workload(code, compute={"accelerator_type": "CPU_2", "num_accelerators": 2},
                          code_source={"root_path": "."}, command=TORCHRUN, **fields)  # fmt: skip


def test_a_hung_workload_rank_is_named_and_the_attempt_stopped(tmp_path: Path, store: RunStore, capsys) -> None:
    wl = _project(tmp_path, hang_timeout_minutes=0.08)  # about 5 s
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    run = store.get(out.splitlines()[0])
    assert rc != 0 and run.state == "TIMEDOUT", out + err
    assert "rank 1 missing from all_reduce #3 [[4]], which rank 0 waits in" in run.message
    assert "time.sleep(600)" in run.message  # rank 1's line, read with py-spy
    assert "in its own code at " in run.message and "after all_reduce #2 [[4]] (idle)" in run.message


def test_inject_fault_on_the_command_line_kills_a_rank(tmp_path: Path, store: RunStore, capsys) -> None:
    wl = _project(tmp_path, hang_timeout_minutes=None)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking", "--inject-fault", "kill:rank=0:step=1")
    run = store.get(out.splitlines()[0])
    assert run.state == "FAILED" and rc != 0
    assert "gpufleet: injected fault: kill at step 1" in out
    assert run.config["faults"] == ["kill:rank=0:step=1"]


def test_a_fault_that_could_never_fire_is_refused_at_submit(tmp_path: Path, capsys) -> None:
    wl = _project(tmp_path)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--inject-fault", "kill:rank=1", "--dry-run")
    assert rc == 2 and "exactly one of step=N or after=SECONDS" in out + err and "Traceback" not in out + err


@pytest.mark.parametrize("field", ["hang_timeout_minutes"])
def test_the_watchdog_field_is_validated(tmp_path: Path, capsys, field: str) -> None:
    wl = _project(tmp_path, **{field: -1})
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    assert rc == 2 and field in out + err
