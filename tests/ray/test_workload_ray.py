"""A CLI workload across two Ray nodes: ``torchrun --nnodes=2`` once per node."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.workload.store import RunStore
from tests.workload.helpers import cli, cli_json, wait_no_processes, write_workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRAIN = textwrap.dedent(
    """
    import os, yaml
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    params = yaml.safe_load(open(os.environ["HYPERPARAMETERS_PATH"]))
    keys = ["NUM_NODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
    env = " ".join(f"{k}={os.environ[k]}" for k in keys)
    print(f"rank={dist.get_rank()} sum={t.item()} lr={params['lr']} {env}", flush=True)
    dist.destroy_process_group()
    """
)

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)


def _two_node_workload(
    two_nodes, tmp_path: Path, monkeypatch, name: str, command: str, files: dict[str, str] | None = None, **fields
) -> Path:
    """A workload folder (with ``files``) for the two-node cluster, in a private GPUFLEET_HOME; its YAML."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    code = tmp_path / "project"
    code.mkdir()
    for file_name, text in (files or {}).items():
        (code / file_name).write_text(text)
    return write_workload(
        code,
        experiment_name=name,
        compute={"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": two_nodes.address},
        code_source={"root_path": "."},
        command=command,
        **fields,
    )


def test_torchrun_once_per_node(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    home = tmp_path / "home"
    yaml_path = _two_node_workload(
        two_nodes, tmp_path, monkeypatch, "two-nodes", TORCHRUN, files={"train.py": TRAIN}, parameters={"lr": 0.25}
    )
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    assert "rank=0 sum=3.0 lr=0.25 NUM_NODES=2 NODE_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" in out
    assert "rank=1 sum=3.0 lr=0.25 NUM_NODES=2 NODE_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" in out

    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS"
    nodes = run["attempts"][0]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    assert nodes[0]["ray_node_id"] != nodes[1]["ray_node_id"]
    logs = cli_json(capsys, "logs", run_id, "--node", "1")
    assert any("NODE_RANK=1" in line for line in logs["logs"][0]["lines"])
    assert wait_no_processes(run_id) == []
    store = RunStore(home)
    assert store.get(run_id).state == "SUCCESS"


FAIL_ON_NODE_1 = textwrap.dedent(
    """
    if [ "$NODE_RANK" = "1" ]; then echo "node 1 gives up" >&2; exit 3; fi
    sleep 300 & echo $! > "$MARKER_DIR/node$NODE_RANK.pid"; wait
    """
)


def test_a_failing_node_stops_the_others_and_fails_the_run(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    import psutil

    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-fail", FAIL_ON_NODE_1,
                                   env_variables={"MARKER_DIR": str(tmp_path)}, max_retries=0)
    started = time.monotonic()
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    elapsed = time.monotonic() - started
    assert rc != 0
    assert elapsed < 60, f"node 0 was not stopped when node 1 failed ({elapsed:.0f} s)"
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "FAILED"
    assert "node 1" in (out + err) and "code 3" in (out + err)
    sleeper = tmp_path / "node0.pid"
    if sleeper.exists():  # node 0 had started its command: it must be gone
        assert not psutil.pid_exists(int(sleeper.read_text())) or psutil.Process(int(sleeper.read_text())).status() == psutil.STATUS_ZOMBIE
    assert wait_no_processes(run_id) == []


def test_a_tracked_workload_gets_system_metrics_from_each_node(two_nodes, tmp_path: Path, monkeypatch, capsys) -> None:
    import os

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    command = 'echo "node $NODE_RANK logs into $MLFLOW_RUN_ID; snapshot shipped=$GPUFLEET_SHIPPED_CODE"; sleep 1\n'
    yaml_path = _two_node_workload(two_nodes, tmp_path, monkeypatch, "two-nodes-tracked", command)
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch")
    assert rc == 0, out + err
    run = cli_json(capsys, "get", out.splitlines()[0])
    mlflow_run_id = run["attempts"][0]["mlflow_run_id"]
    # the code snapshot also travelled as the Ray job's working_dir (used where the run folder is missing)
    assert f"node 1 logs into {mlflow_run_id}; snapshot shipped=1" in out
    metrics = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(mlflow_run_id).data.metrics
    system = {k for k in metrics if k.startswith("system/")}
    assert {k.split("/")[1] for k in system} == {"node0", "node1"}, system
