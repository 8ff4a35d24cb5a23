"""The fixed cost of a workload attempt, and of a tracked call, against the same job without gpufleet.

Workload: a 1-step job (2 ranks: process-group init, one all-reduce, exit) run three ways, each a
whole process timed from outside, interleaved per round:

- ``torchrun``: the workload's own torchrun command, run by hand with the environment a node gets
  (``OMP_NUM_THREADS`` as gpufleet sets it, ``PYTHONUNBUFFERED=1``);
- ``gpufleet``: ``gpufleet run -f workload.yaml --watch --no-tracking`` with that command;
- ``gpufleet+mlflow``: the same with tracking on (the default SQLite store, created beforehand).

Each rank stamps when the script starts and ends, so each launcher's time splits into *before*
(launch to the first rank's start), the script, and *after* (the last rank's end to the launcher's
exit). One uncounted round of each warms the page cache and the MLflow store.

Call: a fresh interpreter that imports gpufleet and makes one trivial ``@distributed`` call (2 CPU
ranks), timed from outside, with tracking on and off (``--calls`` rounds).

At the end the script checks that no process it started is left (they carry a marker in their
environment) and ends any it finds.

    python benchmarks/workload_overhead.py                     # 5 rounds
    python benchmarks/workload_overhead.py --rounds 9 --json overhead.json
    git worktree add /tmp/base HEAD~3 && python benchmarks/workload_overhead.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

MARK = "WORKLOAD_OVERHEAD_MARK"  # set in every process this script starts, to find leftovers

ONE_STEP = textwrap.dedent(
    """
    import os, time
    stamps = os.environ["STAMP_DIR"]
    rank = os.environ["RANK"]
    open(os.path.join(stamps, f"start-{rank}"), "w").write(repr(time.time()))
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    open(os.path.join(stamps, f"end-{rank}"), "w").write(repr(time.time()))
    """
)
COMMAND = (
    "torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=$LOCAL_WORLD_SIZE "
    "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT one_step.py"
)
TRIVIAL_CALL = textwrap.dedent(
    """
    from gpufleet import distributed

    @distributed(gpus=2, gpu_type="cpu")
    def trivial():
        import torch, torch.distributed as dist
        from gpufleet import runtime
        runtime.setup()
        dist.all_reduce(torch.ones(1))
        return runtime.get_global_rank()

    assert trivial.distributed() == [0, 1]
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stamps(folder: Path) -> tuple[float, float]:
    """(first rank's start, last rank's end) written by the job."""
    starts = [float((folder / f"start-{r}").read_text()) for r in range(2)]
    ends = [float((folder / f"end-{r}").read_text()) for r in range(2)]
    return min(starts), max(ends)


def _timed(argv: list[str], env: dict[str, str], cwd: Path, stamps: Path | None) -> dict[str, float]:
    if stamps is not None:
        shutil.rmtree(stamps, ignore_errors=True)
        stamps.mkdir()
    t0 = time.time()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    t1 = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    out = {"total": t1 - t0}
    if stamps is not None:
        start, end = _stamps(stamps)
        out.update(before=start - t0, job=end - start, after=t1 - end)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _with_baseline(env: dict[str, str], baseline: str) -> dict[str, str]:
    """``env`` running the gpufleet in the source folder ``baseline`` (its ``src``) instead of this one."""
    src = str(Path(baseline).resolve() / "src")
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)}


