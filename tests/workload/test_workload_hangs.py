"""The hang watchdog and injected faults for workloads whose ranks use gpufleet under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
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


PLAIN_TORCH = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # by itself, as examples/cpu-workload does: nothing of gpufleet
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(200):
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
print("all steps done", flush=True)
dist.destroy_process_group()
"""


def test_a_fault_fires_in_ranks_that_use_nothing_of_gpufleet(tmp_path: Path, store: RunStore, capsys) -> None:
    wl = _project(tmp_path, hang_timeout_minutes=None)
    (tmp_path / "code" / "train.py").write_text(PLAIN_TORCH)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking", "--inject-fault", "kill:rank=1:step=3")
    run = store.get(out.splitlines()[0])
    assert run.state == "FAILED" and rc != 0, out + err
    assert "[rank 1] gpufleet: injected fault: kill at step 3" in out
    assert "all steps done" not in out


def test_faults_that_could_never_fire_in_this_workload_are_refused_at_once(tmp_path: Path, store: RunStore, capsys) -> None:
    wl = _project(tmp_path)
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--inject-fault", "kill:rank=5:step=3",
                       "--inject-fault", "kill:rank=1:step=3:attempt=3", "--inject-fault", "hang:rank=0:after=inf",
                       "--inject-fault", "exit:rank=0:step=2:code=256")  # fmt: skip
    text = out + err
    assert rc == 2 and "invalid (4 problems)" in text, text
    assert "faults[0]: fault 'kill:rank=5:step=3': rank 5 does not exist: the run has 2 ranks (0..1)" in text
    assert "faults[1]: fault 'kill:rank=1:step=3:attempt=3': attempt 3 never runs" in text
    assert "faults[2]: fault 'hang:rank=0:after=inf': after must be a number of seconds from 0 to" in text
    assert "faults[3]: fault 'exit:rank=0:step=2:code=256': code must be an exit code from 0 to 255" in text
    assert store.list(states=None) == []  # nothing was submitted


def test_validate_names_every_wrong_fault_of_the_file_a_non_string_among_them(tmp_path: Path, capsys) -> None:
    # seen: one entry that was not a string hid the others' problems, and factor=1e308 passed
    wl = _project(tmp_path, faults=["kill:rank=1:step=3", "slow:rank=1:factor=1e308", "bogus:rank=1",
                                    "exit:rank=0:step=2:code=300", 5, "kill:rank=7:step=2"])  # fmt: skip
    rc, out, err = cli(capsys, "validate", "-f", str(wl))
    text = out + err
    assert rc == 2 and "invalid (5 problems)" in text, text
    assert "faults[1]: fault 'slow:rank=1:factor=1e308': a slow fault needs a factor from 1 to 1000" in text
    assert "faults[2]: fault 'bogus:rank=1': action 'bogus' is not one of kill, hang, exit, slow" in text
    assert "faults[3]: fault 'exit:rank=0:step=2:code=300': code must be an exit code from 0 to 255" in text
    assert "faults[4]: fault 5: a fault is 'ACTION[:key=value...]'" in text
    assert "faults[5]: fault 'kill:rank=7:step=2': rank 7 does not exist: the run has 2 ranks (0..1)" in text


def test_the_fault_boot_keeps_the_environments_own_sitecustomize(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from gpufleet.launch.node.guard import fault_boot_env

    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    env = {**os.environ, "GPUFLEET_FAULTS": '[{"action": "exit", "rank": 1, "after": 0, "code": 7}]', "RANK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(own), env.get("PYTHONPATH", "")])
    env.update(fault_boot_env(env))
    code = "import os, time; print(os.environ.get('OWN_SITECUSTOMIZE')); time.sleep(30)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and "injected fault: exit at 0 s after the start" in done.stderr, done
    env["RANK"] = "0"  # not a rank the fault hits: the process runs on, its own sitecustomize too
    done = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OWN_SITECUSTOMIZE'))"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "ran"), done
