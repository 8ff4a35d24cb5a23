"""Which engine a workload gets: the local one (leasing its GPUs first) for one node here, Slurm or Ray for a cluster."""

from __future__ import annotations

import importlib
import os

from ..launch.engines.base import Engine
from ..launch.engines.local.engine import LocalEngine
from ..launch.leasing.leases import GpuRequest
from ..launch.proctree import RUN_ID_ENV
from .nodes import RAY_EXECUTOR_MODULE, ExecutorUnavailableError, needs_cluster
from .schema import WorkloadConfig

__all__ = ["create_executor", "check_executor_available", "local_engine"]


def local_engine(config: WorkloadConfig) -> LocalEngine:
    """The engine of a single-node workload: the local one, leasing the node's GPUs before each attempt.

    A GPU workload waits for ``compute.num_accelerators`` free GPUs like a call does: up to its
    ``timeout_minutes``, without a limit when it has none, and ``gpufleet cancel`` ends the wait
    (the supervisor's log says at once who holds them). Its command sees only the leased GPUs; the
    supervisor holds the lease until the attempt's processes are stopped, and the node command's
    processes inherit it.
    """
    c = config.compute
    run_id = os.environ.get(RUN_ID_ENV, "workload")
    if c.gpu_type is None:
        return LocalEngine(run_id, holder="workload")
    wait = config.timeout_minutes * 60 if config.timeout_minutes else None
    return LocalEngine(run_id, GpuRequest(count=c.per_node, wait_s=wait), holder="workload", report_after_s=0.0)


def create_executor(config: WorkloadConfig) -> Engine:
    """The engine of a workload: the local one for one node here, Slurm or Ray for a cluster."""
    if not needs_cluster(config):
        return local_engine(config)  # a GPU workload leases its GPUs first
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
