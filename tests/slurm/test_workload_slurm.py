"""CLI workloads on the real local Slurm cluster (two emulated nodes): ``compute.cluster: slurm``."""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import squeue_ids
from tests.workload.helpers import cli, cli_json, wait_no_processes, write_workload

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

TRAIN = textwrap.dedent(
    """
    import os
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ["NUM_NODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURMD_NODENAME"]
    env = " ".join(f"{k}={os.environ[k]}" for k in keys)
    print(f"rank={dist.get_rank()} sum={t.item()} secret={os.environ['TOKEN'] == 's3cr3t-value'} {env}", flush=True)
    dist.destroy_process_group()
    """
)

TORCHRUN = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py\n"
)


def slurm_workload(tmp_path: Path, monkeypatch, name: str, command: str, files: dict[str, str] | None = None,
                   slurm: dict | None = None, **fields) -> Path:  # fmt: skip
    """A two-node CPU workload folder for the local cluster, in a private GPUFLEET_HOME; its YAML."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    code = tmp_path / "project"
    code.mkdir()
    for file_name, text in (files or {}).items():
        (code / file_name).write_text(text)
    compute = {"accelerator_type": "CPU_1", "num_accelerators": 2, "cluster": "slurm"}
    if slurm is not None:
        compute["slurm"] = slurm
    return write_workload(code, experiment_name=name, compute=compute, code_source={"root_path": "."},
                          command=command, **fields)  # fmt: skip


def test_torchrun_once_per_node_on_two_slurm_nodes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SLURM_TEST_TOKEN", "s3cr3t-value")
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-two-nodes", TORCHRUN, files={"train.py": TRAIN},
                               slurm={"partition": "debug", "time": "5"}, secrets={"TOKEN": {"env": "SLURM_TEST_TOKEN"}})  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--watch", "--no-tracking")
    assert rc == 0, out + err
    run_id = out.splitlines()[0]
    run = cli_json(capsys, "get", run_id)
    assert run["state"] == "SUCCESS", run
    nodes = run["attempts"][0]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    job_id = nodes[0]["slurm_job_id"]
    assert job_id and nodes[1]["slurm_job_id"] == job_id
    folder = Path(run["attempts"][0]["log_dir"])
    for node in (0, 1):
        log = (folder / f"node-{node}.log").read_text()
        assert f"rank={node} sum=3.0 secret=True NUM_NODES=2 NODE_RANK={node} WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 " \
               f"SLURMD_NODENAME=node{node + 1}" in log, log  # fmt: skip
    # the secret is in no file of the run folder (the batch script holds paths only)
    for path in folder.rglob("*"):
        if path.is_file():
            assert b"s3cr3t-value" not in path.read_bytes(), path
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []
