"""GPU leases of single-node workloads: the supervisor leases the node's GPUs before each attempt.

A GPU workload run on this machine waits for ``compute.num_accelerators`` free GPUs like a call
does (:mod:`gpufleet.launch.leasing.leases`): up to its ``timeout_minutes``, without a limit when it has
none, and ``gpufleet cancel`` ends the wait. Its command sees only the leased GPUs
(``CUDA_VISIBLE_DEVICES``); the supervisor holds the lease until the attempt's processes are
stopped, and the node command's processes inherit it, so a supervisor that dies leaves the GPUs
leased until they have exited too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from ..launch.group import GroupStartCanceled
from ..launch.leasing.leases import GpuLease, GpuRequest, Holder, acquire
from ..launch.proctree import RUN_ID_ENV
from .nodes import LocalExecutor, LocalNodeProcess, NodeExecutor, NodeProcess, NodeSpec
from .schema import WorkloadConfig


class LeasedNodeProcess(LocalNodeProcess):
    """A node command on leased GPUs; its cleanup gives them back."""

    def __init__(self, spec: NodeSpec, lease: GpuLease) -> None:
        self.lease = lease
        super().__init__(spec, pass_fds=lease.fds)  # the node's processes hold the lease too

    def cleanup(self) -> None:
        try:
            super().cleanup()
        finally:
            self.lease.release()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gpus": list(self.lease.indices)}


class LeasedLocalExecutor(LocalExecutor):
    """The local executor of a GPU workload: each attempt's rendezvous first leases its GPUs."""

    def __init__(self, request: GpuRequest, run_id: str) -> None:
        self.request = request
        self.run_id = run_id
        self.lease: GpuLease | None = None

    def rendezvous(self, num_nodes: int, code_dir: str | None = None) -> tuple[str, int]:
        if self.lease is not None:  # an attempt that never started its node
            self.lease.release()

        def say(message: str) -> None:
            print(message, file=sys.stderr, flush=True)  # the supervisor's log

        self.lease = acquire(self.request, Holder(self.run_id, "workload"), abort=self.cancel_event, on_wait=say,
                             canceled=lambda: GroupStartCanceled("canceled while it waited for GPUs"), report_after_s=0.0)  # fmt: skip
        return super().rendezvous(num_nodes, code_dir)

    def start(self, node: NodeSpec) -> NodeProcess:
        lease, self.lease = self.lease, None
        assert lease is not None, "rendezvous leases the GPUs first"
        env = {**node.env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, lease.indices))}
        try:
            return LeasedNodeProcess(dataclasses.replace(node, env=env), lease)
        except BaseException:
            lease.release()
            raise

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def local_executor(config: WorkloadConfig) -> NodeExecutor:
    """The executor of a single-node workload: leasing its GPUs, or plain on CPU."""
    c = config.compute
    if c.gpu_type is None:
        return LocalExecutor()
    wait = config.timeout_minutes * 60 if config.timeout_minutes else None
    return LeasedLocalExecutor(GpuRequest(count=c.per_node, wait_s=wait), os.environ.get(RUN_ID_ENV, "workload"))
