"""Connecting to a Ray cluster, and what a call's code needs on it (the job's runtime_env)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ....errors import LaunchConfigError
from ...spec import package_dir

logger = logging.getLogger(__name__)

__all__ = ["before_disconnect", "connect", "disconnect", "import_ray", "runtime_env_for"]

_connected_address: str | None = None
_connected_kwargs: dict[str, Any] | None = None
_connect_lock = threading.Lock()
_before_disconnect: list[Callable[[], None]] = []


def import_ray() -> Any:
    """Import Ray, or say which extra installs it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "running on a Ray cluster needs Ray: pip install 'gpufleet[ray]'"
        ) from e
    return ray


def connect(address: str, init_kwargs: dict[str, Any] | None = None) -> Any:
    """Connect this process to the Ray cluster at ``address``; later calls reuse the connection.

    A connection this module made with other settings (another address, or another
    runtime_env because another call's code must travel) is replaced; a connection the user
    made with ``ray.init`` is reused as it is.
    """
    global _connected_address, _connected_kwargs
    ray = import_ray()
    kwargs: dict[str, Any] = {"log_to_driver": False}
    kwargs.update(init_kwargs or {})
    with _connect_lock:
        if ray.is_initialized():
            if _connected_address is None:
                logger.info("using the Ray connection made by ray.init (its runtime_env is kept)")
                return ray
            if _connected_address == address and _connected_kwargs == kwargs:
                return ray
            _end(ray)
        handlers = _python_signal_handlers()
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            raise LaunchConfigError(
                f"cannot connect to the Ray cluster at {address!r}: {e}. Start one with "
                "'ray start --head' (see docs/multinode.md) or fix the address."
            ) from e
        finally:
            _restore_signal_handlers(handlers)
        _connected_address, _connected_kwargs = address, kwargs
    return ray


def before_disconnect(hook: Callable[[], None]) -> None:
    """Run ``hook`` before this process's Ray connection ends (once per registration).

    A thread still inside ``ray.wait`` or ``ray.get`` when Ray shuts down crashes the whole
    process (SIGSEGV in Ray's core worker): what waits on Ray in the background registers a
    hook that stops its threads and returns once they are out of Ray.
    """
    with _connect_lock:
        if hook not in _before_disconnect:
            _before_disconnect.append(hook)


def disconnect() -> None:
    """End this process's Ray connection, after the :func:`before_disconnect` hooks have run."""
    ray = import_ray()
    with _connect_lock:
        _end(ray)


def _end(ray: Any) -> None:
    global _connected_address, _connected_kwargs
    for hook in list(_before_disconnect):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a hook must not keep the connection from ending
            logger.exception("a hook run before the Ray connection ends failed")
    if ray.is_initialized():
        ray.shutdown()
    _connected_address = _connected_kwargs = None


_GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _python_signal_handlers() -> dict[int, Any]:
    """This process's Python handlers of SIGTERM, SIGINT and SIGHUP (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}


def _restore_signal_handlers(handlers: dict[int, Any]) -> None:
    """Put back the handlers ``ray.init`` replaced.

    Ray's core worker installs a native handler for SIGTERM that logs a stack and ends the process
    at once; a gpufleet supervisor (cancel = SIGTERM) or a caller with its own handlers would die
    without stopping its runs. Python still reports its own handler there, so each is installed again.
    """
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


# -- what travels to the workers --------------------------------------------------------------
def _is_installed(path: Path) -> bool:
    parts = set(path.parts)
    return bool(parts & {"site-packages", "dist-packages"}) or str(path).startswith(sys.base_prefix)


def _code_paths(call_bytes: bytes) -> list[str]:
    """Local code the call needs on the workers: gpufleet itself and the function's package."""
    import cloudpickle

    paths = [str(package_dir())]
    try:
        func, _, _ = cloudpickle.loads(call_bytes)
    except Exception:  # the workers report it with the rank's traceback
        return paths
    module_name = getattr(func, "__module__", None) or "__main__"
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module_name == "__main__" or not file:
        return paths  # pickled by value (notebook cells, scripts)
    top = sys.modules.get(module_name.split(".")[0])
    top_file = getattr(top, "__file__", None)
    if top_file is None:
        return paths
    top_path = Path(top_file).resolve()
    target = top_path.parent if top_path.name == "__init__.py" else top_path
    if not _is_installed(target) and str(target) not in paths:
        paths.append(str(target))
    return paths


def runtime_env_for(user_env: dict[str, Any] | None, call_bytes: bytes) -> dict[str, Any]:
    """The job's runtime_env: the user's own one plus the local code this call needs.

    Ray uploads local ``py_modules`` only for a job (``ray.init``), so the code of the call
    decides the job's runtime_env.
    """
    base = dict(user_env or {})
    py_modules = list(base.get("py_modules") or [])
    for path in _code_paths(call_bytes):
        if path not in py_modules:
            py_modules.append(path)
    base["py_modules"] = py_modules
    excludes = list(base.get("excludes") or [])
    base["excludes"] = excludes + [e for e in ("__pycache__", "*.pyc", ".git") if e not in excludes]
    return base
