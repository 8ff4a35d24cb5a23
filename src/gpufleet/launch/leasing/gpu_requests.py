"""What a local call asks of the GPU leases (:mod:`gpufleet.launch.leasing.leases`), and a local worker group's lease.

``gpus`` (a count, a list of GPU indices, or None for every free GPU) and ``gpu_wait`` become a
:class:`~gpufleet.launch.leasing.leases.GpuRequest`; :func:`lease_for_group` takes it when a
:class:`~gpufleet.launch.engines.local.group.LocalWorkerGroup` starts, and :func:`release_group_lease` gives
it back once its ranks have exited.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ...errors import LaunchConfigError
from ..kernel import interactive
from .gpu_processes import wait_off_gpus
from .leases import GpuRequest, Holder, acquire


def lease_for_group(group: Any, kind: str = "call") -> None:
    """Lease the GPUs of a local worker group's ``placement.gpu_request`` before its ranks start.

    Waits (telling stderr who holds them) until they are free, the group's ``abort`` is set
    (:class:`~gpufleet.launch.group.GroupStartCanceled`) or the request's wait ends
    (:class:`GPUUnavailableError`). The group's placement then names the leased GPUs, and with
    ``count=None`` its world size is the number of GPUs it got.
    """
    placement = group.placement
    request = getattr(placement, "gpu_request", None)
    if not placement.use_gpus or request is None or group.lease is not None:
        return
    from ..group import GroupStartCanceled

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    lease = acquire(request, Holder(group.run_id, kind), abort=group.abort, on_wait=say,
                    canceled=lambda: GroupStartCanceled("canceled while it waited for GPUs"))  # fmt: skip
    group.lease = lease
    group.placement = dataclasses.replace(placement, gpu_indices=lease.indices)
    if len(lease.indices) != group.spec.world_size:
        group.spec = dataclasses.replace(group.spec, world_size=len(lease.indices))


def release_group_lease(group: Any) -> None:
    """Give back a local worker group's GPUs (its ranks are gone); safe to call twice.

    First waits (up to a few seconds) until NVML no longer lists the ranks on those GPUs: the
    driver frees an exited process's memory a moment after it is gone, and the next run should
    find the GPU empty rather than a rank of this run "outside gpufleet".
    """
    lease = getattr(group, "lease", None)
    if lease is not None and not lease.released:
        wait_off_gpus(getattr(group, "pids", []), lease.gpus)
        lease.release()


# ------------------------------------------------------------------ the settings of a call

#: ``gpu_wait=None`` in a notebook (an interactive kernel): seconds to wait for free GPUs.
NOTEBOOK_GPU_WAIT_S = 300.0


def check_gpu_settings(gpus: Any, gpu_wait: Any, remote: Any = False) -> None:
    """Reject a wrong ``gpus`` (a count, None, or a list of GPU indices) or ``gpu_wait``."""
    if isinstance(gpus, tuple):
        if not gpus or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gpus) \
                or len(set(gpus)) != len(gpus):  # fmt: skip
            raise LaunchConfigError(f"gpus as a list names distinct GPU indices (e.g. [0, 2]), got {list(gpus)!r}")
        if remote:
            raise LaunchConfigError("gpus as a list of GPU indices is for runs on this machine; on Ray ask for a count")
    elif gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise LaunchConfigError(
            f"gpus must be a positive integer, a list of GPU indices, or None (every free GPU), got {gpus!r}"
        )
    if gpu_wait is not None and (
        isinstance(gpu_wait, bool) or not isinstance(gpu_wait, (int, float)) or gpu_wait != gpu_wait or gpu_wait < 0
    ):
        raise LaunchConfigError(
            f"gpu_wait must be seconds >= 0 to wait for free GPUs (math.inf: no limit), or None (300 s in a "
            f"notebook, else up to the timeout); got {gpu_wait!r}"
        )


def call_gpu_request(gpus: int | tuple[int, ...] | None, gpu_wait: float | None, timeout: float | None,
                     use_gpus: bool) -> GpuRequest | None:  # fmt: skip
    """The lease a local call asks for (None on CPU).

    ``gpu_wait=None``: :data:`NOTEBOOK_GPU_WAIT_S` in a notebook, else up to the call's
    ``timeout`` (no limit without one); ``math.inf``: no limit.
    """
    if not use_gpus:
        return None
    if gpu_wait is None:
        wait: float | None = NOTEBOOK_GPU_WAIT_S if interactive() else timeout
    else:
        wait = None if gpu_wait == float("inf") else float(gpu_wait)
    if isinstance(gpus, tuple):
        return GpuRequest(named=gpus, wait_s=wait)
    return GpuRequest(count=gpus, wait_s=wait)
