"""Compute processes on a GPU that no gpufleet lease holder started: they make the GPU busy "outside gpufleet".

NVML's running compute processes of each GPU, less this process and its descendants (its own
CUDA context in a notebook, its ranks). ``GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES=1`` ignores
them all; on fake GPUs (``GPUFLEET_FAKE_GPUS``) ``GPUFLEET_FAKE_GPU_PROCESSES="0=1234"`` says
that pid 1234 computes on GPU 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .gpus import FAKE_GPUS_ENV, GPUInfo

IGNORE_FOREIGN_ENV = "GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES"
#: Test override of NVML's process list on fake GPUs: ``"0=1234,1=5678"`` (GPU index = pid).
FAKE_PROCESSES_ENV = "GPUFLEET_FAKE_GPU_PROCESSES"


@dataclass(frozen=True)
class ForeignProcess:
    """A compute process on a GPU that is no gpufleet lease holder's (as NVML reports it)."""

    pid: int
    name: str = ""
    user: str = ""

    def describe(self) -> str:
        if not self.name:
            return f"pid {self.pid} (not visible from here) outside gpufleet"
        return f"pid {self.pid} ({self.name}, user {self.user or '?'}) outside gpufleet"


def _own_pids() -> set[int]:
    """This process and its descendants (its own CUDA context and its ranks are not foreign)."""
    pids = {os.getpid()}
    try:
        import psutil

        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    except Exception:  # noqa: BLE001
        pass
    return pids


def _describe_pid(pid: int) -> ForeignProcess:
    try:
        import psutil

        p = psutil.Process(pid)
        return ForeignProcess(pid, p.name(), p.username())
    except Exception:  # noqa: BLE001 - gone, another pid namespace, no access
        return ForeignProcess(pid)


def _nvml_processes(gpus: Sequence[GPUInfo]) -> dict[str, list[int]]:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return {}
    found: dict[str, list[int]] = {}
    try:
        for g in gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                found[g.uuid] = [int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except Exception:  # noqa: BLE001 - a GPU NVML cannot query counts as having none
                continue
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return found


def foreign_processes(gpus: Sequence[GPUInfo]) -> dict[str, tuple[ForeignProcess, ...]]:
    """Compute processes on each GPU (by uuid) that are not this process's or its children's."""
    if os.environ.get(IGNORE_FOREIGN_ENV, "").strip() in ("1", "true", "yes"):
        return {}
    if os.environ.get(FAKE_GPUS_ENV):
        by_index: dict[int, list[int]] = {}
        for item in os.environ.get(FAKE_PROCESSES_ENV, "").split(","):
            index, _, pid = item.partition("=")
            if index.strip().isdigit() and pid.strip().isdigit():
                by_index.setdefault(int(index), []).append(int(pid))
        pids_of = {g.uuid: by_index.get(g.index, []) for g in gpus}
    else:
        pids_of = _nvml_processes(gpus)
    if not any(pids_of.values()):
        return {}
    own = _own_pids() | _gpufleet_ranks({p for pids in pids_of.values() for p in pids})
    return {uuid: tuple(_describe_pid(p) for p in pids if p not in own) for uuid, pids in pids_of.items()
            if any(p not in own for p in pids)}  # fmt: skip


def _gpufleet_ranks(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are ranks of a gpufleet run (their GPU is leased by that run's holder, who is named)."""
    found = set()
    try:
        import psutil
    except ImportError:
        return found
    for pid in pids:
        with contextlib.suppress(Exception):  # gone, or another user's: then it counts as outside gpufleet
            if psutil.Process(pid).environ().get("GPUFLEET_RUN_ID"):
                found.add(pid)
    return found
