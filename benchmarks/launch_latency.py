"""Whole-process latency of a trivial distributed call, gpufleet vs the usual launchers.

Each launcher runs the same job in a fresh Python process: N ranks, process-group init,
one all-reduce, return (or print) the rank. Every measurement is a cold, whole process
(interpreter start, imports, worker start, rendezvous, teardown), timed from outside, with
the launchers interleaved round by round so that machine noise hits them alike.

    python benchmarks/launch_latency.py                 # 2 CPU workers (gloo), 5 rounds
    python benchmarks/launch_latency.py --gpus 2        # NCCL on 2 GPUs
    python benchmarks/launch_latency.py --workers 8 --gpus 8 --rounds 3

``gpufleet-warm`` is the exception: its figure is the second call of one caller with
``keep_warm`` on, timed in that caller (the ranks are already running), which is what a notebook
user waits for when running a cell again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

COMMON = textwrap.dedent(
    """
    import os
    def work(backend):
        import torch, torch.distributed as dist
        rank = int(os.environ["RANK"])
        if backend == "nccl":
            dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", device_id=dev)
        else:
            dev = torch.device("cpu")
            dist.init_process_group("gloo")
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
        dist.destroy_process_group()
        return rank
    """
)

SCRIPTS = {
    "gpufleet": """
from gpufleet import distributed
{common}
if __name__ == "__main__":
    fn = distributed(gpus={n}, gpu_type={gpu_type!r}, tracking=False, stream_logs=False)(work)
    assert fn.distributed("{backend}") == list(range({n}))
""",
    "gpufleet-warm": """
import time
from gpufleet import distributed, shutdown_workers
{common}
if __name__ == "__main__":
    fn = distributed(gpus={n}, gpu_type={gpu_type!r}, tracking=False, stream_logs=False, keep_warm=60)(work)
    assert fn.distributed("{backend}") == list(range({n}))  # the first call starts the ranks
    t0 = time.perf_counter()
    assert fn.distributed("{backend}") == list(range({n}))  # the next one reuses them
    print("WARM_CALL_S", time.perf_counter() - t0)
    shutdown_workers()
""",
    "torchrun": """
{common}
if __name__ == "__main__":
    work("{backend}")
""",
    "elastic_launch": """
import uuid
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
{common}
if __name__ == "__main__":
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node={n}, run_id=str(uuid.uuid4()),
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1)
    out = elastic_launch(cfg, work)("{backend}")
    assert sorted(out.values()) == list(range({n}))
""",
    "mp.spawn": """
import os
import torch.multiprocessing as mp
{common}
def entry(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="{n}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    work("{backend}")
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(entry, args=(port,), nprocs={n}, join=True)
""",
    "accelerate.notebook_launcher": """
from accelerate import notebook_launcher
{common}
def entry():
    work("{backend}")
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    notebook_launcher(entry, num_processes={n}, use_port=str(port))
""",
}


def _command(name: str, script: Path, n: int) -> list[str]:
    if name == "torchrun":
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", f"--nproc_per_node={n}", "--monitor_interval=0.1", str(script)]
    return [sys.executable, str(script)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=0, help="use NCCL on this many GPUs (0 = CPU, gloo)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated launcher names")
    parser.add_argument("--json", default="", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    n = args.gpus or args.workers
    backend = "nccl" if args.gpus else "gloo"
    names = [s for s in args.only.split(",") if s] or list(SCRIPTS)
    env = {**os.environ, "GPUFLEET_TRACKING": "0", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if not args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    tmp = Path(tempfile.mkdtemp(prefix="launch-latency-"))
    scripts = {}
    for name in names:
        path = tmp / f"bench_{name.replace('.', '_')}.py"
        path.write_text(SCRIPTS[name].format(common=COMMON, n=n, backend=backend,
                                             gpu_type=None if args.gpus else "cpu"))
        scripts[name] = path
    times: dict[str, list[float]] = {name: [] for name in names}
    failures: dict[str, str] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms the page cache and is not counted
        for name in names:
            if name in failures:
                continue
            t0 = time.perf_counter()
            proc = subprocess.run(_command(name, scripts[name], n), env=env, capture_output=True, text=True, timeout=300)
            dt = time.perf_counter() - t0
            if proc.returncode != 0:
                failures[name] = (proc.stderr or proc.stdout).strip().splitlines()[-1:][0] if (proc.stderr or proc.stdout).strip() else f"exit {proc.returncode}"
                continue
            if name == "gpufleet-warm":  # a warm call is timed inside its caller: the second call alone
                dt = float(next(ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("WARM_CALL_S")))
            if rnd > 0:
                times[name].append(dt)
    shutil.rmtree(tmp, ignore_errors=True)

    medians = {k: statistics.median(v) for k, v in times.items() if v}
    peers = {k: v for k, v in medians.items() if not k.startswith("gpufleet")}
    fastest_peer = min(peers, key=peers.get) if peers else None
    print(f"\nTrivial {n}-rank call ({backend}): init + all-reduce + return, cold whole process, "
          f"{args.rounds} rounds (median / min / max seconds)\n")
    print("| launcher | median s | min s | max s | vs gpufleet |")
    print("|---|---:|---:|---:|---:|")
    g = medians.get("gpufleet")
    for name in names:
        if name in failures:
            print(f"| {name} | failed: {failures[name][:80]} | | | |")
            continue
        v = times[name]
        ratio = f"{medians[name] / g:.2f}x" if g else "-"
        print(f"| {name} | {medians[name]:.2f} | {min(v):.2f} | {max(v):.2f} | {ratio} |")
    if g and fastest_peer:
        print(f"\ngpufleet / fastest peer ({fastest_peer}) = {g / peers[fastest_peer]:.2f}  (target <= 0.80)")
    if "gpufleet-warm" in medians:
        print(f"gpufleet-warm: the second call of one caller, timed in the caller (ranks kept warm); "
              f"median {medians['gpufleet-warm']:.3f} s (target <= 0.25)")
    if args.json:
        Path(args.json).write_text(json.dumps({"workers": n, "backend": backend, "times": times, "failures": failures}, indent=2))
    return 0 if g else 1


if __name__ == "__main__":
    raise SystemExit(main())
