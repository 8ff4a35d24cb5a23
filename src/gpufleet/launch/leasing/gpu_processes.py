"""Compute processes on a GPU that no gpufleet lease holder started, and whether they make it busy.

NVML's running compute processes of each GPU, less the caller's own process tree (its own CUDA
context in a notebook, its parents of the same user, its ranks) and the ranks of gpufleet runs
(whose GPUs their run's lease names). What is left is "outside gpufleet", and such a process
makes its GPU busy only by what it does there: at least :data:`BUSY_MEMORY_MIB` MiB of GPU memory
(``GPUFLEET_FOREIGN_GPU_MEMORY_MIB``) or :data:`BUSY_UTIL_PERCENT` % of the GPU's compute
(``GPUFLEET_FOREIGN_GPU_UTIL_PERCENT``; NVML's per-process samples of the last seconds, else the
GPU's own utilisation). A bare CUDA context (a notebook that once put a tensor on the GPU: about
0.5 GiB, 0 %) is a neighbour: shown by ``gpufleet ps``, never waited for. A process whose use
NVML does not report counts as busy.

``GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES=1`` ignores them all; on fake GPUs (``GPUFLEET_FAKE_GPUS``)
``GPUFLEET_FAKE_GPU_PROCESSES="0=1234"`` says that pid 1234 computes on GPU 0 (its use unknown,
so busy) and ``"0=1234:512:0"`` that it holds 512 MiB there at 0 % utilisation.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import LaunchConfigError
from ..gpus import FAKE_GPUS_ENV, GPUInfo
from ..node import envcontract

#: A process outside gpufleet with at least this much GPU memory (MiB) makes its GPU busy
#: (a bare CUDA context of PyTorch is about 500 MiB; one that loaded cuDNN/cuBLAS kernels, up to ~1 GiB).
BUSY_MEMORY_MIB = 2048
#: ...and so does one that uses at least this share (%) of the GPU's compute.
BUSY_UTIL_PERCENT = 10
#: NVML's per-process utilisation samples of this many seconds back are read.
_UTIL_WINDOW_S = 3.0


def _threshold(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # nan too
        raise LaunchConfigError(f"{name} must be a number >= 0, got {raw!r}; unset it for the default {default:g}")
    return value


@dataclass(frozen=True)
class ForeignProcess:
    """A compute process on a GPU that is no gpufleet lease holder's, and what it uses there (None: unknown)."""

    pid: int
    name: str = ""
    user: str = ""
    memory_bytes: int | None = None
    util_percent: float | None = None

    @property
    def busy(self) -> bool:
        """Whether it makes its GPU busy: above either threshold, or its use cannot be read."""
        if self.memory_bytes is None and self.util_percent is None:
            return True
        if self.memory_bytes is not None and self.memory_bytes >= _threshold(envcontract.FOREIGN_GPU_MEMORY_MIB, BUSY_MEMORY_MIB) * 2**20:
            return True
        return self.util_percent is not None and self.util_percent >= _threshold(envcontract.FOREIGN_GPU_UTIL_PERCENT, BUSY_UTIL_PERCENT)

    def _use(self) -> str:
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 2**30:.1f} GiB")
        if self.util_percent is not None:
            parts.append(f"{self.util_percent:.0f} %")
        return ", ".join(parts)

    def describe(self) -> str:
        who = (f"pid {self.pid} ({self.name}, user {self.user or '?'})" if self.name
               else f"pid {self.pid} (not visible from here)")  # fmt: skip
        use = self._use()
        if self.busy:
            return f"{who} outside gpufleet" + (f" ({use})" if use else "")
        return f"{who} outside gpufleet, idle ({use}): beside it, not waited for"


@dataclass(frozen=True)
class _Seen:
    """What NVML (or the fake override) reports of one compute process on one GPU."""

    pid: int
    memory_bytes: int | None = None
    util_percent: float | None = None


def _own_pids() -> set[int]:
    """The caller's process tree: this process, its descendants (its ranks) and its parents of the same user.

    A notebook kernel's own CUDA context, or that of the kernel or shell that started this
    script, is the caller's, never a neighbour's.
    """
    pids = {os.getpid()}
    try:
        import psutil

        me = psutil.Process()
        pids.update(p.pid for p in me.children(recursive=True))
        uid = os.getuid()
        for parent in me.parents():
            with contextlib.suppress(psutil.Error):
                if parent.uids().real == uid and parent.pid != 1:
                    pids.add(parent.pid)
    except Exception:  # noqa: BLE001
        pass
    return pids


