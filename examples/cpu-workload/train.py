"""A small DDP training run for a CPU workload: every rank fits y = sin(sum(x)) with gloo.

Started by torchrun (see workload.yaml); reads its parameters from $HYPERPARAMETERS_PATH and
logs rank 0's loss into the attempt's MLflow run. It ends with ``runtime.finish()``, as every
script that torchrun starts should (docs/workloads.md says why: DDP keeps the gloo group alive
after ``destroy_process_group()``, and a gloo thread that frees a tensor while Python tears down
aborts the rank after it trained to its end). Runs on any machine, no GPU needed:

    gpufleet run -f examples/cpu-workload/workload.yaml --watch
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet import runtime
from gpufleet.tracking import log_metrics


def main() -> None:
    path = os.environ.get("HYPERPARAMETERS_PATH")
    params = (yaml.safe_load(open(path)) or {}) if path else {}
    steps, lr = int(params.get("steps", 200)), float(params.get("lr", 0.05))
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    for step in range(steps):
        x = torch.randn(64, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients of every rank here
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log_metrics({"loss": loss}, step=step)  # rank 0 only; a no-op without tracking
            if rank == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"rank {rank} of {world} done")


if __name__ == "__main__":
    main()
    runtime.finish()  # ends the gloo group, then exits without Python's teardown
