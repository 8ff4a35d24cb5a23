"""gpufleet: run a PyTorch training function on every GPU of a machine or a Ray cluster.

``import gpufleet`` is light: torch, Ray, DeepSpeed and MLflow are imported only where used.
"""

from __future__ import annotations

from typing import Any

from . import errors, runtime
from .api import DistributedFunction, distributed
from .errors import (
    DistributedHangError,
    DistributedTimeoutError,
    GpufleetError,
    GPUUnavailableError,
    LaunchConfigError,
    PayloadPicklingError,
    RunCanceledError,
    SchedulingTimeoutError,
    WorkerExitError,
    WorkerGroupError,
    WorkerSignalError,
)
from .handles import RunHandle, StoredRunHandle, run_handle

__version__ = "0.1.0"

# Public names loaded on first use, so that ``import gpufleet`` stays light.
_LAZY = {
    "ray_launch": "gpufleet.ray_launch",
    "prepare": "gpufleet.strategies",
    "plan": "gpufleet.strategies",
    "advise": "gpufleet.strategies",
    "PreparedModel": "gpufleet.strategies",
    "DDPConfig": "gpufleet.strategies",
    "FSDP2Config": "gpufleet.strategies",
    "DeepSpeedConfig": "gpufleet.strategies",
    "StrategyConfigError": "gpufleet.strategies",
    "CheckpointManager": "gpufleet.checkpoint",
    "CheckpointError": "gpufleet.checkpoint",
    "export_checkpoint": "gpufleet.checkpoint",
    "FileDataset": "gpufleet.data",
    "TimedDataLoader": "gpufleet.data",
    "start_tracked_run": "gpufleet.tracking",
    "shutdown_workers": "gpufleet.launch.engines.local.warm",
}

__all__ = [
    "distributed",
    "runtime",
    "errors",
    "DistributedFunction",
    "RunHandle",
    "StoredRunHandle",
    "run_handle",
    "GpufleetError",
    "LaunchConfigError",
    "GPUUnavailableError",
    "PayloadPicklingError",
    "WorkerGroupError",
    "WorkerSignalError",
    "WorkerExitError",
    "DistributedTimeoutError",
    "DistributedHangError",
    "RunCanceledError",
    "SchedulingTimeoutError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'gpufleet' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
