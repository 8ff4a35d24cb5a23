"""In each rank: how far it got (steps, the process group's collective count), and its stacks on demand.

The controller's hang watchdog reads what this module writes into the run folder:
``progress-R.json`` (rewritten every few seconds by a daemon thread: the step count, the
process group's sequence number, and the last collectives from torch's flight recorder where it
records them; also the rank's pid, its CPU seconds, its process group's backend, its GPU's
utilisation where NVML reads it, and the long sections it is in, :func:`section`) and ``stacks-R.txt`` (every thread's stack, written by faulthandler when the
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

from .node import envcontract

#: Set for ranks whose progress the launcher watches: how often (seconds) a rank rewrites its
#: progress file in its run folder (``GPUFLEET_RUN_DIR``).
PROGRESS_INTERVAL_ENV = envcontract.PROGRESS_S
STACKS_SIGNAL = signal.SIGUSR2

_lock = threading.Lock()
_batches = 0
_optimizer_steps = 0
_reported: int | None = None
_total: int | None = None
_stack_file: Any = None
_started = False
_sections: list[dict[str, Any]] = []
_progress_path: Path | None = None


def watchdog_env(hang_timeout_s: float | None) -> dict[str, str]:
    """What the ranks need for the hang watchdog: progress files often enough, and torch's flight recorder."""
    if hang_timeout_s is None:
        return {}
    interval = min(1.0, max(0.2, hang_timeout_s / 10))
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


def set_total_steps(total: int | None) -> None:
    """The number of steps this rank's loop will make (``runtime.set_total_steps``): the live view's ETA."""
    global _total
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total <= 0):
        raise ValueError(f"the total number of steps must be a positive integer or None, got {total!r}")
    _total = total


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
        state["backend"] = str(group._get_backend_name())
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


def _gpu_util() -> int | None:
    """This rank's GPU utilisation (percent, NVML) once the rank uses CUDA; None where unknown."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.utilization(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - no NVML: unknown
        return None


def write_progress(path: Path) -> None:
    """Write this rank's progress file once (atomically)."""
    with _lock:
        sections = [dict(s) for s in _sections]
    record: dict[str, Any] = {"time": time.time(), "step": step_count(), **_collective_state(),
                              "pid": os.getpid(), "cpu_s": round(time.process_time(), 3), "sections": sections}  # fmt: skip
    gpu = _gpu_util()
    if gpu is not None:
        record["gpu_util"] = gpu
    if _total is not None:
        record["total"] = _total
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # the thread and flush()
    with open(tmp, "w", opener=_private) as f:  # 0600, as every file of the run folder
        f.write(json.dumps(record))
    os.replace(tmp, path)


def reset() -> None:
    """Start counting afresh (a warm worker's next call)."""
    global _batches, _optimizer_steps, _reported
    _batches, _optimizer_steps, _reported = 0, 0, None
    with _lock:
        _sections.clear()


def _write_now() -> None:
    """Rewrite the progress file at once (a section began or ended), where progress is watched."""
    folder = os.environ.get(envcontract.RUN_DIR)
    if _progress_path is None or not folder:
        return
    try:
        write_progress(Path(folder) / _progress_path.name)
    except Exception:  # noqa: BLE001 - never disturb the rank
        pass


def enter_section(name: str, limit_s: float | None = None) -> dict[str, Any]:
    """This rank begins a long section (the hang watchdog's fast path is off while any rank is in one)."""
    entry = {"name": str(name), "since": time.time(), "limit_s": limit_s}
    with _lock:
        _sections.append(entry)
    _write_now()
    return entry


def leave_section(entry: dict[str, Any]) -> None:
    """The section begun with :func:`enter_section` ended."""
    with _lock:
        if entry in _sections:
            _sections.remove(entry)
    _write_now()


class section:  # noqa: N801 - used as a context manager, like contextlib's
    """``with section("eval"): ...``: a long phase the hang watchdog never takes for a hang (see runtime.section)."""

    def __init__(self, name: str, limit_s: float | None = None) -> None:
        if limit_s is not None and (isinstance(limit_s, bool) or not isinstance(limit_s, (int, float))
                                    or not limit_s > 0):  # fmt: skip
            raise ValueError(f"a section's limit_s must be a positive number of seconds or None, got {limit_s!r}")
        self.name, self.limit_s = name, limit_s
        self._entry: dict[str, Any] | None = None

    def __enter__(self) -> section:
        self._entry = enter_section(self.name, self.limit_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._entry is not None:
            leave_section(self._entry)
            self._entry = None


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
    folder = os.environ.get(envcontract.RUN_DIR)
    if not folder or not os.environ.get(PROGRESS_INTERVAL_ENV):
        return
    global _stack_file, _progress_path
    _progress_path = Path(f"progress-{rank}.json")
    _stack_file = open(Path(stacks_dir or folder) / f"stacks-{rank}.txt", "a", opener=_private)  # noqa: SIM115 - kept open
    faulthandler.register(STACKS_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    interval = float(os.environ.get(PROGRESS_INTERVAL_ENV, "2"))

    def loop() -> None:
        while True:
            try:
                write_progress(Path(os.environ[envcontract.RUN_DIR]) / f"progress-{rank}.json")
            except Exception:  # noqa: BLE001 - never disturb the rank
                pass
            time.sleep(interval)

    threading.Thread(target=loop, name="gpufleet-progress", daemon=True).start()


def flush(rank: int) -> None:
    """Write this rank's progress record now (its last step, as the call ends), if progress is watched."""
    folder = os.environ.get(envcontract.RUN_DIR)
    if _started and folder and os.environ.get(PROGRESS_INTERVAL_ENV):
        try:
            write_progress(Path(folder) / f"progress-{rank}.json")
        except Exception:  # noqa: BLE001 - never disturb the rank
            pass


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the first thread of process ``pid`` (its main thread, where the user's code runs).

    A signal sent to the whole process is taken by any of its threads. For a process stopped by
    SIGSTOP, that is whichever thread the kernel wakes first on SIGCONT: the dump is then written
    while the main thread already runs on, and shows a line past the one it was stopped at. A
    signal pending on the main thread runs its handler before that thread runs a single Python line
    more. Raises ProcessLookupError when the process is gone.
    """
    import ctypes

    try:
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill  # glibc 2.30 and later
    except AttributeError:
        os.kill(pid, sig)
        return
    if tgkill(pid, pid, sig) != 0:
        os.kill(pid, sig)  # its main thread has exited while others run on: the process takes it


def request_stacks(pid: int, stacks_file: Path, timeout_s: float = 3.0) -> str | None:
    """Have a rank (whose stack handler is in place) dump every thread's stack; the new text, or None.

    The rank's faulthandler appends to ``stacks_file`` on SIGUSR2, even while it is blocked in a
    collective; only what it wrote now is returned.
    """
    size = stacks_file.stat().st_size if stacks_file.exists() else 0
    try:
        signal_main_thread(pid, STACKS_SIGNAL)
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
