"""Which node executor a workload gets: local (leasing its GPUs first) for one node here, Slurm or Ray for a cluster."""

from __future__ import annotations

import importlib

from .leasing import local_executor
from .nodes import RAY_EXECUTOR_MODULE, ExecutorUnavailableError, NodeExecutor, needs_cluster
from .schema import WorkloadConfig

__all__ = ["create_executor", "check_executor_available"]


def create_executor(config: WorkloadConfig) -> NodeExecutor:
    """The executor for a workload: local for one node here, Ray for a cluster."""
    if not needs_cluster(config):
        return local_executor(config)  # a GPU workload leases its GPUs first
    if config.compute.cluster == "slurm":
        from .slurm_executor import create_executor as slurm_executor

        return slurm_executor(config)
    try:
        module = importlib.import_module(RAY_EXECUTOR_MODULE)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("gpufleet"):
            raise ExecutorUnavailableError(
                f"multi-node workloads need Ray ({e}); pip install 'gpufleet[ray]'"
            ) from e
        c = config.compute
        why = (
            f"names the cluster {c.cluster!r}"
            if c.cluster
            else f"needs {c.num_nodes} nodes ({c.num_accelerators} x {c.accelerator_type})"
        )
        raise ExecutorUnavailableError(
            f"this workload {why}, but this installation of gpufleet has no multi-node executor "
            f"({RAY_EXECUTOR_MODULE} is missing). Run it on one node: remove compute.cluster and "
            "set compute.num_accelerators to the per-node count of accelerator_type."
        ) from None
    return module.create_executor(config)


def check_executor_available(config: WorkloadConfig) -> None:
    """Raise :class:`ExecutorUnavailableError` early when the needed executor is missing."""
    if needs_cluster(config):
        create_executor(config).close()
