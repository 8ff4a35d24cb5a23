"""The hang watchdog with its default settings: how soon each fault is called a hang and where, and no false alarm.

python benchmarks/hang_matrix.py              # every case (about 12 minutes on 2 CPU cores)
python benchmarks/hang_matrix.py classic gil  # some cases
python benchmarks/hang_matrix.py --gpu        # two GPUs (NCCL) instead of two CPU ranks (gloo)

Two CPU ranks (gloo), steps of about 1 s (a sleep and an all-reduce, counted with
``runtime.report_step``). Fault cases: after step 8 one rank (or both) does the fault; the row
gives the seconds from the fault to the error in the caller and whether the diagnosis named the
rank, the collective or "own code", and the line. False-alarm cases must end normally.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from gpufleet import distributed, errors, runtime

STEPS_BEFORE = 8


def _mark(path: str) -> None:
    Path(path).write_text(str(time.time()))


def _steps(n: int, pause_s: float = 0.5) -> None:
    import torch
    import torch.distributed as dist

    for _ in range(n):
        time.sleep(pause_s)
        t = torch.ones(4, device=runtime.device())
        dist.all_reduce(t)
        t.sum().item()  # NCCL: wait for it, as a training step does
        runtime.report_step()


def _deadlock() -> None:
    import threading

    a, b = threading.Lock(), threading.Lock()

    def one() -> None:
        with a:
            time.sleep(0.5)
            with b:  # DEADLOCK-LINE
                pass

    def two() -> None:
        with b:
            time.sleep(0.5)
            with a:
                pass

    threads = [threading.Thread(target=one), threading.Thread(target=two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # FAULT-LINE deadlock


def scenario(case: str, marker: str, root: str) -> str:
    import signal

    import numpy as np
    import torch
    import torch.distributed as dist

    runtime.setup()
    rank = runtime.get_global_rank()
    if case == "warm-up 60 s":
        if rank == 0:
            time.sleep(60)  # a model load after setup, before the first step
        dist.barrier()
    _steps(STEPS_BEFORE)
    if rank == 1 and case != "mismatched":
        _mark(marker)
    if case == "classic":
        if rank == 1:
            time.sleep(3600)  # FAULT-LINE classic
    elif case == "gil":
        if rank == 1:
            import ctypes

            libc = ctypes.PyDLL(None)  # its calls keep the GIL
            while True:
                libc.sleep(3600)  # FAULT-LINE gil
    elif case == "sigstop":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # FAULT-LINE sigstop
    elif case == "thread deadlock":
        if rank == 1:
            _deadlock()
    elif case == "mismatched":
        _mark(marker)
        a, b = torch.ones(8, device=runtime.device()), torch.ones(3, device=runtime.device())
        if rank == 0:
            dist.all_reduce(a), a.sum().item()  # FAULT-LINE mismatched
        else:
            dist.broadcast(b, src=0), b.sum().item()
    elif case == "checkpoint save 45 s":
        from gpufleet.checkpoint import CheckpointManager

        class Slow:
            def state_dict(self) -> dict:
                if rank == 0:
                    time.sleep(45)
                return {"x": 1}

            def load_state_dict(self, state: dict) -> None:
                pass

        model = torch.nn.Linear(2, 2)
        CheckpointManager(root, model=model, stateful={"slow": Slow()}).save(STEPS_BEFORE)
    elif case == "marked eval 60 s":
        with runtime.section("eval"):
            if rank == 0:
                time.sleep(60)
            dist.barrier()
    elif case == "numpy 90 s on one rank":
        if rank == 1:
            t0, x = time.monotonic(), np.random.rand(300, 300)
            while time.monotonic() - t0 < 90:
                x = np.tanh(x @ x)
        dist.barrier()
    elif case == "steps slow down 5x":
        for i in range(30):
            _steps(1, 0.5 + 2.0 * i / 29)  # 0.5 s to 2.5 s
    elif case == "pause 20 s":
        if rank == 1:
            time.sleep(20)
    dist.barrier()
    _steps(3)
    return "ok"


FAULTS = {  # case: (rank blamed, what it is called, the marker of its line)
    "classic": (1, "missing from barrier #{n}", "FAULT-LINE classic"),
    "gil": (1, "holds the GIL", "FAULT-LINE gil"),
    "sigstop": (1, "stopped: SIGSTOP", "FAULT-LINE sigstop"),
    "thread deadlock": (1, "in its own code", "FAULT-LINE deadlock"),
    "mismatched": (None, "mismatched collectives", "FAULT-LINE mismatched"),
}
FALSE_ALARMS = ["warm-up 60 s", "checkpoint save 45 s", "marked eval 60 s", "numpy 90 s on one rank",
                "steps slow down 5x", "pause 20 s"]  # fmt: skip


def run(case: str, gpu: bool = False) -> tuple[str, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "fault-at")
        where = {} if gpu else {"gpu_type": "cpu"}
        fn = distributed(scenario, gpus=2, tracking=False, stream_logs=False, timeout=900, **where)
        started = time.time()
        try:
            fn.distributed(case, marker, os.path.join(tmp, "ckpt"))
        except errors.DistributedHangError as e:
            took = time.time() - float(Path(marker).read_text()) if os.path.exists(marker) else float("nan")
            text = str(e)
            if case not in FAULTS:
                return "FALSE ALARM", f"{took:.0f} s", text.splitlines()[0][:90]
            rank, called, line = FAULTS[case]
            called = called.format(n=STEPS_BEFORE + 1)
            blamed = rank is None or e.rank == rank
            right = blamed and called in text and line in text
            return f"hang after {took:.1f} s", "correct" if right else "WRONG", text.splitlines()[1][:110]
        except Exception as e:  # noqa: BLE001 - a row of the table
            return f"{type(e).__name__}", "WRONG", str(e).splitlines()[0][:90]
        return ("ended normally" if case in FALSE_ALARMS else "NOT DETECTED"), f"{time.time() - started:.0f} s", ""


if __name__ == "__main__":
    gpu = "--gpu" in sys.argv
    cases = [a for a in sys.argv[1:] if a != "--gpu"] or [*FAULTS, *FALSE_ALARMS]
    print(f"{'case':<24} {'outcome':<22} {'location/time':<14} first line of the diagnosis")
    for case in cases:
        outcome, verdict, line = run(case, gpu)
        print(f"{case:<24} {outcome:<22} {verdict:<14} {line}", flush=True)
