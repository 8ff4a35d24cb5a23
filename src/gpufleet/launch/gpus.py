"""GPU discovery that never initialises CUDA in the calling process (NVML, then nvidia-smi)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass

from ..errors import GPUUnavailableError, LaunchConfigError
from .node import envcontract

logger = logging.getLogger(__name__)

CPU = "cpu"


@dataclass(frozen=True)
class GPUInfo:
    """One physical GPU as the driver reports it."""

    index: int
    name: str
    uuid: str
    memory_bytes: int


def _query_nvml() -> list[GPUInfo] | None:
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no library
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            gpus.append(
                GPUInfo(
                    i,
                    name.decode() if isinstance(name, bytes) else name,
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    int(mem),
                )
            )
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _query_nvidia_smi() -> list[GPUInfo] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            gpus.append(GPUInfo(int(parts[0]), parts[1], parts[2], int(float(parts[3])) << 20))
    return gpus


def _apply_visible_devices(gpus: list[GPUInfo]) -> list[GPUInfo]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    picked = []
    for token in (t.strip() for t in visible.split(",")):
        if not token:
            continue
        if token.isdigit():
            match = [g for g in gpus if g.index == int(token)]
        else:
            match = [g for g in gpus if g.uuid.startswith(token) or g.uuid == f"GPU-{token}"]
        if not match:
            break  # CUDA stops at the first invalid entry
        picked.append(match[0])
    return picked


#: Test override of discovery: ``GPUFLEET_FAKE_GPUS=N`` makes this machine have N fake GPUs
#: (named ``Fake GPU``, uuids ``GPU-fake-0000``...), leased like real ones; nothing touches CUDA.
FAKE_GPUS_ENV = envcontract.FAKE_GPUS


def fake_gpus() -> list[GPUInfo] | None:
    """The fake GPUs of ``$GPUFLEET_FAKE_GPUS`` (None when it is not set)."""
    value = os.environ.get(FAKE_GPUS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise LaunchConfigError(f"{FAKE_GPUS_ENV} must be a number of fake GPUs, got {value!r}")
    return [GPUInfo(i, "Fake GPU", f"GPU-fake-{i:04d}", 80 << 30) for i in range(int(value))]


def list_gpus() -> list[GPUInfo]:
    """GPUs visible to this process (respecting ``CUDA_VISIBLE_DEVICES``), without CUDA."""
    gpus = fake_gpus()
    if gpus is None:
        gpus = _query_nvml()
    if gpus is None:
        gpus = _query_nvidia_smi() or []
    return _apply_visible_devices(gpus)


def gpu_type_matches(gpu_type: str, name: str) -> bool:
    """Whether a short type such as ``H100`` or ``a10`` names the device ``name``.

    ``A10`` matches ``NVIDIA A10G`` but not ``NVIDIA A100-SXM4-80GB``.
    """
    pattern = rf"(?<![A-Za-z0-9]){re.escape(gpu_type.strip())}(?![0-9])"
    return re.search(pattern, name, flags=re.IGNORECASE) is not None


@dataclass(frozen=True)
class Placement:
    """Resolved placement of a local run: how many workers, on what."""

    num_workers: int
    use_gpus: bool
    gpu_indices: tuple[int, ...] = ()
    gpu_name: str = ""


def resolve_local(gpus: int | tuple[int, ...] | None, gpu_type: str | None) -> Placement:
    """Check ``gpus``/``gpu_type`` against this machine before anything starts.

    ``gpus`` is a count, None (every GPU) or a tuple of GPU indices (named GPUs, checked to be
    visible). Which GPUs a run gets is decided when it starts, by its lease
    (:mod:`gpufleet.launch.leasing.leases`).
    """
    named = gpus if isinstance(gpus, tuple) else None
    if named is not None and named and all(isinstance(i, int) and not isinstance(i, bool) for i in named):
        gpus = len(named)
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise LaunchConfigError(f"gpus must be a positive integer, a list of GPU indices or None, got {gpus!r}")
    if gpu_type is not None and (not isinstance(gpu_type, str) or not gpu_type.strip()):
        raise LaunchConfigError(
            f"gpu_type must be a GPU model such as 'H100' or 'cpu', got {gpu_type!r}"
        )
    if gpu_type is not None and gpu_type.strip().lower() == CPU:
        cores = os.cpu_count() or 1
        if gpus is None:
            gpus = max(1, min(cores, 2))
        if gpus > cores:
            warnings.warn(
                f"{gpus} CPU workers on a machine with {cores} cores: the workers share the cores, so the run is "
                f"slower than with {cores} (and collectives may time out under the load). Use gpus<={cores} "
                "for speed; more workers only make sense to test a larger world size.",
                RuntimeWarning, stacklevel=4,
            )
        if named is not None:
            raise LaunchConfigError("gpus as a list of GPU indices needs GPUs; with gpu_type='cpu' give a count")
        return Placement(num_workers=gpus, use_gpus=False)
    found = list_gpus()
    if not found:
        raise GPUUnavailableError(
            "no NVIDIA GPU is visible on this machine (NVML and nvidia-smi found none"
            + (f"; CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}" if "CUDA_VISIBLE_DEVICES" in os.environ else "")
            + "). Pass gpu_type='cpu' to run the same code on CPU worker processes with gloo."
        )
    if gpu_type is not None:
        names = sorted({g.name for g in found})
        if not all(gpu_type_matches(gpu_type, g.name) for g in found):
            raise GPUUnavailableError(
                f"gpu_type={gpu_type!r} was asked for, but this machine has {', '.join(names)}. "
                "Pass the type that is present, or gpu_type=None to accept any."
            )
    if gpus is None:
        gpus = len(found)
    if gpus > len(found):
        raise GPUUnavailableError(
            f"gpus={gpus} was asked for, but this machine has {len(found)} visible GPU(s) "
            f"({found[0].name}). Ask for at most {len(found)}, or run on a Ray cluster with "
            "remote=<address>."
        )
    chosen = found[:gpus]
    if named is not None:
        by_index = {g.index: g for g in found}
        missing = [i for i in named if i not in by_index]
        if missing:
            raise GPUUnavailableError(
                f"gpus={list(named)} names GPU(s) {', '.join(map(str, missing))}, which this process does not see "
                f"(visible: {', '.join(str(g.index) for g in found)})"
            )
        chosen = [by_index[i] for i in named]
    return Placement(
        num_workers=gpus,
        use_gpus=True,
        gpu_indices=tuple(g.index for g in chosen),
        gpu_name=chosen[0].name,
    )
