"""What running on Slurm costs, on the local two-node cluster of ``scripts/slurm_local.sh``.

Times, each from outside and end to end: bringing the cluster up and down; ``srun`` of a 2-node
gloo all-reduce (the floor: Slurm plus two torch imports); a 2-node ``@distributed(remote="slurm")``
call doing the same all-reduce; the same call on this machine (``remote=False``), for comparison.
Needs root and Slurm's packages (``scripts/slurm_local.sh ensure``); stops the cluster at the end
unless it was already up.

    python benchmarks/slurm_local.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
STATE = os.environ.get("GPUFLEET_SLURM_DIR", "/tmp/gpufleet-slurm")

ALL_REDUCE = """
import os, torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=world)
t = torch.ones(1); dist.all_reduce(t); assert t.item() == world
dist.destroy_process_group()
"""

CALL = """
import sys
from gpufleet import distributed

def f():
    import torch, torch.distributed as dist
    from gpufleet import runtime
    runtime.setup()
    t = torch.ones(1); dist.all_reduce(t)
    return t.item()

remote = sys.argv[1]
opts = {"remote": "slurm", "slurm": {"nodes": 2}} if remote == "slurm" else {}
assert distributed(f, gpus=2, gpu_type="cpu", tracking=False, stream_logs=False, **opts).distributed() == [2.0, 2.0]
"""


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **(env or {})}, timeout=600)
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    was_up = subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode == 0
    rows: dict[str, list[float]] = {}
    if was_up:
        subprocess.run([str(SCRIPT), "stop"], check=True, capture_output=True)
    for _ in range(args.rounds):
        rows.setdefault("cluster start (munge, slurmctld, 2 slurmd; both nodes idle)", []).append(timed([str(SCRIPT), "start"]))
        rows.setdefault("cluster stop (nothing left)", []).append(timed([str(SCRIPT), "stop"]))
    subprocess.run([str(SCRIPT), "start"], check=True, capture_output=True)
    env = {"SLURM_CONF": os.path.join(STATE, "slurm.conf"), "PYTHONPATH": str(REPO / "src")}
    with tempfile.TemporaryDirectory() as home:
        env["GPUFLEET_HOME"] = home
        script = Path(home) / "ar.py"
        script.write_text(ALL_REDUCE)
        call = Path(home) / "call.py"
        call.write_text(CALL)
        for i in range(args.rounds):
            rows.setdefault("srun -N2: gloo all-reduce (the floor)", []).append(
                timed(["srun", "-N2", "--ntasks-per-node=1", sys.executable, str(script)], {**env, "PORT": str(29600 + i)})
            )
            rows.setdefault('@distributed(gpus=2, remote="slurm"): all-reduce, 2 nodes', []).append(
                timed([sys.executable, str(call), "slurm"], env)
            )
            rows.setdefault("@distributed(gpus=2) on this machine: all-reduce", []).append(
                timed([sys.executable, str(call), "local"], env)
            )
    if not was_up:
        subprocess.run([str(SCRIPT), "stop"], check=True, capture_output=True)
    width = max(map(len, rows))
    print(f"{'what':<{width}}  median s  min s  rounds")
    for name, times in rows.items():
        print(f"{name:<{width}}  {statistics.median(times):8.2f}  {min(times):5.2f}  {len(times):6d}")
    print(f"(load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
