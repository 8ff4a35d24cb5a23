"""In each rank: how far it got (steps, the process group's collective count), and its stacks on demand.

The controller's hang watchdog reads what this module writes into the run folder:
``progress-R.json`` (rewritten every few seconds by a daemon thread: the step count, the
process group's sequence number, and the last collectives from torch's flight recorder where it
records them) and ``stacks-R.txt`` (every thread's stack, written by faulthandler when the
rank gets SIGUSR2, even while it is blocked inside a collective). Steps are counted where
gpufleet sees them (its data loader, ``prepare()``'s optimizer step, ``runtime.report_step``).
Importing this module imports nothing heavy; torch is only looked at once the rank imported it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Set for ranks whose progress the launcher watches: how often (seconds) a rank rewrites its
#: progress file in its run folder (``GPUFLEET_RUN_DIR``).
PROGRESS_INTERVAL_ENV = "GPUFLEET_PROGRESS_S"
STACKS_SIGNAL = signal.SIGUSR2

_lock = threading.Lock()
_batches = 0
_optimizer_steps = 0
_reported: int | None = None
_stack_file: Any = None
_started = False


def watchdog_env(hang_timeout_s: float | None) -> dict[str, str]:
    """What the ranks need for the hang watchdog: progress files often enough, and torch's flight recorder."""
    if hang_timeout_s is None:
        return {}
    interval = min(2.0, max(0.2, hang_timeout_s / 10))
    return {PROGRESS_INTERVAL_ENV: f"{interval:g}", "TORCH_FR_BUFFER_SIZE": "64"}  # torch's flight recorder


def step_count() -> int:
    """This rank's step: the highest of batches taken, optimizer steps and reported steps."""
    return max(_batches, _optimizer_steps, _reported or 0)


def _counted(before: int) -> None:
    step = step_count()
    if step != before:
        from .. import faults

        faults.on_step(step)


def note_batch() -> None:
    """A batch was taken from a gpufleet data loader."""
    global _batches
    before = step_count()
    _batches += 1
    _counted(before)


def note_optimizer_step() -> None:
    """An optimizer step went through ``prepare()``."""
    global _optimizer_steps
    before = step_count()
    _optimizer_steps += 1
    _counted(before)


def note_reported_step(step: int | None = None) -> None:
    """The user reported a step (``runtime.report_step``): the given number, or one more."""
    global _reported
    before = step_count()
    _reported = (step_count() + 1) if step is None else int(step)
    _counted(before)


def _collective_state() -> dict[str, Any]:
    """The default process group's sequence number and its last collectives, if torch has them."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return {}
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        group = dist.distributed_c10d._get_default_group()
        state: dict[str, Any] = {"seq": int(group._get_sequence_number_for_group())}
    except Exception:  # noqa: BLE001 - a backend without sequence numbers
        return {}
    if os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            import torch._C._distributed_c10d as c10d

            # NCCL's recorder (older torch keeps it apart), else the one of every backend
            dump = getattr(c10d, "_dump_nccl_trace_json", None) if group._get_backend_name() == "nccl" else None
            dump = dump or c10d._dump_fr_trace_json
            raw = json.loads(dump(True, True))
            state["collectives"] = [
                {
                    "op": str(e.get("profiling_name", "?")).split(":")[-1],
                    "seq": e.get("collective_seq_id"),
                    "state": e.get("state"),
                    "sizes": e.get("input_sizes"),
                }
                for e in raw.get("entries", [])[-4:]
            ]
        except Exception:  # noqa: BLE001 - the flight recorder is optional
            pass
    return state


def write_progress(path: Path) -> None:
    """Write this rank's progress file once (atomically)."""
    record = {"time": time.time(), "step": step_count(), **_collective_state()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", opener=_private) as f:  # 0600, as every file of the run folder
        f.write(json.dumps(record))
    os.replace(tmp, path)


def reset() -> None:
    """Start counting afresh (a warm worker's next call)."""
    global _batches, _optimizer_steps, _reported
    _batches, _optimizer_steps, _reported = 0, 0, None


def start(rank: int, stacks_dir: str | None = None) -> None:
    """In a rank: arm faults, and when the launcher watches progress, report it and take stack requests.

    The progress file goes to the run folder of the call in progress (``GPUFLEET_RUN_DIR``, read
    each time: a warm worker serves several calls); stack dumps go to ``stacks_dir`` (default: that
    run folder).
    """
    global _started
    if _started:
        return
    _started = True
    from .. import faults

    faults.arm(rank)
    folder = os.environ.get("GPUFLEET_RUN_DIR")
    if not folder or not os.environ.get(PROGRESS_INTERVAL_ENV):
        return
    global _stack_file
    _stack_file = open(Path(stacks_dir or folder) / f"stacks-{rank}.txt", "a", opener=_private)  # noqa: SIM115 - kept open
    faulthandler.register(STACKS_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    interval = float(os.environ.get(PROGRESS_INTERVAL_ENV, "2"))

    def loop() -> None:
        while True:
            try:
                write_progress(Path(os.environ["GPUFLEET_RUN_DIR"]) / f"progress-{rank}.json")
            except Exception:  # noqa: BLE001 - never disturb the rank
                pass
            time.sleep(interval)

    threading.Thread(target=loop, name="gpufleet-progress", daemon=True).start()


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def request_stacks(pid: int, stacks_file: Path, timeout_s: float = 3.0) -> str | None:
    """Have a rank (whose stack handler is in place) dump every thread's stack; the new text, or None.

    The rank's faulthandler appends to ``stacks_file`` on SIGUSR2, even while it is blocked in a
    collective; only what it wrote now is returned.
    """
    size = stacks_file.stat().st_size if stacks_file.exists() else 0
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stacks_file.exists() and stacks_file.stat().st_size > size:
            time.sleep(0.1)  # let faulthandler finish the dump
            with open(stacks_file, "rb") as f:
                f.seek(size)
                return f.read().decode("utf-8", "replace")
        time.sleep(0.05)
    return None


def read_progress(folder: Path, rank: int) -> dict[str, Any] | None:
    """A rank's last progress record, or None."""
    try:
        return json.loads((folder / f"progress-{rank}.json").read_text())
    except (OSError, ValueError):
        return None
