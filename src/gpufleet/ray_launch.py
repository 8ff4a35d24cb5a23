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
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import LaunchConfigError
from .launch.node import envcontract

logger = logging.getLogger(__name__)

__all__ = ["ray_launch", "RayDriverEntry"]

_HEAD_START_TIMEOUT_S = 120.0
_HEAD_STOP_TIMEOUT_S = 30.0
_STARTED_MESSAGE = b"Ray runtime started"
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
#: "0": Ray resolves this node's address (and a loopback address to connect to) as 127.0.0.1.
_RAY_ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray_command() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ray")
    if found:
        return [found]
    raise ImportError("ray_launch needs Ray's command line: pip install 'gpufleet[ray]'")


def _forward_output(proc: subprocess.Popen[bytes], started: threading.Event) -> None:
    """Copy ``ray start``'s output to this rank's stdout; flag its "started" message."""
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        sys.stdout.write(line.decode("utf-8", "replace"))
        sys.stdout.flush()
        if _STARTED_MESSAGE in line:
            started.set()
    proc.stdout.close()


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


def _private_token() -> None:
    """Token authentication with a fresh token kept in the environment (never in ``~/.ray``)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    if "ray" in sys.modules:
        # Ray reads the mode when it is imported (the function's module may have imported
        # it already); this refreshes it, as `ray.init` does when it enables token auth.
        from ray._raylet import Config

        Config.initialize("")


class RayDriverEntry:
    """What every rank runs under ``ray_launch``: rank 0 hosts Ray and drives ``func``."""

    def __init__(self, func: Callable[..., Any], ray_start_args: Sequence[str], init_kwargs: dict[str, Any]) -> None:
        # Names that cannot clash with the attributes functools.update_wrapper copies on.
        self._driver_func = func
        self._ray_start_args = list(ray_start_args)
        self._driver_init_kwargs = dict(init_kwargs)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from . import runtime

        if runtime.get_global_rank() != 0:
            return None  # rank 0's head owns this node's GPUs; nothing to do here
        if os.environ.get(envcontract.RAY_REMOTE):  # RAY_ADDRESS points at an existing cluster
            import ray

            # connected as with a cluster started here, so the same driver code runs either way
            ray.init(address=os.environ["RAY_ADDRESS"], **{"log_to_driver": True, **self._driver_init_kwargs})
            try:
                return self._driver_func(*args, **kwargs)
            finally:
                ray.shutdown()
        return self._drive(args, kwargs)

    def _head_command(self, port: int) -> list[str]:
        from . import runtime

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
        # The node registers MASTER_ADDR, a loopback one as 127.0.0.1: left to itself Ray registers
        # the machine's network address, and a one-machine run would serve on it.
        addr = runtime.get_master_addr()
        cmd.append(f"--node-ip-address={'127.0.0.1' if addr in _LOOPBACK_NAMES else addr}")
        return cmd + self._ray_start_args

    def _drive(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from . import runtime

        port = runtime.get_master_port()
        host = runtime.get_master_addr()
        if os.environ.get("RAY_AUTH_MODE") is None:
            _private_token()
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        import ray
        # The driver has disconnected when the head is stopped: nothing left to drain.
        head_env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        head = subprocess.Popen(
            self._head_command(port), env=head_env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        started = threading.Event()
        threading.Thread(target=_forward_output, args=(head, started), daemon=True).start()
        try:
            deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
            # The head's own message, not an open port: another cluster may hold this port.
            while not started.wait(0.2):
                if head.poll() is not None:
                    raise RuntimeError(
                        f"'ray start --head --port={port}' exited with code {head.returncode}; see the log above"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Ray head did not start within {_HEAD_START_TIMEOUT_S:g} s")
            address = f"{host}:{port}"
            os.environ["RAY_ADDRESS"] = address
            ray.init(address=address, **{"log_to_driver": True, **self._driver_init_kwargs})
            try:
                return self._driver_func(*args, **kwargs)
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
        remote: ``False`` starts a cluster here; a Ray address uses that cluster: then only the
            driver runs here (on the CPU) and ``gpus``/``gpu_type`` are not used (a warning
            says so when they are given).
        timeout: seconds for the whole call, ``None`` for no limit.
        ray_start_args: extra ``ray start`` flags for the head, e.g.
            ``["--object-store-memory=200000000"]``.
        **options: the other ``@distributed`` options; ``ray_init_kwargs`` go to the
            driver's ``ray.init``.
    """
    from .api import distributed

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
            if gpus is not None or gpu_type not in (None, "cpu"):
                warnings.warn(
                    f"ray_launch(remote=...) runs only the driver here, on the CPU, and its Ray jobs use "
                    f"what the cluster at {address} has: gpus={gpus!r} and gpu_type={gpu_type!r} are not "
                    "used (ask for GPUs in the Ray job itself, e.g. ScalingConfig(use_gpu=True))",
                    UserWarning,
                    stacklevel=3,
                )
            env = {**dict(options.pop("env", {}) or {}), "RAY_ADDRESS": str(address), envcontract.RAY_REMOTE: "1",
                   envcontract.LOOPBACK_STORE: "0"}  # fmt: skip
            return distributed(entry, gpus=1, gpu_type="cpu", remote=False, timeout=timeout, env=env, **options)
        # the Ray head's GCS listens on MASTER_PORT: no rendezvous store of gpufleet's there. The
        # cluster is this machine's alone: Ray (whose default registers the machine's network
        # address, even for a node started on 127.0.0.1) keeps it on loopback.
        env = {**dict(options.pop("env", {}) or {}), envcontract.LOOPBACK_STORE: "0", _RAY_ONE_MACHINE: "0"}
        return distributed(entry, gpus=gpus, gpu_type=gpu_type, remote=False, timeout=timeout, env=env, **options)

    if func is not None:
        return wrap(func)
    return wrap
