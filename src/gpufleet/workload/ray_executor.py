"""The Ray engine for CLI workloads: each node's command runs in a Ray actor on its own node.

The engine is the one that runs a call's ranks on Ray
(:class:`~gpufleet.launch.engines.ray.engine.RayEngine`): every attempt reserves one bundle per
node with a ``STRICT_SPREAD`` placement group (so each command runs on a different node), asks
node 0's actor for its address and a free port (``MASTER_ADDR``/``MASTER_PORT``), and starts
``bash -c COMMAND`` on each node with the per-node environment the supervisor built. What this
module adds is the workload's: the bundle from ``compute``, the code snapshot as the job's
``working_dir``, what a node keeps of its own environment, and the Ray driver. Output comes back into the run's
``node-N.log`` files; cancel stops each node's process tree; the placement group is released
at the next attempt and when the run ends.

The code snapshot travels as the Ray job's ``working_dir`` and a node that does not see the
run's environment builds it from ``environment.dependencies``; checkpoints under the run folder
still need storage that every node mounts, as with ``torchrun`` across machines.

A workload with ``compute.ray_driver`` runs its command once, as a Ray driver: one actor that holds
no resources runs it with ``RAY_ADDRESS`` set to the cluster, and the driver (Ray Train, Tune,
Data) places its own workers. The executor only waits until the cluster has the accelerators the
workload names, so a driver that could never be served fails with a clear error instead of
waiting forever.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from ..errors import LaunchConfigError
from ..launch.engines.base import Unit
from ..launch.engines.ray import engine as ray_engine
from ..launch.engines.ray.engine import RayEngine, RayProc
from ..launch.node import envcontract
from .schema import WorkloadConfig

__all__ = ["RayExecutor", "create_executor"]

#: Variables a node keeps from its own environment rather than the supervisor's.
_NODE_OWN = ("HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "HOSTNAME", "PWD", "OLDPWD", "PATH", "VIRTUAL_ENV")


def create_executor(config: WorkloadConfig) -> RayExecutor:
    """The engine of a workload that spans nodes or names ``compute.cluster``."""
    from ..launch.engines.ray.connect import import_ray

    import_ray()  # fail at submit time when Ray is missing
    address = config.compute.cluster or os.environ.get("RAY_ADDRESS")
    if not address:
        raise LaunchConfigError(
            f"this workload spans {config.compute.num_nodes} nodes and needs a Ray cluster: set "
            "compute.cluster (e.g. ray://head:10001) or RAY_ADDRESS"
        )
    return RayExecutor(config, address)


class RayExecutor(RayEngine):
    """The Ray engine with a workload's bundle, code snapshot, node environment and Ray driver."""

    def __init__(self, config: WorkloadConfig, address: str) -> None:
        c = config.compute
        bundle = {"CPU": float(c.per_node)} if c.gpu_type is None else {"GPU": float(c.per_node), "CPU": 1.0}
        super().__init__(address, os.environ.get(envcontract.RUN_ID, "workload"), node_bundle=bundle)
        self.config = config

    def _wait_for_capacity(self) -> None:
        """For a Ray driver: wait until the cluster has the workload's accelerators in all."""
        ray, c = self.ray, self.config.compute
        resource = "CPU" if c.gpu_type is None else "GPU"

        def ready() -> bool:
            if float(ray.cluster_resources().get(resource, 0.0)) >= c.num_accelerators:
                return True
            time.sleep(1.0)
            return False

        self.wait(ready, f"{c.num_accelerators} {resource}s", lambda alive: (
            f"the Ray cluster at {self.address} has {float(ray.cluster_resources().get(resource, 0.0)):g} "
            f"{resource}s in all ({alive} nodes alive); this workload's Ray driver needs {c.num_accelerators} "
            f"(compute.num_accelerators); waited {ray_engine.SCHEDULE_TIMEOUT_S:g} s"
        ))  # fmt: skip

    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        from ..launch.engines.ray.actor import SHIPPED_CODE_ENV

        self.release()
        job_env = None
        if code_dir and os.path.isdir(code_dir):
            # Ray copies the code snapshot to every node (the job's working_dir); a node without
            # the run folder (no shared storage) runs the command in that copy.
            job_env = {"runtime_env": {"working_dir": code_dir, "env_vars": {SHIPPED_CODE_ENV: "1"}}}
        ray = self.connect(job_env)
        if not self.config.compute.ray_driver:
            assert self.node_bundle is not None
            return self.place_nodes(num_nodes, self.node_bundle)
        self._wait_for_capacity()
        # the driver reserves nothing: its workers take the accelerators
        driver = self.spawn("node", 0, f"gpufleet-{self.run_id}-{int(time.time())}-driver", bundle=None, num_cpus=0)
        self.nodes = [ray.get(driver.node_info.remote())]
        return self.nodes[0]["ip"], ray.get(driver.free_port.remote())

    def start(self, unit: Unit, files: dict[str, bytes] | None = None) -> RayProc:
        # The node keeps its own home, shell and PATH; the supervisor's additions travel.
        env = {k: v for k, v in unit.env.items() if k not in _NODE_OWN}
        env[envcontract.SUPERVISOR_BIN] = unit.env.get("PATH", "").split(os.pathsep)[0]
        if self.config.environment.dependencies:  # a node that does not see the supervisor's bin builds its own
            env[envcontract.DEPENDENCIES] = json.dumps(self.config.environment.dependencies)
        shipped: dict[str, bytes] = dict(files or {})
        params = unit.env.get(envcontract.HYPERPARAMETERS_PATH)
        if params and os.path.exists(params):
            with open(params, "rb") as f:
                shipped[envcontract.HYPERPARAMETERS_PATH] = f.read()
        if self.config.compute.ray_driver:
            env["RAY_ADDRESS"] = self.nodes[unit.index]["gcs_address"]  # the driver joins this cluster
        return super().start(dataclasses.replace(unit, env=env), shipped)
