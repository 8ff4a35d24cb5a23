"""Measure checkpoint saves: synchronous save time vs the stall of an asynchronous save.

A model of about 1B parameters (a stack of MLP blocks, fp32 weights) with AdamW state
(2 more copies) is saved by gpufleet's CheckpointManager under DDP and FSDP2, on every GPU of
the machine through ``@distributed``. For each strategy: the time of a synchronous save, the
time ``save()`` blocks the training loop when saving asynchronously (the stall), and the time
until the asynchronous checkpoint is complete. Times are the slowest rank's, the mean over
``--saves`` saves after one warm-up save of each kind.

GPU (2xH200, about 3 minutes):
    python benchmarks/checkpoint.py --gpus 2 --dir /local/nvme/ckpt-bench
CPU (tiny model, proves the script works):
    python benchmarks/checkpoint.py --cpu
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpufleet import distributed


def build_model(width: int, blocks: int) -> Any:
    import torch

    return torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
    )


def bench_rank(strategy: str, width: int, blocks: int, saves: int, root: str) -> dict[str, Any]:
    """Runs on every rank: build, one AdamW step, then timed sync and async saves."""
    import torch
    import torch.distributed as dist

    from gpufleet import runtime
    from gpufleet.checkpoint import CheckpointManager

    device = runtime.setup()
    torch.manual_seed(0)
    model = build_model(width, blocks).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width, device=device)
    model(x).float().pow(2).mean().backward()
    optimizer.step()  # AdamW state exists from here on
    optimizer.zero_grad()

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sync_devices() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        runtime.barrier()

    results: dict[str, Any] = {"strategy": strategy, "params": num_params, "world_size": dist.get_world_size()}
    sync_manager = CheckpointManager(Path(root, strategy, "sync"), model=model, optimizer=optimizer, keep_last=1)
    sync_times = []
    for i in range(saves + 1):
        sync_devices()
        start = time.perf_counter()
        sync_manager.save(i)
        sync_devices()
        if i > 0:
            sync_times.append(slowest(time.perf_counter() - start))
    sync_manager.close()

    async_manager = CheckpointManager(
        Path(root, strategy, "async"), model=model, optimizer=optimizer, keep_last=1, async_save=True
    )
    stalls, totals = [], []
    for i in range(saves + 1):
        sync_devices()
        start = time.perf_counter()
        async_manager.save(i)
        stall = time.perf_counter() - start
        # the training loop goes on here; wait for completion to time the whole save
        async_manager.wait()
        total = time.perf_counter() - start
        if i > 0:
            stalls.append(slowest(stall))
            totals.append(slowest(total))
    async_manager.close()
    size = sum(f.stat().st_size for f in Path(root, strategy, "sync").rglob("*") if f.is_file())
    results.update(
        checkpoint_gb=size / 1e9,
        sync_s=statistics.mean(sync_times),
        async_stall_s=statistics.mean(stalls),
        async_total_s=statistics.mean(totals),
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny model on 2 CPU processes")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    parser.add_argument("--width", type=int, default=None, help="hidden size (default 4096 on GPU: ~1.07B params)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--saves", type=int, default=2, help="timed saves of each kind (after one warm-up)")
    parser.add_argument("--dir", default=None, help="checkpoint folder (a fast local disk)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    width = args.width or (64 if args.cpu else 4096)
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpufleet-ckpt-bench-"))
    launch = distributed(gpus=2 if args.cpu else args.gpus, gpu_type="cpu" if args.cpu else None, tracking=False, timeout=1800)
    rows = []
    try:
        for strategy in args.strategies:
            rows.append(launch(bench_rank).distributed(strategy, width, args.blocks, args.saves, str(root))[0])
            print(f"{strategy}: {json.dumps(rows[-1])}", flush=True)
            shutil.rmtree(root / strategy, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    header = f"{'strategy':<8} {'ranks':>5} {'params':>8} {'ckpt GB':>8} {'sync save s':>12} {'async stall s':>14} {'async total s':>14} {'stall/sync':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['strategy']:<8} {r['world_size']:>5} {r['params'] / 1e9:>7.3f}B {r['checkpoint_gb']:>8.2f} "
            f"{r['sync_s']:>12.3f} {r['async_stall_s']:>14.3f} {r['async_total_s']:>14.3f} "
            f"{100 * r['async_stall_s'] / r['sync_s']:>9.1f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
