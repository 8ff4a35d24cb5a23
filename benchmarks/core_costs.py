"""Hidden costs of the rank-group core: crash to exception, and a trivial call, vs plain torchrun.

Two figures, each for gpufleet (through the public API only: ``distributed`` and ``runtime``)
and for the same job as a plain ``torchrun`` script, in the same run:

- Crash to exception. N ranks set up the process group and all-reduce once; then the last rank
  writes ``time.time()`` to a file and either raises (``raise``) or SIGKILLs itself (``kill``),
  while the other ranks wait in a second all-reduce. gpufleet: time from that stamp until the
  caller holds the exception. torchrun: time from that stamp until torchrun has exited.
- Trivial call. ``runtime.setup()``, one all-reduce, return the rank. gpufleet: the same caller
  (this process) calls the decorated function ``--rounds`` times, each call timed in-process;
  torchrun: each run is a whole ``torchrun`` process timed from outside (there is no
  in-process form). ``benchmarks/launch_latency.py`` gives the whole-process figure for both.

Launchers alternate within each round; one uncounted torchrun run first warms the page cache.
At the end the script checks that no process it started is left (it marks them through an
environment variable), and ends any it finds.

    python benchmarks/core_costs.py                 # 2 CPU workers (gloo), 3 rounds
    python benchmarks/core_costs.py --gpus 2        # NCCL on 2 GPUs
    python benchmarks/core_costs.py --gpus 2 --rounds 5 --json costs.json
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

MARK = "CORE_COSTS_MARK"  # set in every process this script starts, to find leftovers
CASES = ("trivial", "raise", "kill")


def _crash_now(mode: str, stamp: str) -> None:
    """Write the crash moment to ``stamp``, then raise or SIGKILL this process."""
    tmp = stamp + ".tmp"
    with open(tmp, "w") as f:
        f.write(repr(time.time()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, stamp)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("planned crash after process-group setup")


def gf_trivial() -> int:
    """gpufleet rank of the trivial call."""
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    device = runtime.setup()
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    assert t.item() == runtime.get_world_size()
    return runtime.get_global_rank()


def gf_crash(mode: str, stamp: str, crash_rank: int) -> int:
    """gpufleet rank of the crash case: group up, one all-reduce, then ``crash_rank`` crashes."""
    import torch
    import torch.distributed as dist

    from gpufleet import runtime

    device = runtime.setup()
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    t.item()  # every rank has joined the group
    if runtime.get_global_rank() == crash_rank:
        _crash_now(mode, stamp)
    dist.all_reduce(t)  # the others wait here for the crashed rank
    t.item()
    return runtime.get_global_rank()


PLAIN = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist

    def setup(backend):
        if backend == "nccl":
            dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", device_id=dev)
        else:
            dev = torch.device("cpu")
            dist.init_process_group("gloo")
        return dev

    def crash_now(mode, stamp):
        with open(stamp + ".tmp", "w") as f:
            f.write(repr(time.time()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(stamp + ".tmp", stamp)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("planned crash after process-group setup")

    if __name__ == "__main__":
        backend, case = sys.argv[1], sys.argv[2]
        dev = setup(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        if case == "trivial":
            assert t.item() == world
            dist.destroy_process_group()
        else:
            t.item()
            if rank == world - 1:
                crash_now(case, sys.argv[3])
            dist.all_reduce(t)
            t.item()
    """
)


def _torchrun_cmd(script: Path, n: int, *extra: str) -> list[str]:
    """torchrun of this interpreter (its console script, else ``-m torch.distributed.run``)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = (
        [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    return [
        *launcher,
        "--standalone",
        f"--nproc_per_node={n}",
        "--monitor_interval=0.1",
        str(script),
        *extra,
    ]


def _run_torchrun(cmd: list[str], timeout: float) -> tuple[int, float]:
    """Run torchrun in its own session; return (exit code, time.time() once it has exited)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return -999, time.time()
    end = time.time()
    if proc.returncode != 0:
        _run_torchrun.last_err = (err or "").strip().splitlines()[-3:]  # type: ignore[attr-defined]
    return proc.returncode, end


