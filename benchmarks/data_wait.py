"""Measure the fraction of step time spent waiting for data from a slow (throttled) directory.

A directory of sample files is read through a throttle that adds a per-file latency and a
bandwidth cap, like a busy network share. Two loaders feed the same training step:

- ``DataLoader``: a plain ``torch.utils.data.DataLoader`` (its defaults: no workers) over an
  iterable dataset that reads the files from the share.
- ``TimedDataLoader``: gpufleet's loader (default workers, prefetch) over ``FileDataset``,
  which copies files into a local cache ahead of use; epoch 2 reads from the warm cache.

The step is a real matmul workload on the GPU (or a sleep with ``--cpu``) of about
``--step-ms``. The table shows the time blocked in ``next()`` as a fraction of the step time.

GPU (about 1 minute):  python benchmarks/data_wait.py
CPU:                   python benchmarks/data_wait.py --cpu
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from gpufleet.data import FileDataset, TimedDataLoader, copy_into_cache


class Throttle:
    """Reads from the 'share' cost ``latency_s`` per file plus ``size / bandwidth``."""

    def __init__(self, latency_s: float, bandwidth_mb_s: float) -> None:
        self.latency_s = latency_s
        self.bandwidth = bandwidth_mb_s * 1e6

    def delay(self, path: Path) -> None:
        time.sleep(self.latency_s + path.stat().st_size / self.bandwidth)

    def copy(self, src: Path, dst: Path) -> None:
        self.delay(src)
        copy_into_cache(src, dst)


class ShareFiles(torch.utils.data.IterableDataset):
    """The plain way: read each file from the share when its samples are needed."""

    def __init__(self, files: list[Path], throttle: Throttle) -> None:
        self.files = files
        self.throttle = throttle

    def __iter__(self) -> Iterator[torch.Tensor]:
        for path in self.files:
            self.throttle.delay(path)
            yield from torch.load(path, weights_only=True).unbind(0)


def make_share(root: Path, num_files: int, samples_per_file: int, features: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(num_files):
        path = root / f"part-{i:04d}.pt"
        torch.save(torch.randn(samples_per_file, features), path)
        files.append(path)
    return files


def make_step(device: torch.device, step_ms: float, features: int) -> Callable[[torch.Tensor], None]:
    """A training step of about ``step_ms`` (matmuls on a GPU, a sleep on CPU)."""
    if device.type != "cuda":
        return lambda batch: time.sleep(step_ms / 1000)
    weight = torch.randn(features, 8192, device=device)
    big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def one(batch: torch.Tensor, reps: int) -> None:
        h = (batch.to(device, non_blocking=True) @ weight).to(torch.bfloat16)
        for _ in range(reps):
            h = h @ big
        h.float().sum().item()  # the loop waits for the GPU, as a loss.item() would

    one(torch.zeros(32, features), 1)
    start = time.perf_counter()
    one(torch.zeros(32, features), 50)
    per_rep = (time.perf_counter() - start) / 50
    reps = max(1, round(step_ms / 1000 / per_rep))
    return lambda batch: one(batch, reps)


def measure(batches: Iterable[torch.Tensor], step: Callable[[torch.Tensor], None]) -> tuple[int, float, float]:
    """Run the loop; returns (steps, seconds waiting for data, seconds in total)."""
    it = iter(batches)
    waited, steps = 0.0, 0
    start = time.perf_counter()
    while True:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        step(batch)
        steps += 1
    return steps, waited, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="a sleep as the step, on CPU")
    parser.add_argument("--files", type=int, default=48)
    parser.add_argument("--samples-per-file", type=int, default=256)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per-file latency of the share")
    parser.add_argument("--bandwidth-mb-s", type=float, default=100.0, help="bandwidth of the share")
    parser.add_argument("--num-workers", type=int, default=None, help="TimedDataLoader workers (default: its own)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    work = Path(tempfile.mkdtemp(prefix="gpufleet-data-bench-"))
    try:
        files = make_share(work / "share", args.files, args.samples_per_file, args.features)
        throttle = Throttle(args.latency_ms / 1000, args.bandwidth_mb_s)
        step = make_step(device, args.step_ms, args.features)
        rows = []

        plain = torch.utils.data.DataLoader(ShareFiles(files, throttle), batch_size=args.batch_size)
        rows.append(("DataLoader (plain)", 1, *measure(plain, step)))

        dataset = FileDataset(
            work / "share", pattern="*.pt", cache_dir=work / "cache", copy_file=throttle.copy, shuffle=False,
            rank=0, world_size=1,
        )
        ours = TimedDataLoader(dataset, batch_size=args.batch_size, num_workers=args.num_workers)
        for epoch in (1, 2):
            ours.reset_wait_stats()
            rows.append((f"TimedDataLoader ({ours.num_workers} workers)", epoch, *measure(ours, step)))
            own = ours.wait_stats()
            print(f"epoch {epoch}: TimedDataLoader.wait_stats(): wait_fraction={own['wait_fraction']:.3f} "
                  f"wait_s={own['wait_s']:.2f} steps={own['steps']:.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mb = args.samples_per_file * args.features * 4 / 1e6
    print(
        f"\n{args.files} files x {mb:.1f} MB on a share with {args.latency_ms:.0f} ms/file and "
        f"{args.bandwidth_mb_s:.0f} MB/s; step {args.step_ms:.0f} ms on {device.type}; {os.cpu_count()} CPUs"
    )
    header = f"{'loader':<30} {'epoch':>5} {'steps':>6} {'waiting s':>10} {'total s':>8} {'waiting %':>10}"
    print(header)
    print("-" * len(header))
    for name, epoch, steps, waited, total in rows:
        print(f"{name:<30} {epoch:>5} {steps:>6} {waited:>10.2f} {total:>8.2f} {100 * waited / total:>9.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
