"""GPU lease hand-off: from the holder's last rank gone to the waiting caller's ranks starting.

Two separate caller processes, each ``distributed(f, gpus=1, keep_warm=False)`` on the same GPU:
A's function sleeps; B is started once A's rank runs, waits for the GPU and gets it when A's rank
has exited. Watched from outside (psutil, lock-file sizes, every millisecond):

- ``rank gone``: A's rank process has exited (a zombie or gone);
- ``released``: A's lock file is emptied (the lease's release truncates it before the unlock);
- ``taken``: B has written itself into the lock file;
- ``B's ranks``: B's first rank process exists (a child of B's caller).

The hand-off is ``B's ranks - rank gone``. With ``--kill`` A's caller is SIGKILLed once B waits
(its rank then sees its caller gone and exits within half a second): the lease must still pass
only after the rank is gone, so every time in the table is positive. On CPU it runs on fake GPUs (``GPUFLEET_FAKE_GPUS=1``,
the test override of discovery: the same lease code as real GPUs); ``--gpu`` uses GPU 0 of this
machine (the function then puts a tensor on it, so that the driver has memory to free).

    python benchmarks/lease_handoff.py --rounds 5
    python benchmarks/lease_handoff.py --gpu --rounds 3
    python benchmarks/lease_handoff.py --kill --rounds 5     # the holder's caller SIGKILLed

Run it against another checkout by pointing ``PYTHONPATH`` at that checkout's ``src``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CALLER = textwrap.dedent(
    """
    import json, os, sys
    from gpufleet import distributed

    def work(pid_file, seconds, gpu):
        import os, time
        if gpu:
            import torch
            x = torch.ones(256 << 20, device="cuda")  # 1 GiB for the driver to free at exit
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        time.sleep(seconds)
        return os.getpid()

    pid_file, seconds, gpu = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
    f = distributed(work, gpus=1, gpu_wait=300, tracking=False, stream_logs=False, keep_warm=False)
    print(json.dumps(f.distributed(pid_file, seconds, gpu)), flush=True)
    """
)


def _wait_file(path: Path, proc: subprocess.Popen[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no rank started: {proc.communicate()}")
        time.sleep(0.005)
    return int(path.read_text())


def one_round(folder: Path, env: dict[str, str], gpu: bool, hold_s: float, kill: bool = False) -> dict[str, float]:
    import psutil

    script = folder / "caller.py"
    script.write_text(CALLER)
    leases = Path(env["GPUFLEET_LEASE_DIR"])
    pid_a, pid_b = folder / f"a-{time.monotonic_ns()}", folder / f"b-{time.monotonic_ns()}"
    a = subprocess.Popen([sys.executable, str(script), str(pid_a), str(hold_s), "1" if gpu else "0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    rank_a = psutil.Process(_wait_file(pid_a, a, 120))
    b = subprocess.Popen([sys.executable, str(script), str(pid_b), "0", "1" if gpu else "0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    caller_b = psutil.Process(b.pid)
    lock = next(leases.glob("gpu-*.lock"))
    t: dict[str, float] = {}
    if kill:
        assert b.stderr is not None
        b.stderr.readline()  # "... waits for 1 GPU ...": B waits
        a.kill()
    deadline = time.monotonic() + hold_s + 120
    while not ("ranks" in t and "gone" in t) and time.monotonic() < deadline:
        now = time.monotonic()
        if "gone" not in t:
            try:
                if rank_a.status() == psutil.STATUS_ZOMBIE:
                    t["gone"] = now
            except psutil.NoSuchProcess:
                t["gone"] = now
        try:
            holder_pid = json.loads(lock.read_bytes() or b"{}").get("pid")
        except ValueError:  # being written
            holder_pid = -1
        if holder_pid != a.pid and holder_pid != -1 and "released" not in t:
            t["released"] = now  # empty, or already B's
        if holder_pid == b.pid and "taken" not in t:
            t["taken"] = now
        try:
            if "ranks" not in t and caller_b.children():
                t["ranks"] = now
        except psutil.NoSuchProcess:
            break
        time.sleep(0.001)
    for p in (a, b):
        out, err = p.communicate(timeout=120)
        if p.returncode != 0 and not (kill and p is a):
            raise RuntimeError(f"a caller failed: {out}{err}")
    if "ranks" not in t:
        raise RuntimeError(f"B's ranks were not seen to start: {t}")
    gone = t["gone"]
    return {k: v - gone for k, v in t.items() if k != "gone"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="GPU 0 of this machine instead of a fake GPU")
    parser.add_argument("--hold", type=float, default=4.0, help="seconds A's function holds the GPU")
    parser.add_argument("--kill", action="store_true", help="SIGKILL A's caller once B waits, instead of A's function returning")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpufleet-handoff-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "GPUFLEET_HOME": str(folder / "home"), "GPUFLEET_LEASE_DIR": str(folder / "leases"),
               "GPUFLEET_TRACKING": "0"}  # fmt: skip
        if args.gpu:
            env.pop("GPUFLEET_FAKE_GPUS", None)
            env["CUDA_VISIBLE_DEVICES"] = "0"
        else:
            env["GPUFLEET_FAKE_GPUS"] = "1"
            env.pop("CUDA_VISIBLE_DEVICES", None)
        for i in range(args.rounds):
            rows.append(one_round(folder, env, args.gpu, 60.0 if args.kill else args.hold, args.kill))
            print(f"round {i + 1}: " + json.dumps({k: round(v, 3) for k, v in rows[-1].items()}), file=sys.stderr)
    print(f"\nlease hand-off, {'GPU 0' if args.gpu else 'a fake GPU'}, {args.rounds} rounds"
          f"{', the holder SIGKILLed' if args.kill else ''} "
          "(seconds after the holder's last rank was gone)\n")  # fmt: skip
    print("| step | median s | min s | max s |\n|---|---:|---:|---:|")
    for key, label in (("released", "holder's lease released"), ("taken", "waiter holds the lease"),
                       ("ranks", "waiter's first rank started (hand-off)")):  # fmt: skip
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"| {label} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
