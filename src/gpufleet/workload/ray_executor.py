"""Ray executor for CLI workloads: each node's command runs in a Ray actor on its own node.

Every attempt reserves one bundle per node with a ``STRICT_SPREAD`` placement group (so each
command runs on a different node), asks node 0's actor for its address and a free port
(``MASTER_ADDR``/``MASTER_PORT``), and starts ``bash -c COMMAND`` on each node with the
per-node environment the supervisor built. Output comes back into the run's
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

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import LaunchConfigError, SchedulingTimeoutError
from ..launch.engines.base import GRACE_PERIOD_S, Engine, Proc, Unit
from ..launch.group import GroupStartCanceled
from ..launch.node.envs import DEPENDENCIES_ENV
from .schema import WorkloadConfig

logger = logging.getLogger(__name__)

__all__ = ["RayExecutor", "create_executor"]

_SCHEDULE_TIMEOUT_S = 600.0
#: Exit code reported for a node whose actor or Ray node was lost (as for SIGKILL).
LOST_EXIT_CODE = 137
#: Variables a node keeps from its own environment rather than the supervisor's.
_NODE_OWN = ("HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "HOSTNAME", "PWD", "OLDPWD", "PATH", "VIRTUAL_ENV")


def create_executor(config: WorkloadConfig) -> RayExecutor:
    """The executor of a workload that spans nodes or names ``compute.cluster``."""
    from ..launch.engines.ray.connect import import_ray

    import_ray()  # fail at submit time when Ray is missing
    address = config.compute.cluster or os.environ.get("RAY_ADDRESS")
    if not address:
        raise LaunchConfigError(
            f"this workload spans {config.compute.num_nodes} nodes and needs a Ray cluster: set "
            "compute.cluster (e.g. ray://head:10001) or RAY_ADDRESS"
        )
    return RayExecutor(config, address)


class RayNodeProcess(Proc):
    """One node's command, running in a :class:`~gpufleet.launch.engines.ray.actor.NodeCommand`."""

    def __init__(self, ray: Any, actor: Any, spec: Unit, node: dict[str, Any]) -> None:
        self.index = spec.index
        self._ray = ray
        self._actor = actor
        self._spec = spec
        self._node = node
        self._log = open(spec.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in cleanup()
        self._pending: Any = None
        self._code: int | None = None
        self.pid = 0

    def _write(self, report: dict[str, Any]) -> None:
        if self._log.closed:
            return
        if report.get("dropped"):
            self._log.write(f"[gpufleet: {report['dropped']} lines of output were dropped]\n".encode())
        for _, line in report["lines"]:
            self._log.write(line)

    def _lost(self, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if not self._log.closed:
            self._log.write(
                f"gpufleet: node {self.index} ({self._node.get('ip')}) was lost: "
                f"{type(error).__name__}: {first[:300]}\n".encode()
            )
        self._code = LOST_EXIT_CODE

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ray = self._ray
        if self._pending is None:
            self._pending = self._actor.poll.remote(0.0)
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as e:
            self._lost(e)
            return self._code
        self._write(report)
        self._code = report["exit_code"]
        return self._code

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        if self._code is not None:
            return
        ray = self._ray
        try:
            report = ray.get(self._actor.stop.remote(grace_period_s), timeout=grace_period_s + 15.0)
        except (ray.exceptions.RayError, TimeoutError) as e:  # GetTimeoutError is a TimeoutError
            self._lost(e)
            return
        self._write(report)
        self._code = report["exit_code"]

    def cleanup(self) -> None:
        ray = self._ray
        if self._code is None:
            self.cancel(1.0)
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._log.close()

    def describe(self) -> dict[str, Any]:
        return {
            "node_rank": self.index,
            "host": self._node.get("hostname") or self._node.get("ip"),
            "ip": self._node.get("ip"),
            "ray_node_id": self._node.get("node_id"),
            "pid": self.pid,
            "log_path": self._spec.log_path,
        }


class RayExecutor(Engine):
    """Starts each node's command of an attempt in an actor pinned to a bundle of its own."""

    def __init__(self, config: WorkloadConfig, address: str) -> None:
        self.config = config
        self.address = address
        self._ray: Any = None
        self._pg: Any = None
        self._actors: list[Any] = []
        self._nodes: list[dict[str, Any]] = []
        self._run_id = os.environ.get("GPUFLEET_RUN_ID", "workload")

    def _bundle(self) -> dict[str, float]:
        c = self.config.compute
        if c.gpu_type is None:
            return {"CPU": float(c.per_node)}
        return {"GPU": float(c.per_node), "CPU": 1.0}

    def _wait(self, ready: Callable[[], bool], what: str, failure: Callable[[int], str]) -> None:
        """Wait until ``ready()`` (which blocks about a second when not) for up to 10 minutes.

        A cancel raises :class:`~gpufleet.launch.group.GroupStartCanceled`; the time limit raises
        :class:`~gpufleet.errors.SchedulingTimeoutError` with ``failure(nodes alive)``.
        """
        deadline = time.monotonic() + _SCHEDULE_TIMEOUT_S
        while not ready():
            if self.canceled():
                raise GroupStartCanceled(f"while waiting for {what} on the Ray cluster")
            if time.monotonic() > deadline:
                raise SchedulingTimeoutError(failure(sum(1 for n in self._ray.nodes() if n["Alive"])))

    def _wait_for_capacity(self) -> None:
        """For a Ray driver: wait until the cluster has the workload's accelerators in all."""
        ray, c = self._ray, self.config.compute
        resource = "CPU" if c.gpu_type is None else "GPU"

        def ready() -> bool:
            if float(ray.cluster_resources().get(resource, 0.0)) >= c.num_accelerators:
                return True
            time.sleep(1.0)
            return False

        self._wait(ready, f"{c.num_accelerators} {resource}s", lambda alive: (
            f"the Ray cluster at {self.address} has {float(ray.cluster_resources().get(resource, 0.0)):g} "
            f"{resource}s in all ({alive} nodes alive); this workload's Ray driver needs {c.num_accelerators} "
            f"(compute.num_accelerators); waited {_SCHEDULE_TIMEOUT_S:g} s"
        ))  # fmt: skip

    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..launch.engines.ray.actor import SHIPPED_CODE_ENV, NodeCommand
        from ..launch.engines.ray.connect import connect

        self._release()
        job_env = None
        if code_dir and os.path.isdir(code_dir):
            # Ray copies the code snapshot to every node (the job's working_dir); a node without
            # the run folder (no shared storage) runs the command in that copy.
            job_env = {"runtime_env": {"working_dir": code_dir, "env_vars": {SHIPPED_CODE_ENV: "1"}}}
        ray = self._ray = connect(self.address, job_env)
        if self.config.compute.ray_driver:
            self._wait_for_capacity()
            driver = ray.remote(NodeCommand).options(
                num_cpus=0,  # the driver reserves nothing: its workers take the accelerators
                max_restarts=0,
                max_concurrency=4,
                name=f"gpufleet-{self._run_id}-{int(time.time())}-driver",
                runtime_env={"env_vars": {"GPUFLEET_RUN_ID": self._run_id}},
            ).remote(self._run_id, 0)
            self._actors = [driver]
            self._nodes = [ray.get(driver.node_info.remote())]
            return self._nodes[0]["ip"], ray.get(driver.free_port.remote())
        self._pg = placement_group([self._bundle() for _ in range(num_nodes)], strategy="STRICT_SPREAD")
        ready_ref = self._pg.ready()
        self._wait(lambda: bool(ray.wait([ready_ref], timeout=1.0)[0]), f"{num_nodes} nodes of {self._bundle()}",
                   lambda alive: f"the Ray cluster at {self.address} could not give {num_nodes} nodes "
                                 f"{self._bundle()} each within {_SCHEDULE_TIMEOUT_S:g} s ({alive} nodes alive)")  # fmt: skip
        actor_cls = ray.remote(NodeCommand)
        attempt = int(time.time())
        for rank in range(num_nodes):
            self._actors.append(
                actor_cls.options(
                    num_cpus=0,  # the bundle's resources are the command's
                    max_restarts=0,
                    max_concurrency=4,
                    name=f"gpufleet-{self._run_id}-{attempt}-node{rank}",
                    runtime_env={"env_vars": {"GPUFLEET_RUN_ID": self._run_id}},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank
                    ),
                ).remote(self._run_id, rank)
            )
        self._nodes = ray.get([a.node_info.remote() for a in self._actors])
        port = ray.get(self._actors[0].free_port.remote())
        return self._nodes[0]["ip"], port

    def start(self, node: Unit) -> Proc:
        ray = self._ray
        rank = node.index
        # The node keeps its own home, shell and PATH; the supervisor's additions travel.
        env = {k: v for k, v in node.env.items() if k not in _NODE_OWN}
        supervisor_bin = node.env.get("PATH", "").split(os.pathsep)[0]
        env["GPUFLEET_SUPERVISOR_BIN"] = supervisor_bin
        if self.config.environment.dependencies:  # a node that does not see supervisor_bin builds its own
            env[DEPENDENCIES_ENV] = json.dumps(self.config.environment.dependencies)
        files: dict[str, bytes] = {}
        params = node.env.get("HYPERPARAMETERS_PATH")
        if params and os.path.exists(params):
            files["HYPERPARAMETERS_PATH"] = open(params, "rb").read()  # noqa: SIM115
        if self.config.compute.ray_driver:
            env["RAY_ADDRESS"] = self._nodes[rank]["gcs_address"]  # the driver joins this cluster
        process = RayNodeProcess(ray, self._actors[rank], node, self._nodes[rank])
        process.pid = ray.get(self._actors[rank].start.remote(node.command, env, node.cwd, files))
        return process

    def _release(self) -> None:
        ray = self._ray
        if ray is None:
            return
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors, self._nodes = [], []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                logger.warning("could not remove the placement group of run %s", self._run_id)
            self._pg = None

    def close(self) -> None:
        self._release()
