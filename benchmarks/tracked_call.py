"""What tracking adds to a short @distributed call, and a check that a tracked rank logs into its run.

First a check: one call whose ranks read ``MLFLOW_RUN_ID`` in their first line and log a metric
with plain ``mlflow.log_metric`` (from a CUDA tensor where there are GPUs); the run must hold it
and end FINISHED. Then a trivial call (process group, one all-reduce) in a fresh interpreter,
untracked and tracked (and, with ``--baseline``, tracked with another gpufleet source folder),
interleaved per round; each a whole process timed from outside.

    python benchmarks/tracked_call.py --gpus 1 --rounds 5
    python benchmarks/tracked_call.py --gpus 0 --baseline /tmp/base      # 2 CPU ranks
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECK = """
import os, sys
from gpufleet import distributed

GPUS = int(sys.argv[1])

@distributed(gpus=GPUS or 2, gpu_type=None if GPUS else "cpu")
def f():
    import os, torch, mlflow
    run_at_start = os.environ.get("MLFLOW_RUN_ID")
    x = torch.ones(1024, 1024, device="cuda" if GPUS else "cpu")
    if os.environ["RANK"] == "0":
        mlflow.log_metric("ones", float(x.sum()), step=0)
    return run_at_start

h = f.submit()
seen = h.result(timeout=300)
assert seen == [h.mlflow_run_id] * len(seen), (seen, h.mlflow_run_id)
import mlflow
run = mlflow.MlflowClient("sqlite:///" + os.environ["GPUFLEET_HOME"] + "/mlflow.db").get_run(h.mlflow_run_id)
assert run.data.metrics["ones"] == 1024 * 1024 and run.info.status == "FINISHED", run
print(f"check: {len(seen)} rank(s) saw MLflow run {h.mlflow_run_id} from their first line; metric logged; {run.info.status}")
"""

TRIVIAL = """
import sys
from gpufleet import distributed

GPUS = int(sys.argv[1])

@distributed(gpus=GPUS or 2, gpu_type=None if GPUS else "cpu")
def trivial():
    import torch, torch.distributed as dist
    from gpufleet import runtime
    runtime.setup()
    t = torch.ones(1, device="cuda" if GPUS else "cpu")
    dist.all_reduce(t)
    return float(t.item())

assert len(trivial.distributed()) == (GPUS or 2)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per call (0: 2 CPU ranks)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a gpufleet source folder whose tracked call runs in the same rounds")
    args = parser.parse_args()

    home = tempfile.mkdtemp(prefix="tracked-call-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLEET_"))}
    env["GPUFLEET_HOME"] = home
    try:
        done = subprocess.run([sys.executable, "-c", CHECK, str(args.gpus)], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        if done.returncode:
            sys.exit(f"the check failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        print(done.stdout.strip())
        _measure(args, env)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _measure(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Time the trivial call untracked, tracked (and with the baseline), interleaved per round."""

    cases = {"untracked": {**env, "GPUFLEET_TRACKING": "0"}, "tracked": env}
    if args.baseline:
        src = str(Path(args.baseline).resolve() / "src")
        cases["baseline, tracked"] = {**env, "PYTHONPATH": os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)}

    def timed(case_env: dict[str, str]) -> float:
        t = time.time()
        run = subprocess.run([sys.executable, "-c", TRIVIAL, str(args.gpus)], env=case_env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        if run.returncode:
            sys.exit(f"a call failed:\n{run.stderr[-3000:]}")
        return time.time() - t

    samples: dict[str, list[float]] = {name: [] for name in cases}
    for case_env in cases.values():  # warm-up: page cache, the MLflow store
        timed(case_env)
    for _ in range(args.rounds):
        for name, case_env in cases.items():
            samples[name].append(timed(case_env))
    what = f"{args.gpus} GPU(s)" if args.gpus else "2 CPU ranks"
    print(f"\ntrivial call, {what}, fresh interpreter ({args.rounds} rounds; seconds, median [min-max]):")
    base = statistics.median(samples["untracked"])
    for name, s in samples.items():
        m = statistics.median(s)
        print(f"{name:<18} {m:6.2f} [{min(s):.2f}-{max(s):.2f}] {m - base:+6.2f}")


if __name__ == "__main__":
    main()
