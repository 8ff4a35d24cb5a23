"""The Slurm engine for CLI workloads (``compute.cluster: slurm``): each attempt is one Slurm job.

The engine is the one that runs a call's ranks on Slurm
(:class:`~gpufleet.launch.engines.slurm.engine.SlurmEngine`: the job, its nodes' exit files, the
lost-node rule, preemption and cancel); this module adds the workload's part: its ``compute``
(nodes, GPUs or CPUs per node, ``compute.slurm``'s options) and the node environment's threads.
The rest of the per-node contract is the one :class:`~gpufleet.workload.nodes.WorkloadNodeGroup`
builds for every engine; it reaches the job as ``sbatch``'s environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..launch.engines.slurm.engine import SlurmEngine
from ..launch.engines.slurm.job import SlurmOptions, require_slurm
from ..launch.node import envcontract
from .schema import WorkloadConfig

__all__ = ["SlurmExecutor", "create_executor", "options_of"]


def create_executor(config: WorkloadConfig) -> SlurmExecutor:
    """The engine of a workload with ``compute.cluster: slurm``."""
    require_slurm()
    return SlurmExecutor(config)


def options_of(config: WorkloadConfig) -> SlurmOptions:
    """The job's Slurm options from ``compute.slurm``."""
    s = config.compute.slurm
    if s is None:
        return SlurmOptions()
    return SlurmOptions(s.partition, s.account, s.qos, s.constraint, s.time, s.signal_before_s, tuple(s.sbatch_args))


class SlurmExecutor(SlurmEngine):
    """The Slurm engine with a workload's nodes, options and preemption (``compute.num_nodes`` nodes per job)."""

    def __init__(self, config: WorkloadConfig) -> None:
        c = config.compute
        super().__init__(options_of(config), os.environ.get(envcontract.RUN_ID, "run"), per_node=c.per_node,
                         use_gpus=c.gpu_type is not None, preemptible=True)  # fmt: skip
        self.config = config

    def node_job_env(self, env: dict[str, str], folder: Path) -> dict[str, str]:
        env = super().node_job_env(env, folder)
        if "OMP_NUM_THREADS" not in self.config.env_strings() and "OMP_NUM_THREADS" not in os.environ:
            env.pop("OMP_NUM_THREADS", None)  # from this machine's cores: each node sets its own
        return env
