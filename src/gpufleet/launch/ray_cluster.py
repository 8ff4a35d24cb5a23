"""``ray_launch``: a Ray cluster over the allocated ranks, with the function as its driver.

On this machine, the local launcher starts the ranks as usual; rank 0 starts a Ray head
(``ray start --head --block``) that owns every allocated GPU (or one CPU per rank for
``gpu_type="cpu"``), connects to it with ``ray.init`` and runs the function, so Ray Data,
Ray Train and Ray Tune work inside. The other ranks return ``None`` at once. When the
function returns (or raises), rank 0 disconnects and stops the head, which takes every
process it started with it. Each run gets its own authentication token, so nothing is
written to ``~/.ray``.

With ``remote=<address>`` the cluster already spans the nodes: the function runs once, in a
fresh local process, as a driver of that cluster (``RAY_ADDRESS`` is set for it).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import LaunchConfigError

logger = logging.getLogger(__name__)

__all__ = ["ray_launch", "RayDriverEntry"]

_HEAD_START_TIMEOUT_S = 120.0
_HEAD_STOP_TIMEOUT_S = 30.0


def _ray_command() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ray")
    if found:
        return [found]
    raise ImportError("ray_launch needs Ray's command line: pip install 'gpufleet[ray]'")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM ``ray start --block`` (it stops everything it started), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RayDriverEntry:
    """What every rank runs under ``ray_launch``: rank 0 hosts Ray and drives ``func``."""

    def __init__(self, func: Callable[..., Any], ray_start_args: Sequence[str], init_kwargs: dict[str, Any]) -> None:
        self.func = func
        self.ray_start_args = list(ray_start_args)
        self.init_kwargs = dict(init_kwargs)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .. import runtime

        if runtime.get_global_rank() != 0:
            return None  # rank 0's head owns this node's GPUs; nothing to do here
        if os.environ.get("GPUFLEET_RAY_REMOTE"):
            return self.func(*args, **kwargs)  # RAY_ADDRESS points at an existing cluster
        return self._drive(args, kwargs)

    def _head_command(self, port: int) -> list[str]:
        from .. import runtime

        world = runtime.get_world_size()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        num_gpus = len([d for d in visible.split(",") if d.strip()])
        cmd = _ray_command() + [
            "start", "--head", "--block",
            f"--port={port}",
            f"--num-cpus={world if num_gpus == 0 else max(world, os.cpu_count() or 1)}",
            f"--num-gpus={num_gpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        addr = runtime.get_master_addr()
        if addr not in ("127.0.0.1", "localhost", "::1"):
            cmd.append(f"--node-ip-address={addr}")
        return cmd + self.ray_start_args

    def _drive(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import ray

        from .. import runtime

        port = runtime.get_master_port()
        host = runtime.get_master_addr()
        if os.environ.get("RAY_AUTH_MODE") is None:
            # A private token per cluster: nothing is written to ~/.ray.
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        head = subprocess.Popen(self._head_command(port), stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
            while not _port_open(host, port):
                if head.poll() is not None:
                    raise RuntimeError(f"'ray start --head' exited with code {head.returncode}; see the log above")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Ray head did not open port {port} within {_HEAD_START_TIMEOUT_S:g} s")
                time.sleep(0.2)
            address = f"{host}:{port}"
            os.environ["RAY_ADDRESS"] = address
            ray.init(address=address, **{"log_to_driver": True, **self.init_kwargs})
            try:
                return self.func(*args, **kwargs)
            finally:
                ray.shutdown()
        finally:
            _stop_process(head, _HEAD_STOP_TIMEOUT_S)


def ray_launch(
    func: Callable[..., Any] | None = None,
    *,
    gpus: int | None = None,
    gpu_type: str | None = None,
    remote: bool | str = False,
    timeout: float | None = 10800,
    ray_start_args: Sequence[str] = (),
    **options: Any,
) -> Any:
    """Like ``@distributed``, but the ranks form a Ray cluster and ``func`` is its driver.

    ``func`` runs once, on rank 0, connected to a Ray cluster that owns every allocated GPU
    (or one CPU per rank with ``gpu_type="cpu"``), so Ray Train / Data / Tune work inside.
    ``.distributed(...)`` returns a list with ``func``'s result at index 0 and ``None`` for the
    other ranks. With ``remote=<address>`` (or ``True`` and ``RAY_ADDRESS``), ``func`` runs
    as a driver of that existing cluster.

    Args:
        gpus: GPUs (or CPU workers) the cluster gets.
        gpu_type: as for ``@distributed``; ``"cpu"`` for a CPU-only cluster.
        remote: ``False`` starts a cluster here; a Ray address uses that cluster.
        timeout: seconds for the whole call, ``None`` for no limit.
        ray_start_args: extra ``ray start`` flags for the head, e.g.
            ``["--object-store-memory=200000000"]``.
        **options: the other ``@distributed`` options; ``ray_init_kwargs`` go to the
            driver's ``ray.init``.
    """
    from ..api import distributed

    if isinstance(ray_start_args, str):
        raise LaunchConfigError("ray_start_args must be a list of 'ray start' flags, not one string")

    def wrap(f: Callable[..., Any]) -> Any:
        init_kwargs = dict(options.get("ray_init_kwargs") or {})
        entry = RayDriverEntry(f, ray_start_args, init_kwargs)
        address = remote
        if address is True:
            address = os.environ.get("RAY_ADDRESS", "")
            if not address:
                raise LaunchConfigError(
                    "remote=True needs a Ray cluster address in RAY_ADDRESS; or pass remote='ray://host:10001'"
                )
        if address:
            env = {**dict(options.pop("env", {}) or {}), "RAY_ADDRESS": str(address), "GPUFLEET_RAY_REMOTE": "1"}
            return distributed(entry, gpus=1, gpu_type="cpu", remote=False, timeout=timeout, env=env, **options)
        return distributed(entry, gpus=gpus, gpu_type=gpu_type, remote=False, timeout=timeout, **options)

    if func is not None:
        return wrap(func)
    return wrap
