"""DDP regression with a small MLP: the first gpufleet recipe.

Runs on every GPU of the machine, or on CPU worker processes (gloo) where there is none:

    python recipes/pytorch-ddp-mlp/train.py                 # all GPUs, else 2 CPU workers
    python recipes/pytorch-ddp-mlp/train.py --workers 2 --cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from gpufleet import distributed, runtime
from gpufleet.launch.gpus import list_gpus
from gpufleet.tracking import default_tracking_uri, log_metrics
from gpufleet.tracking.links import server_address, ui_command


def train(epochs: int = 20, lr: float = 3e-3, num_samples: int = 16384, batch_size: int = 256,
          hidden: int = 256, seed: int = 0) -> dict:
    """Fit y = sin(x . w) + noise with an MLP under DDP; returns this rank's final metrics."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    device = runtime.setup()
    rank, world = runtime.get_global_rank(), runtime.get_world_size()

    # The same synthetic dataset on every rank (seeded); each rank reads its own shard.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen) / 4  # x . w ~ N(0, 1): a smooth target
    y = torch.sin(x @ w) + 0.05 * torch.randn(num_samples, 1, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(seed)  # identical initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 1),
    ).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()

    first_loss = last_loss = float("nan")
    t0 = time.perf_counter()
    samples = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = loss_fn(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)), device=device)])
            samples += len(xb)
        dist.all_reduce(total)  # mean loss over every rank's samples
        epoch_loss = (total[0] / total[1]).item()
        if epoch == 0:
            first_loss = epoch_loss
        last_loss = epoch_loss
        log_metrics({"loss": epoch_loss}, step=epoch)  # rank 0's loss into the run's MLflow metrics
        if runtime.is_main_process() and (epoch % 5 == 0 or epoch == epochs - 1):
            print(f"epoch {epoch:3d}  loss {epoch_loss:.4f}")
    elapsed = time.perf_counter() - t0
    return {
        "rank": rank,
        "world_size": world,
        "device": str(device),
        "first_loss": first_loss,
        "final_loss": last_loss,
        "samples_per_s": samples / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="ranks (default: every GPU, else 2 CPU workers)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU workers even where GPUs exist")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    use_cpu = args.cpu or not list_gpus()
    workers = args.workers or (2 if use_cpu else None)
    fn = distributed(gpus=workers, gpu_type="cpu" if use_cpu else None, timeout=1800)(train)
    handle = fn.submit(epochs=args.epochs, lr=args.lr)
    results = handle.result()
    print(json.dumps(results, indent=2))
    r0 = results[0]
    print(
        f"\n{r0['world_size']} ranks on {r0['device'].split(':')[0]}: loss {r0['first_loss']:.4f} -> "
        f"{r0['final_loss']:.4f}; {sum(r['samples_per_s'] for r in results):,.0f} samples/s in total"
    )
    print_where(handle, len(results))
    if not r0["final_loss"] < 0.5 * r0["first_loss"]:
        print("the loss did not fall by half: something is wrong")
        return 1
    return 0


def print_where(handle, num_ranks: int) -> None:
    """Where the run's results are: its id, folder, each rank's log and the MLflow run."""
    run_dir = Path(handle.run_dir)
    print(f"\nrun id:     {handle.run_id}")
    print(f"run folder: {run_dir}")
    for rank in range(num_ranks):
        print(f"rank {rank} log: {run_dir / f'rank-{rank}.log'}")
    if handle.mlflow_run_id is None:
        print("MLflow:     tracking is off (GPUFLEET_TRACKING=0, or MLflow is not installed)")
        return
    uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    print(f"MLflow run: {handle.mlflow_run_id} (rank 0's loss as metric 'loss'); to look at it:")
    command = ui_command(uri)
    print(f"  {_in_any_shell(command) if command else server_address(uri) or uri}")  # `mlflow ui`, or the server


def _in_any_shell(command: str) -> str:
    """``command`` with its program by absolute path when it is this virtual environment's: it then runs
    from any shell, also one where the environment is not activated (``scripts/demo.sh`` activates nothing)."""
    program, _, rest = command.partition(" ")
    own = Path(sys.executable).parent / program
    if sys.prefix != sys.base_prefix and own.is_file():
        return f"{shlex.quote(str(own))} {rest}"
    return command


if __name__ == "__main__":
    raise SystemExit(main())