def _marked_processes(mark: str) -> list:
    import psutil

    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _leftovers(mark: str, wait_s: float) -> list[int]:
    """Processes started by this script that are still alive after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = _marked_processes(mark)
        if not alive or time.monotonic() > deadline:
            return [p.pid for p in alive]
        time.sleep(0.2)


def _stats(values: list[float]) -> tuple[float, float, float] | None:
    return (statistics.median(values), min(values), max(values)) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gpus", type=int, default=0, help="use NCCL on this many GPUs (0 = CPU workers, gloo)"
    )
    parser.add_argument("--workers", type=int, default=2, help="CPU workers when --gpus is 0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma list of {','.join(CASES)}")
    parser.add_argument(
        "--timeout", type=float, default=180, help="seconds allowed for one call or torchrun run"
    )
    parser.add_argument("--json", default="", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    if set(cases) - set(CASES):
        parser.error(f"unknown case(s) {sorted(set(cases) - set(CASES))}; choose from {CASES}")
    n = args.gpus or args.workers
    backend = "nccl" if args.gpus else "gloo"
    mark = uuid.uuid4().hex
    # every process started from here (gpufleet's ranks, torchrun and its workers) inherits these
    os.environ.update(
        {MARK: mark, "GPUFLEET_TRACKING": "0", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    )
    if not args.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    from gpufleet import distributed

    options = dict(
        gpus=n,
        gpu_type=None if args.gpus else "cpu",
        tracking=False,
        stream_logs=False,
        timeout=args.timeout,
    )
    trivial = distributed(**options)(gf_trivial)
    crash = distributed(**options)(gf_crash)

    tmp = Path(tempfile.mkdtemp(prefix="core-costs-"))
    script = tmp / "plain_core_costs.py"
    script.write_text(PLAIN)
    results: dict = {"workers": n, "backend": backend, "rounds": args.rounds, "cases": {}}
    notes: list[str] = []
    started = time.time()

    # uncounted warm-up: page cache for torch's imports, on both sides
    _run_torchrun(_torchrun_cmd(script, n, backend, "trivial"), args.timeout)

    if "trivial" in cases:
        gf_times, tr_times = [], []
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            out = trivial.distributed()
            gf_times.append(time.perf_counter() - t0)
            if out != list(range(n)):
                notes.append(f"trivial call {rnd + 1} returned {out!r}")
            t0 = time.perf_counter()
            code, _ = _run_torchrun(_torchrun_cmd(script, n, backend, "trivial"), args.timeout)
            if code == 0:
                tr_times.append(time.perf_counter() - t0)
            else:
                notes.append(
                    f"torchrun trivial run {rnd + 1} exited {code}: {getattr(_run_torchrun, 'last_err', '')}"
                )
            print(
                f"trivial round {rnd + 1}: gpufleet {gf_times[-1]:.2f} s, torchrun "
                f"{tr_times[-1] if code == 0 else float('nan'):.2f} s",
                flush=True,
            )
        results["cases"]["trivial"] = {"gpufleet": gf_times, "torchrun": tr_times}

    for mode in [c for c in cases if c != "trivial"]:
        gf_times, tr_times, gf_types, tr_codes = [], [], [], []
        for rnd in range(args.rounds):
            stamp = str(tmp / f"gf-{mode}-{rnd}.stamp")
            held = None
            try:
                crash.distributed(mode, stamp, n - 1)
            except Exception as e:  # noqa: BLE001 - the exception is the measurement
                held = time.time()
                gf_types.append(type(e).__name__)
            if held is None:
                notes.append(
                    f"gpufleet {mode} round {rnd + 1}: the call returned without an exception"
                )
            elif not os.path.exists(stamp):
                notes.append(f"gpufleet {mode} round {rnd + 1}: no crash stamp ({gf_types[-1]})")
            else:
                gf_times.append(held - float(Path(stamp).read_text()))
            stamp = str(tmp / f"tr-{mode}-{rnd}.stamp")
            code, ended = _run_torchrun(
                _torchrun_cmd(script, n, backend, mode, stamp), args.timeout
            )
            tr_codes.append(code)
            if code == 0 or not os.path.exists(stamp):
                notes.append(
                    f"torchrun {mode} round {rnd + 1}: exit {code}, stamp {'found' if os.path.exists(stamp) else 'missing'}"
                )
            else:
                tr_times.append(ended - float(Path(stamp).read_text()))
            print(
                f"{mode} round {rnd + 1}: gpufleet {gf_times[-1] if gf_times else float('nan'):.2f} s "
                f"({gf_types[-1] if gf_types else '-'}), torchrun {tr_times[-1] if tr_times else float('nan'):.2f} s "
                f"(exit {code})",
                flush=True,
            )
        results["cases"][mode] = {
            "gpufleet": gf_times,
            "torchrun": tr_times,
            "gpufleet_exceptions": gf_types,
            "torchrun_exit_codes": tr_codes,
        }

    left = _leftovers(mark, wait_s=15)
    results["leftover_pids"] = left
    for pid in left:  # processes this script started (marked), ended by id
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    results["notes"] = notes
    results["total_s"] = time.time() - started

    print(
        f"\n{n} ranks ({backend}), {args.rounds} rounds; median / min / max seconds; "
        "ratio = gpufleet median / torchrun median\n"
    )
    if "trivial" in results["cases"]:
        r = results["cases"]["trivial"]
        print(
            "Trivial call (runtime.setup(), one all-reduce, return the rank): gpufleet in-process, "
            "each call of one caller; torchrun a whole process each\n"
        )
        print("| launcher | each run s | median s | min s | max s | vs torchrun |")
        print("|---|---|---:|---:|---:|---:|")
        tr = _stats(r["torchrun"])
        for name in ("gpufleet", "torchrun"):
            s = _stats(r[name])
            each = ", ".join(f"{v:.2f}" for v in r[name])
            if s is None:
                print(f"| {name} | failed | | | | |")
                continue
            ratio = f"{s[0] / tr[0]:.2f}x" if tr else "-"
            print(f"| {name} | {each} | {s[0]:.2f} | {s[1]:.2f} | {s[2]:.2f} | {ratio} |")
        print()
    crash_modes = [m for m in ("raise", "kill") if m in results["cases"]]
    if crash_modes:
        print(
            "Crash to exception (gpufleet: crash stamp to the caller holding the exception; "
            "torchrun: crash stamp to torchrun's exit)\n"
        )
        print("| crash | launcher | median s | min s | max s | vs torchrun | outcome |")
        print("|---|---|---:|---:|---:|---:|---|")
        for mode in crash_modes:
            r = results["cases"][mode]
            tr = _stats(r["torchrun"])
            what = {"raise": "rank raises", "kill": "rank SIGKILLed"}[mode]
            for name in ("gpufleet", "torchrun"):
                s = _stats(r[name])
                outcome = (
                    ", ".join(sorted(set(r["gpufleet_exceptions"])))
                    if name == "gpufleet"
                    else "exit " + ", ".join(str(c) for c in sorted(set(r["torchrun_exit_codes"])))
                )
                if s is None:
                    print(f"| {what} | {name} | failed | | | | {outcome} |")
                    continue
                ratio = f"{s[0] / tr[0]:.2f}x" if tr else "-"
                print(
                    f"| {what} | {name} | {s[0]:.2f} | {s[1]:.2f} | {s[2]:.2f} | {ratio} | {outcome} |"
                )
        print()
    print(
        f"leftover processes: {len(left)}{' (ended: ' + ', '.join(map(str, left)) + ')' if left else ''}; "
        f"total {results['total_s']:.0f} s"
    )
    for note in notes:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    ok = (
        not notes
        and not left
        and all(
            results["cases"][c]["gpufleet"] and results["cases"][c]["torchrun"]
            for c in results["cases"]
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
