"""One Slurm engine for both payloads: a call's ranks and a workload's node commands, on the local Slurm cluster.

A call runs through :class:`SlurmWorkerGroup`, a workload's attempt through
:class:`WorkloadNodeGroup` over the workload's :class:`SlurmExecutor`; a spy on
:class:`SlurmEngine` proves that both submitted their job and read their units' exit codes
through it, and a failing unit's exit code comes back the same way on both.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet import distributed, errors
from gpufleet.launch.engines.slurm.engine import SlurmEngine
from gpufleet.launch.spec import LaunchSpec
from gpufleet.results import RunDir, new_run_id
from gpufleet.workload.nodes import WorkloadNodeGroup
from gpufleet.workload.schema import WorkloadConfig
from gpufleet.workload.slurm_executor import SlurmExecutor
from tests.groups import run_attempt, until
from tests.slurm.conftest import squeue_ids

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def _where() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "SLURMD_NODENAME", "GPUFLEET_RUN_ID")}


def _rank_one_exits() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(60)


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``(submit, payload)`` and ``(exit_code, kind)`` for each time a Slurm engine was asked."""
    seen: list[tuple[str, str]] = []
    submit, exit_code = SlurmEngine.submit, SlurmEngine.exit_code

    def spy_submit(self: SlurmEngine, folder: Path, payload: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(("submit", payload))
        return submit(self, folder, payload, *args, **kwargs)

    def spy_exit_code(self: SlurmEngine, kind: str, index: int) -> int | None:
        code = exit_code(self, kind, index)
        if code is not None:
            seen.append(("exit_code", kind))
        return code

    monkeypatch.setattr(SlurmEngine, "submit", spy_submit)
    monkeypatch.setattr(SlurmEngine, "exit_code", spy_exit_code)
    return seen


def _node_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> WorkloadNodeGroup:
    config = WorkloadConfig.model_validate({
        "experiment_name": "engine", "command": command,
        "compute": {"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": "slurm"},
    })  # fmt: skip
    run_id = new_run_id("engine-workload")
    monkeypatch.setenv("GPUFLEET_RUN_ID", run_id)  # as in the supervisor: the job is named with it
    run_dir = RunDir.create(str(tmp_path / "runs"), run_id)
    spec = LaunchSpec(run_id, 2, num_nodes=2, use_gpus=False, env={"OUT": str(tmp_path)})
    return WorkloadNodeGroup(spec, run_dir, SlurmExecutor(config), command, str(tmp_path), num_command_nodes=2,
                             local_world_size=1, inherited_env=os.environ)  # fmt: skip


def test_both_payloads_are_submitted_and_read_by_the_slurm_engine(tmp_path, monkeypatch, engine_calls) -> None:
    f = distributed(_where, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2, "time": "5"},
                    runs_dir=str(tmp_path), timeout=240, tracking=False)  # fmt: skip
    ranks = f.distributed()
    assert [(r["RANK"], r["SLURMD_NODENAME"]) for r in ranks] == [("0", "node1"), ("1", "node2")], ranks

    script = tmp_path / "where.py"
    script.write_text("import json, os\nout = os.path.join(os.environ['OUT'], 'node-' + os.environ['NODE_RANK'] + '.json')\n"
                      "json.dump({k: os.environ.get(k) for k in ('NODE_RANK', 'NUM_NODES', 'SLURMD_NODENAME', "
                      "'MASTER_ADDR')}, open(out, 'w'))\n")  # fmt: skip
    group = _node_group(tmp_path, monkeypatch, f"{sys.executable} {script}")
    status = run_attempt(group, poll_s=0.25)
    assert status.succeeded, status.failures
    nodes = [json.loads((tmp_path / f"node-{r}.json").read_text()) for r in (0, 1)]
    assert [(n["NODE_RANK"], n["SLURMD_NODENAME"]) for n in nodes] == [("0", "node1"), ("1", "node2")], nodes
    assert len({n["MASTER_ADDR"] for n in nodes}) == 1

    assert [c for c in engine_calls if c[0] == "submit"] == [("submit", "rank"), ("submit", "node")], engine_calls
    assert ("exit_code", "rank") in engine_calls and ("exit_code", "node") in engine_calls, engine_calls
    until("no job of the test is left in squeue", lambda: not squeue_ids())


def test_a_unit_that_exits_3_fails_with_that_code_on_both_payloads(tmp_path, monkeypatch, engine_calls) -> None:
    g = distributed(_rank_one_exits, gpus=2, gpu_type="cpu", remote="slurm", slurm={"nodes": 2, "time": "5"},
                    runs_dir=str(tmp_path), timeout=240, tracking=False, grace_period_s=1.0)  # fmt: skip
    with pytest.raises(errors.WorkerExitError, match="rank 1 of 2 failed first: process exited with code 3"):
        g.distributed()

    group = _node_group(tmp_path, monkeypatch, 'if [ "$NODE_RANK" = 1 ]; then exit 3; fi; sleep 60')
    status = run_attempt(group, poll_s=0.25)
    assert status.failures[1].exit_code == 3, status.failures
    assert ("exit_code", "rank") in engine_calls and ("exit_code", "node") in engine_calls, engine_calls
    until("no job of the test is left in squeue", lambda: not squeue_ids())
