"""What the live view costs the ranks: step time of a 2-rank CPU training loop with and without it.

Each round runs the same call twice in fresh interpreters on a pseudo-terminal, in an
alternating order: once with the live status line on (the ranks then rewrite their progress records
every 0.5 s, rank 0 appends each ``log_metrics`` to its run folder, and the caller reads the run
folder 4 times a second), and once with ``live=False`` (progress records every 2 s, for the
hang watchdog). The step: a small MLP's forward and backward on 2 ranks, its gradients
all-reduced (gloo), ``runtime.report_step`` and ``log_metrics`` every step (the worst case).
The ranks time their own steps; the table gives the median and 90th percentile per rank-step.
Last, what the view adds in a rank, timed alone: one metrics line queued in the training loop
(a thread appends it to the run folder), and one progress record (written by a thread).

    python benchmarks/live_overhead.py --rounds 3 --steps 400
    python benchmarks/live_overhead.py --rounds 3 --steps 400 --off-progress-s 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys
from gpufleet import distributed, runtime
from gpufleet.tracking import log_metrics

live, steps, out, off_progress = sys.argv[1] == "on", int(sys.argv[2]), sys.argv[3], sys.argv[4]
env = {"GPUFLEET_PROGRESS_S": off_progress} if off_progress and not live else {}

@distributed(gpus=2, gpu_type="cpu", tracking=False, keep_warm=False, live=None if live else False, env=env)
def train(steps):
    import time
    import torch, torch.distributed as dist
    runtime.setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    runtime.set_total_steps(steps)
    times = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        runtime.report_step(step)
        log_metrics({"loss": loss.item()}, step=step)
        times.append(time.perf_counter() - t)
    return times[20:]  # the first steps warm up

per_rank = train.distributed(steps)
json.dump([t for times in per_rank for t in times], open(out, "w"))
"""


def run_child(script: Path, live: bool, steps: int, out: Path, off_progress: str = "") -> list[float]:
    """One call in a fresh interpreter on a pseudo-terminal (the status line needs one; both modes get one)."""
    env = {**os.environ, "TERM": "xterm-256color", "GPUFLEET_TRACKING": "0"}
    env.pop("GPUFLEET_LIVE", None)
    cmd = [sys.executable, str(script), "on" if live else "off", str(steps), str(out), off_progress]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"the {'live' if live else 'plain'} run failed with exit code {code}: {seen[-2000:]!r}")
    if (b"steps/s" in seen) != live:
        raise SystemExit(f"the live line {'did not show' if live else 'showed'} on the pseudo-terminal")
    return json.loads(out.read_text())


def rank_side_costs(calls: int = 20000) -> tuple[float, float]:
    """Microseconds per ``log_metrics`` line queued for the view (in the loop) and per progress record (a thread)."""
    import time

    from gpufleet.launch import progress
    from gpufleet.live import feed
    from gpufleet.live.feed import record_metrics

    with tempfile.TemporaryDirectory() as folder:
        os.environ["GPUFLEET_RUN_DIR"] = folder
        t = time.perf_counter()
        for step in range(calls):
            record_metrics({"loss": 0.5, "lr": 1e-3}, step, float)
        per_metrics = (time.perf_counter() - t) / calls
        feed.flush()
        path = Path(folder) / "progress-0.json"
        t = time.perf_counter()
        for _ in range(calls // 10):
            progress.write_progress(path)
        per_record = (time.perf_counter() - t) / (calls // 10)
        os.environ.pop("GPUFLEET_RUN_DIR")
    return per_metrics * 1e6, per_record * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--off-progress-s", default="", help="progress records this often without the view too "
                        "(the view's 0.5 s: what the ranks do differently, without the caller's side)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(CHILD)
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for live in ((False, True) if round_ % 2 == 0 else (True, False)):
                times[live] += run_child(script, live, args.steps, Path(tmp) / f"out-{round_}-{live}.json",
                                         args.off_progress_s)
    print(f"2 CPU ranks, {args.steps} steps x {args.rounds} rounds, {os.cpu_count()} cores")
    print(f"{'live view':<12}{'median ms':>12}{'p90 ms':>10}{'rank-steps':>12}")
    for live in (False, True):
        t = sorted(times[live])
        p90 = t[int(0.9 * (len(t) - 1))]
        print(f"{'on' if live else 'off':<12}{statistics.median(t) * 1e3:>12.3f}{p90 * 1e3:>10.3f}{len(t):>12}")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"difference of the medians: {(on - off) * 1e3:+.3f} ms ({(on / off - 1) * 100:+.1f} %)")
    metrics_us, record_us = rank_side_costs()
    print(f"in a rank: {metrics_us:.1f} us per log_metrics line queued for the view; {record_us:.1f} us per progress "
          f"record (every 0.5 s with the view, 2 s without: {record_us * 1.5 / 1e4:.4f} % of one core more)")


if __name__ == "__main__":
    main()
