"""Slurm on real GPUs: the local cluster's nodes offer the machine's GPUs as GRES (``--gpus-per-node``).

Skipped where no NVIDIA GPU is visible, or where the cluster was started without GPUs
(``scripts/slurm_local.sh`` gives its nodes the machine's GPUs, shared by both emulated nodes).
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.launch.gpus import list_gpus
from tests.slurm.conftest import squeue_ids
from tests.slurm.test_workload_slurm import _ended, _job_of, _steps, _wait, slurm_workload
from tests.workload.helpers import cli, wait_no_processes

GPUS = list_gpus()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU"),
    pytest.mark.usefixtures("slurm_cluster"),
]


@pytest.fixture(autouse=True)
def cluster_has_gpus(slurm_cluster: str) -> None:
    gres = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%G"], capture_output=True, text=True).stdout
    if "gpu" not in gres:
        pytest.skip(f"the local Slurm cluster offers no GPU (sinfo: {gres.strip()!r}); restart it on this machine")


def _short_name() -> str:
    return "H200" if "H200" in GPUS[0].name else GPUS[0].name.split()[-1]


def on_the_gpu_slurm_gave() -> dict:
    import os

    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    dev = runtime.setup()
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "device": str(dev), "name": torch.cuda.get_device_name(dev),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "sum": t.sum().item(),
            "slurm_gpus": os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_JOB_GPUS")}  # fmt: skip


def test_a_call_gets_its_gpu_from_slurm_and_runs_nccl(tmp_path) -> None:
    f = distributed(on_the_gpu_slurm_gave, gpus=1, gpu_type=_short_name(), remote="slurm", slurm={"nodes": 1},
                    runs_dir=str(tmp_path), timeout=300, tracking=False)  # fmt: skip
    (got,) = f.distributed()
    assert got["backend"] == "nccl" and got["device"] == "cuda:0" and got["sum"] == 1024.0, got
    assert GPUS[0].name in got["name"] or _short_name() in got["name"], got
    assert got["visible"] is not None and got["slurm_gpus"], got  # Slurm chose the GPU (GRES), not gpufleet
    _wait(lambda: not squeue_ids(), "the job to leave the queue (the result comes back while it completes)", timeout=30)


TRAIN_ON_GPU = textwrap.dedent(
    """
    import os, time
    import torch
    from gpufleet.checkpoint import CheckpointManager

    attempt = os.environ["GPUFLEET_ATTEMPT"]
    marker = os.environ["MARKER_DIR"]
    model = torch.nn.Linear(1, 1).cuda()
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    manager = CheckpointManager(os.environ["GPUFLEET_CHECKPOINT_DIR"], model=model, optimizer=optimizer)
    start = manager.resume() or 0
    for step in range(start, 12):
        with torch.no_grad():
            model.weight += 1.0
        with open(os.path.join(marker, "steps-0.txt"), "a") as f:
            f.write(f"{attempt} {step + 1} {model.weight.item():g}\\n")
        if step + 1 == 3:
            open(os.path.join(marker, "ready"), "w").close()
        stop = manager.save_if_preempted(step + 1)
        deadline = time.monotonic() + 150
        while not stop and attempt == "1" and step + 1 >= 3 and time.monotonic() < deadline:
            time.sleep(0.2)
            stop = manager.save_if_preempted(step + 1)
        if stop:
            print(f"checkpointed step {step + 1} on {torch.cuda.get_device_name()}", flush=True)
            break
    """
)


def test_a_gpu_workload_preempted_on_slurm_resumes_from_its_checkpoint(tmp_path: Path, monkeypatch, capsys) -> None:
    yaml_path = slurm_workload(tmp_path, monkeypatch, "slurm-gpu-preempt", "python train.py\n",
                               files={"train.py": TRAIN_ON_GPU}, env_variables={"MARKER_DIR": str(tmp_path)},
                               max_retries=0)  # fmt: skip
    text = yaml_path.read_text().replace("accelerator_type: CPU_1", f"accelerator_type: GPU_1x{_short_name()}")
    yaml_path.write_text(text.replace("num_accelerators: 2", "num_accelerators: 1"))
    rc, out, err = cli(capsys, "run", "-f", str(yaml_path), "--no-tracking")
    assert rc == 0, out + err
    run_id = out.split()[0]
    _wait(lambda: (tmp_path / "ready").exists(), "the first attempt to train a few steps on the GPU")
    job_id = _job_of(capsys, run_id)
    subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                    f"--output={tmp_path / 'urgent.log'}", "--wrap", "sleep 1"], check=True, capture_output=True)  # fmt: skip
    run = _ended(capsys, run_id)
    assert run["state"] == "SUCCESS", run
    assert [a["attempt"] for a in run["attempts"]] == [1, 2] and "higher" in run["attempts"][0]["message"], run
    lines = _steps(tmp_path / "steps-0.txt")
    second = [s for a, s, _ in lines if a == 2]
    assert second[0] == max(s for a, s, _ in lines if a == 1) + 1, lines
    assert [w for _, _, w in lines] == [float(i + 1) for i in range(12)], lines
    log = (Path(run["attempts"][0]["log_dir"]) / "node-0.log").read_text()
    assert "checkpointed step" in log and GPUS[0].name.split()[-1] in log, log
    _wait(lambda: not squeue_ids(), "the queue to empty", timeout=30)
    assert job_id not in squeue_ids()
    assert wait_no_processes(run_id) == []
