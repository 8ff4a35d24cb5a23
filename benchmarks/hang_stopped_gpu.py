"""One GPU rank stops itself (SIGSTOP) after five all-reduces: the hang report must name that line.

Run on a machine with a GPU: `python benchmarks/hang_stopped_gpu.py` (three rounds, about 50 s each:
hang_timeout=40, one rank has nobody waiting for it, so no fast path).
"""
import time

from gpufleet import distributed, runtime
from gpufleet.errors import DistributedHangError


def stopped() -> None:
    import os
    import signal

    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.ones(4, device="cuda")
    for _ in range(5):
        dist.all_reduce(t)
        torch.cuda.synchronize()
        runtime.report_step()
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)  # STOPPED HERE
    dist.all_reduce(t)
    torch.cuda.synchronize()


for round_ in range(3):
    t0 = time.monotonic()
    try:
        distributed(stopped, gpus=1, hang_timeout=40).distributed()
        print(f"round {round_}: returned (wrong)")
    except DistributedHangError as e:
        text = str(e)
        line = next((ln for ln in text.splitlines() if ln.startswith("  rank 0: ")), "")
        ok = "STOPPED HERE" in line
        print(f"round {round_}: DistributedHangError after {time.monotonic() - t0:.1f} s; line names the stop: {ok}")
        print("   ", line)
