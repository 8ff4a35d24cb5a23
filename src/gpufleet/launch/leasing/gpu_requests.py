"""What a local call asks of the GPU leases (:mod:`gpufleet.launch.leasing.leases`).

``gpus`` (a count, a list of GPU indices, or None for every free GPU) and ``gpu_wait`` become a
:class:`~gpufleet.launch.leasing.leases.GpuRequest`; the local engine
(:class:`~gpufleet.launch.engines.local.engine.LocalEngine`) takes it when a call's ranks are
placed, and gives it back once they have exited.
"""

from __future__ import annotations

from typing import Any

from ...errors import LaunchConfigError
from ..kernel import interactive
from .leases import GpuRequest

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