def _describe(seen: _Seen) -> ForeignProcess:
    try:
        import psutil

        p = psutil.Process(seen.pid)
        return ForeignProcess(seen.pid, p.name(), p.username(), seen.memory_bytes, seen.util_percent)
    except Exception:  # noqa: BLE001 - gone, another pid namespace, no access
        return ForeignProcess(seen.pid, memory_bytes=seen.memory_bytes, util_percent=seen.util_percent)


def _process_util(pynvml: object, handle: object) -> dict[int, float] | None:
    """Each pid's highest SM utilisation (%) in NVML's samples of the last seconds; None if NVML has none."""
    since = int((time.time() - _UTIL_WINDOW_S) * 1e6)
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not supported, or no sample (an idle GPU): NVML_ERROR_NOT_FOUND
        return None
    util: dict[int, float] = {}
    for s in samples:
        util[int(s.pid)] = max(util.get(int(s.pid), 0.0), float(s.smUtil))
    return util


def _nvml_processes(gpus: Sequence[GPUInfo]) -> dict[str, list[_Seen]]:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return {}
    found: dict[str, list[_Seen]] = {}
    try:
        for g in gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:  # noqa: BLE001 - a GPU NVML cannot query counts as having none
                continue
            if not procs:
                found[g.uuid] = []
                continue
            util = _process_util(pynvml, handle)
            device_util: float | None = None
            if util is None:  # no per-process samples: the GPU's own utilisation stands for each process
                with contextlib.suppress(Exception):
                    device_util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            seen = []
            for p in procs:
                mem = getattr(p, "usedGpuMemory", None)
                memory = int(mem) if isinstance(mem, int) and 0 <= mem < 2**63 else None  # NVML_VALUE_NOT_AVAILABLE
                seen.append(_Seen(int(p.pid), memory, util.get(int(p.pid), 0.0) if util is not None else device_util))
            found[g.uuid] = seen
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return found


def _fake_processes(gpus: Sequence[GPUInfo]) -> dict[str, list[_Seen]]:
    by_index: dict[int, list[_Seen]] = {}
    for item in os.environ.get(envcontract.FAKE_GPU_PROCESSES, "").split(","):
        index, _, rest = item.partition("=")
        pid, *use = rest.split(":")
        if not (index.strip().isdigit() and pid.strip().isdigit()):
            continue
        mib = float(use[0]) if use and use[0].strip() else None
        util = float(use[1]) if len(use) > 1 and use[1].strip() else None
        by_index.setdefault(int(index), []).append(
            _Seen(int(pid), None if mib is None else int(mib * 2**20), util))
    return {g.uuid: by_index.get(g.index, []) for g in gpus}


def foreign_processes(gpus: Sequence[GPUInfo]) -> dict[str, tuple[ForeignProcess, ...]]:
    """Compute processes on each GPU (by uuid) outside gpufleet: busy ones and idle neighbours (``.busy``)."""
    if os.environ.get(envcontract.IGNORE_FOREIGN_GPU_PROCESSES, "").strip() in ("1", "true", "yes"):
        return {}
    seen_of = _fake_processes(gpus) if os.environ.get(FAKE_GPUS_ENV) else _nvml_processes(gpus)
    if not any(seen_of.values()):
        return {}
    own = _own_pids() | _gpufleet_ranks({s.pid for seen in seen_of.values() for s in seen})
    found = {uuid: tuple(_describe(s) for s in seen if s.pid not in own) for uuid, seen in seen_of.items()}
    return {uuid: procs for uuid, procs in found.items() if procs}


def _gpufleet_ranks(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are ranks of a gpufleet run (their GPU is leased by that run's holder, who is named)."""
    found: set[int] = set()
    try:
        import psutil
    except ImportError:
        return found
    for pid in pids:
        with contextlib.suppress(Exception):  # gone, or another user's: then it counts as outside gpufleet
            if psutil.Process(pid).environ().get(envcontract.RUN_ID):
                found.add(pid)
    return found


def wait_off_gpus(pids: Sequence[int], gpus: Sequence[GPUInfo], timeout_s: float = 5.0) -> bool:
    """Wait until NVML lists none of ``pids`` on ``gpus`` (exited processes whose memory is being freed).

    True once they are off (at once on fake GPUs or without NVML); False after ``timeout_s``.
    """
    if not pids or not gpus or os.environ.get(FAKE_GPUS_ENV):
        return True
    wanted = set(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        listed = {s.pid for seen in _nvml_processes(gpus).values() for s in seen}
        if not listed & wanted:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