def run_workloads(
    rounds: int, work: Path, base_env: dict[str, str], baseline: str | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    (work / "one_step.py").write_text(ONE_STEP)
    (work / "workload.yaml").write_text(
        "experiment_name: workload-overhead\n"
        "compute: {accelerator_type: CPU_2, num_accelerators: 2}\n"
        "code_source: {root_path: ., include_paths: [one_step.py]}\n"
        f"command: {json.dumps(COMMAND)}\n"
    )
    stamps = work / "stamps"
    gf = [sys.executable, "-m", "gpufleet.cli", "run", "-f", "workload.yaml", "--watch"]
    env = {**base_env, "STAMP_DIR": str(stamps)}
    from gpufleet.launch.spec import default_threads

    plain_env = {**env, "NUM_NODES": "1", "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "PYTHONUNBUFFERED": "1", **default_threads(env, 2)}  # fmt: skip
    bin_dir = str(Path(sys.executable).parent)  # torchrun of this environment, as a node gets it
    plain_env["PATH"] = bin_dir + os.pathsep + plain_env.get("PATH", "")

    def plain() -> dict[str, float]:
        return _timed(["bash", "-c", COMMAND], {**plain_env, "MASTER_PORT": str(_free_port())}, work, stamps)

    cases = {
        "torchrun": plain,
        "gpufleet": lambda: _timed([*gf, "--no-tracking"], env, work, stamps),
        "gpufleet+mlflow": lambda: _timed(gf, env, work, stamps),
    }
    if baseline:
        old_env = _with_baseline(env, baseline)
        cases["baseline+mlflow"] = lambda: _timed(gf, old_env, work, stamps)
    for fn in cases.values():  # warm-up: page cache, the run store, the MLflow store
        fn()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for i in range(rounds):
        for name, fn in cases.items():
            samples[name].append(fn())
        print(f"round {i + 1}/{rounds}: " + ", ".join(f"{n} {s[-1]['total']:.2f} s" for n, s in samples.items()),
              flush=True)  # fmt: skip
    return {
        name: {part: _summary([s[part] for s in runs]) for part in ("total", "before", "job", "after")}
        for name, runs in samples.items()
    }


def run_retries(rounds: int, work: Path, base_env: dict[str, str]) -> dict[str, dict[str, float]]:
    """A workload whose first attempt fails at once: from the second attempt's start to its first rank.

    The supervisor has MLflow loaded by then (it attached the first attempt's run), so a retried
    attempt shows what tracking costs per attempt rather than per run.
    """
    from gpufleet.runs.store import RunStore

    (work / "one_step.py").write_text(ONE_STEP)
    retry = 'if [ "$GPUFLEET_ATTEMPT" = 1 ]; then exit 3; fi; ' + COMMAND
    (work / "retry.yaml").write_text(
        "experiment_name: workload-overhead-retry\n"
        "compute: {accelerator_type: CPU_2, num_accelerators: 2}\n"
        "code_source: {root_path: ., include_paths: [one_step.py]}\n"
        "max_retries: 1\n"
        f"command: {json.dumps(retry)}\n"
    )
    stamps = work / "stamps"
    env = {**base_env, "STAMP_DIR": str(stamps)}
    gf = [sys.executable, "-m", "gpufleet.cli", "run", "-f", "retry.yaml", "--watch"]
    cases = {"gpufleet, attempt 2": [*gf, "--no-tracking"], "gpufleet+mlflow, attempt 2": gf}
    store = RunStore(base_env["GPUFLEET_HOME"])

    def second_attempt(argv: list[str]) -> float:
        shutil.rmtree(stamps, ignore_errors=True)
        stamps.mkdir()
        done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        run = store.get(done.stdout.split()[0])
        assert [a.state for a in run.attempts] == ["FAILED", "SUCCESS"], run.attempts
        first_rank, _ = _stamps(stamps)
        return first_rank - run.attempts[1].started_at

    for argv in cases.values():  # warm-up
        second_attempt(argv)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, argv in cases.items():
            samples[name].append(second_attempt(argv))
    return {name: _summary(s) for name, s in samples.items()}


def run_calls(rounds: int, work: Path, base_env: dict[str, str], baseline: str | None = None) -> dict[str, dict[str, float]]:
    (work / "call.py").write_text(TRIVIAL_CALL)
    argv = [sys.executable, "call.py"]
    cases = {
        "call, untracked": {**base_env, "GPUFLEET_TRACKING": "0"},
        "call, tracked": base_env,
    }
    if baseline:
        cases["baseline, tracked"] = _with_baseline(base_env, baseline)
    for env in cases.values():
        _timed(argv, env, work, None)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, env in cases.items():
            samples[name].append(_timed(argv, env, work, None)["total"])
    return {name: _summary(s) for name, s in samples.items()}


def _leftovers(mark: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(MARK) == mark:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of the workload cases")
    parser.add_argument("--calls", type=int, default=5, help="timed rounds of the call cases")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--retries", action="store_true",
                        help="also time a second attempt (the first one fails at once): the cost per attempt")
    parser.add_argument("--baseline", help="a gpufleet source folder (a git worktree of another commit, say) "
                        "whose tracked cases run in the same rounds, for a before/after")  # fmt: skip
    args = parser.parse_args()

    mark = uuid.uuid4().hex
    work = Path(tempfile.mkdtemp(prefix="workload-overhead-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GPUFLEET_"))}
    env.update({MARK: mark, "GPUFLEET_HOME": str(work / "home")})
    try:
        workloads = run_workloads(args.rounds, work, env, args.baseline)
        calls = run_calls(args.calls, work, env, args.baseline)
        retries = run_retries(args.rounds, work, env) if args.retries else {}
    finally:
        left = _leftovers(mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(work, ignore_errors=True)
    base = workloads["torchrun"]["total"]["median"]
    print(f"\nworkload attempt, 1 step, 2 CPU ranks ({args.rounds} rounds; seconds, median [min-max]):")
    print(f"{'launcher':<16} {'total':>18} {'over torchrun':>14} {'ratio':>6} {'before':>7} {'job':>6} {'after':>6}")
    for name, parts in workloads.items():
        t = parts["total"]
        print(f"{name:<16} {t['median']:6.2f} [{t['min']:.2f}-{t['max']:.2f}] {t['median'] - base:+14.2f} "
              f"{t['median'] / base:5.2f}x {parts['before']['median']:7.2f} {parts['job']['median']:6.2f} "
              f"{parts['after']['median']:6.2f}")  # fmt: skip
    untracked = calls["call, untracked"]["median"]
    print(f"\ntrivial @distributed call in a fresh interpreter, 2 CPU ranks ({args.calls} rounds):")
    for name, s in calls.items():
        print(f"{name:<16} {s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}] {s['median'] - untracked:+6.2f}")
    if retries:
        before = workloads["torchrun"]["before"]["median"]
        print(f"\nsecond attempt of a workload whose first one failed, from the attempt's start to its first rank "
              f"({args.rounds} rounds; torchrun by hand: {before:.2f} s from launch to the first rank):")  # fmt: skip
        for name, s in retries.items():
            print(f"{name:<28} {s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}] {s['median'] - before:+6.2f}")
    print(f"\nprocesses left behind: {len(left)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workloads": workloads, "calls": calls, "retries": retries, "left": left},
                                              indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
