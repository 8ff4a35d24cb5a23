"""The local engine: processes on this machine, for a call's ranks and a workload's node command alike.

One attempt here is placed by leasing its GPUs (:mod:`gpufleet.launch.leasing.leases`; none on
CPU) and taking a free loopback port; each unit then starts as the leader of its own process
group (never fork), its environment naming only the leased GPUs and its children inheriting the
lease's locks, so that a supervisor that dies leaves the GPUs leased until they have exited too.
Stopping reaches each unit's process group, its descendants and every process that carries the
run's id (a child that called ``setsid`` left the group and, once its parent exited, the tree).
The lease goes back once the processes are gone and NVML no longer lists them on its GPUs.

A call builds one engine per attempt (:class:`~gpufleet.launch.engines.local.group.LocalWorkerGroup`
and its warm subclass); a workload's supervisor one per run, each attempt leasing again
(:class:`~gpufleet.workload.nodes.WorkloadNodeGroup`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ...group import GroupStartCanceled
from ...leasing.gpu_processes import wait_off_gpus
from ...leasing.leases import GpuLease, GpuRequest, Holder, acquire
from ...ports import find_free_port
from ...proctree import popen_in_own_group, stop_tree
from ..base import CLEANUP_GRACE_S, GRACE_PERIOD_S, Engine, Proc, Unit

__all__ = ["LocalEngine", "LocalProc"]

LOOPBACK = "127.0.0.1"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # the caller's terminal; a supervisor's log


class LocalProc(Proc):
    """One unit running on this machine, the leader of its own process group."""

    def __init__(self, unit: Unit, popen: subprocess.Popen[bytes], run_id: str | None, gpus: tuple[int, ...]) -> None:
        self.index = unit.index
        self.unit = unit
        self.popen = popen
        self.run_id = run_id
        self.gpus = gpus

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def cancel(self, grace_period_s: float = GRACE_PERIOD_S) -> None:
        stop_tree([self.popen], grace_period_s, run_id=self.run_id)

    def cleanup(self) -> None:
        stop_tree([self.popen], CLEANUP_GRACE_S, run_id=self.run_id)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"node_rank": self.index, "host": "localhost", "pid": self.popen.pid,
                                     "pgid": self.popen.pid, "log_path": self.unit.log_path}  # fmt: skip
        if self.gpus:
            described["gpus"] = list(self.gpus)
        return described


class LocalEngine(Engine):
    """Runs the units of one node on this machine, on leased GPUs or on the CPU.

    Args:
        run_id: the run whose processes these are (named in the lease; stops reach every process carrying it).
        gpu_request: the GPUs to lease at each :meth:`rendezvous`; None: ``gpu_indices`` as given, or the CPU.
        gpu_indices: the GPUs the units see when nothing is leased (empty: the CPU, or every GPU).
        holder: the kind of holder the lease names (``call`` or ``workload``), shown by ``gpufleet ps``.
        report_after_s: after how long a wait for GPUs is reported on stderr (None: the leases' default).
    """

    def __init__(self, run_id: str | None, gpu_request: GpuRequest | None = None, gpu_indices: Sequence[int] = (),
                 holder: str = "call", report_after_s: float | None = None) -> None:  # fmt: skip
        self.run_id = run_id
        self.gpu_request = gpu_request
        self.gpu_indices = tuple(gpu_indices)
        self.holder = holder
        self.report_after_s = report_after_s
        self.lease: GpuLease | None = None

    # -- placing --------------------------------------------------------------------------
    def lease_gpus(self) -> None:
        """Lease the requested GPUs, waiting (and telling stderr who holds them) until they are free.

        Ends with :class:`~gpufleet.launch.group.GroupStartCanceled` once ``cancel_event`` is set,
        or :class:`~gpufleet.errors.GPUUnavailableError` once the request's wait is over. A lease
        still held from a placement that started nothing is given back first.
        """
        if self.gpu_request is None:
            return
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        self.lease = acquire(self.gpu_request, Holder(self.run_id or "run", self.holder), abort=self.cancel_event,
                             on_wait=_say, canceled=lambda: GroupStartCanceled("canceled while it waited for GPUs"),
                             report_after_s=self.report_after_s)  # fmt: skip
        self.gpu_indices = self.lease.indices

    def rendezvous(self, num_nodes: int = 1, code_dir: str | None = None) -> tuple[str, int]:
        if num_nodes != 1:
            raise ValueError(f"the local engine runs one node, not {num_nodes}")
        self.lease_gpus()
        return LOOPBACK, find_free_port(LOOPBACK)

    def gpu_env(self) -> dict[str, str]:
        """The variables that make a unit see the placed GPUs only (in NVML's order); none on the CPU."""
        if not self.gpu_indices:
            return {}
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpu_indices))}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """The lease's locks, for the processes on its GPUs to inherit (held until every one is gone)."""
        return self.lease.fds if self.lease is not None and not self.lease.released else ()

    def take_lease(self) -> GpuLease | None:
        """Hand the lease to a holder that outlives this engine (warm ranks); the engine releases nothing then."""
        lease, self.lease = self.lease, None
        return lease

    # -- running --------------------------------------------------------------------------
    def start(self, unit: Unit) -> LocalProc:
        if unit.command is not None:  # a node command, under the node guard; the output goes to its log
            argv = [sys.executable, "-m", "gpufleet.launch.node.guard", "--", "bash", "-c", unit.command]
        else:  # a call's rank: the caller reads its output from pipes
            assert unit.run_dir is not None, "a call's rank reads its payload in its run folder"
            argv = [sys.executable, "-m", "gpufleet.launch.worker", unit.run_dir, str(unit.index)]
        env = {**unit.env, **self.gpu_env()}
        if unit.log_path is None:
            popen = popen_in_own_group(argv, env, unit.cwd, pass_fds=self.pass_fds)
        else:
            log = open(unit.log_path, "ab", buffering=0)  # noqa: SIM115 - the child holds it
            try:
                popen = popen_in_own_group(argv, env, unit.cwd, stdout=log, stderr=subprocess.STDOUT,
                                           pass_fds=self.pass_fds)  # fmt: skip
            finally:
                log.close()
        return LocalProc(unit, popen, self.run_id, self.gpu_indices if self.lease is not None else ())

    def stop(self, procs: list[Proc], grace_period_s: float) -> None:
        """Stop every unit together: one grace period for all, then SIGKILL."""
        self.stop_processes([p.popen for p in procs if isinstance(p, LocalProc)], grace_period_s)

    def stop_processes(self, popens: Sequence[subprocess.Popen[bytes]], grace_period_s: float) -> None:
        """Stop these processes of the run (warm ranks too, which outlive an engine) and every process
        that carries the run's id: SIGTERM to each process group, ``grace_period_s``, then SIGKILL."""
        stop_tree(list(popens), grace_period_s, self.run_id)

    def release(self, pids: list[int] | None = None) -> None:
        """Give the GPUs back (the units are gone); safe to call twice.

        First waits (up to a few seconds) until NVML no longer lists ``pids`` on those GPUs: the
        driver frees an exited process's memory a moment after it is gone, and the next run should
        find the GPU empty rather than a process of this run "outside gpufleet".
        """
        lease, self.lease = self.lease, None
        if lease is not None and not lease.released:
            wait_off_gpus(pids or [], lease.gpus)
            lease.release()

    def close(self) -> None:
        self.release()
