"""One Ray engine for both payloads: a call's ranks and a workload's node commands, on the two-node cluster.

A call runs through :class:`RayWorkerGroup`, a workload's attempt through
:class:`WorkloadNodeGroup` over the workload's :class:`RayExecutor`; a spy on
:class:`RayEngine` proves that both placed their actors and gave back the actors and the
placement group through it.
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
from gpufleet.launch.engines.ray.engine import RayEngine
from gpufleet.launch.spec import LaunchSpec
from gpufleet.results import RunDir, new_run_id
from gpufleet.workload.nodes import WorkloadNodeGroup
from gpufleet.workload.ray_executor import RayExecutor
from gpufleet.workload.schema import WorkloadConfig
from tests.groups import run_attempt, until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SEEN = ("MASTER_ADDR", "MASTER_PORT", "GPUFLEET_RUN_ID", "WORLD_SIZE", "NUM_NODES", "NODE_RANK")


def _seen() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in SEEN}


def _rank_one_exits() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(60)


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """What a Ray engine was asked: ``(spawn, payload, index)`` and ``(release, run id, actors held)``."""
    seen: list[tuple[str, str, int]] = []
    spawn, release = RayEngine.spawn, RayEngine.release

    def spy_spawn(self: RayEngine, payload: str, index: int, *args: Any, **kwargs: Any) -> Any:
        seen.append(("spawn", payload, index))
        return spawn(self, payload, index, *args, **kwargs)

    def spy_release(self: RayEngine, *args: Any, **kwargs: Any) -> None:
        seen.append(("release", self.run_id, len(self.actors)))
        release(self, *args, **kwargs)
        assert self.actors == [] and self.pg is None

    monkeypatch.setattr(RayEngine, "spawn", spy_spawn)
    monkeypatch.setattr(RayEngine, "release", spy_release)
    return seen


def _node_group(two_nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> WorkloadNodeGroup:
    config = WorkloadConfig.model_validate({
        "experiment_name": "engine", "command": command,
        "compute": {"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": two_nodes.address},
    })  # fmt: skip
    run_id = new_run_id("engine-workload")
    monkeypatch.setenv("GPUFLEET_RUN_ID", run_id)  # as in the supervisor: the engine names its actors with it
    executor = RayExecutor(config, two_nodes.address)
    run_dir = RunDir.create(str(tmp_path / "runs"), run_id)
    spec = LaunchSpec(run_id, 2, num_nodes=2, use_gpus=False, env={"OUT": str(tmp_path)})
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    return WorkloadNodeGroup(spec, run_dir, executor, command, str(code), num_command_nodes=2, local_world_size=1,
                             inherited_env=os.environ)  # fmt: skip


def test_both_payloads_are_placed_and_released_by_the_ray_engine(two_nodes, tmp_path, monkeypatch, engine_calls) -> None:
    f = distributed(_seen, gpus=2, gpu_type="cpu", remote=two_nodes.address, runs_dir=str(tmp_path), tracking=False)
    ranks = f.distributed()
    assert [r["WORLD_SIZE"] for r in ranks] == ["2", "2"] and len({r["MASTER_PORT"] for r in ranks}) == 1, ranks
    assert len({r["GPUFLEET_RUN_ID"] for r in ranks}) == 1

    script = tmp_path / "dump.py"
    script.write_text(f"import json, os\nout = os.path.join(os.environ['OUT'], 'node-' + os.environ['NODE_RANK'] + '.json')\n"
                      f"json.dump({{k: os.environ.get(k) for k in {SEEN!r}}}, open(out, 'w'))\n")
    group = _node_group(two_nodes, tmp_path, monkeypatch, f"{sys.executable} {script}")
    status = run_attempt(group, poll_s=0.2)
    assert status.succeeded, status.failures
    nodes = [json.loads((tmp_path / f"node-{r}.json").read_text()) for r in (0, 1)]
    assert [n["NODE_RANK"] for n in nodes] == ["0", "1"] and {n["NUM_NODES"] for n in nodes} == {"2"}, nodes
    assert len({(n["MASTER_ADDR"], n["MASTER_PORT"]) for n in nodes}) == 1
    assert {n["GPUFLEET_RUN_ID"] for n in nodes} == {group.run_id}

    spawned = [(payload, index) for what, payload, index in engine_calls if what == "spawn"]
    assert spawned == [("rank", 0), ("rank", 1), ("node", 0), ("node", 1)], engine_calls
    # each run's actors went back through the engine: the call's once its ranks exited, the workload's at its end
    call_run = ranks[0]["GPUFLEET_RUN_ID"]
    until("the call's actors are released", lambda: ("release", call_run, 2) in engine_calls)
    assert ("release", group.run_id, 2) in engine_calls, engine_calls


def test_a_unit_that_exits_3_fails_with_that_code_on_both_payloads(two_nodes, tmp_path, monkeypatch, engine_calls) -> None:
    g = distributed(_rank_one_exits, gpus=2, gpu_type="cpu", remote=two_nodes.address, runs_dir=str(tmp_path),
                    tracking=False, grace_period_s=1.0)  # fmt: skip
    with pytest.raises(errors.WorkerExitError, match="rank 1 of 2 failed first: process exited with code 3"):
        g.distributed()

    group = _node_group(two_nodes, tmp_path, monkeypatch, 'if [ "$NODE_RANK" = 1 ]; then exit 3; fi; sleep 60')
    status = run_attempt(group, poll_s=0.2)
    assert status.failures[1].exit_code == 3, status.failures
    assert ("node", 1) in [(p, i) for what, p, i in engine_calls if what == "spawn"]
    assert ("release", group.run_id, 2) in engine_calls, engine_calls  # stopped, then released at close
