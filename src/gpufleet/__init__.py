"""gpufleet: run a PyTorch training function on every GPU of a machine or a Ray cluster.

``import gpufleet`` is light: torch, Ray, DeepSpeed and MLflow are imported only where used.
"""

from __future__ import annotations

from typing import Any

from . import errors, runtime
from .api import DistributedFunction, RunHandle, distributed
from .errors import (
    DistributedTimeoutError,
    GpufleetError,
    GPUUnavailableError,
    LaunchConfigError,
    PayloadPicklingError,
    RunCanceledError,
    WorkerExitError,
    WorkerGroupError,
    WorkerSignalError,
)

__version__ = "0.1.0"

__all__ = [
    "distributed",
    "ray_launch",
    "runtime",
    "errors",
    "DistributedFunction",
    "RunHandle",
    "GpufleetError",
    "LaunchConfigError",
    "GPUUnavailableError",
    "PayloadPicklingError",
    "WorkerGroupError",
    "WorkerSignalError",
    "WorkerExitError",
    "DistributedTimeoutError",
    "RunCanceledError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "ray_launch":
        from .launch.ray import ray_launch

        return ray_launch
    raise AttributeError(f"module 'gpufleet' has no attribute {name!r}")
