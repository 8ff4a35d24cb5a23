"""What one call may change in a warm rank's process, captured before it and put back after it.

A warm rank (:mod:`gpufleet.launch.engines.local.warm_worker`) must start every call from the state a cold
rank has. :class:`ColdState` is taken once, when the rank starts (torch imported, nothing of a
call run yet); :meth:`ColdState.restore` runs after each call and puts back what can be put back
cheaply:

- the working directory, ``sys.path``, ``sys.argv``, ``sys.stdin/stdout/stderr`` (stdin reads
  ``/dev/null``, as a cold rank's does), the umask, every signal handler set from Python, the
  resource limits;
- torch's process-wide settings: default dtype and device, thread count, grad and anomaly mode,
  deterministic algorithms, float32 matmul precision, the TF32 and cuDNN switches; torch's,
  NumPy's and Python's random generators are seeded afresh (a cold rank's start from a random seed);
- every function or class of torch's main namespaces (:data:`WATCHED_MODULES`: ``torch``,
  ``torch.nn.functional``, ``torch.distributed``, ...), and every attribute of ``torch.Tensor``
  and ``torch.nn.Module``, that the call replaced or deleted (a monkeypatched ``torch.add``);
  attributes a call added to those two classes are deleted.

The environment and working directory are the job's: those the caller gives a rank of this call.
What cannot be put back makes :meth:`restore` return reasons to *replace* the ranks (the next
call then starts cold): a thread the call started that is still running, a child process it
left (stopped here, but a library may count on it), a limit that cannot be raised again, a
stream that was closed.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading
import time
import types
from typing import Any

_MISSING = object()
_RLIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
#: How long threads a call started may take to end after it returned.
THREAD_GRACE_S = 0.5


def devnull_stdin() -> int:
    """Point fd 0 at ``/dev/null`` (a cold rank's stdin) and return a new fd for what it was (the job pipe)."""
    jobs = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return jobs


class ColdState:
    """The rank's process state before any call (see the module's docstring)."""

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.argv = list(sys.argv)
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.signals = {s: signal.getsignal(s) for s in _SIGNALS}
        self.rlimits = {}
        for r in _RLIMITS:
            with contextlib.suppress(OSError, ValueError):
                self.rlimits[r] = resource.getrlimit(r)
        self.torch = _torch_settings()
        self.attributes = _torch_attributes()
        self.threads: set[threading.Thread] = set()

    def before_call(self) -> None:
        """Note what runs before a call (its threads are not the call's)."""
        self.threads = set(threading.enumerate())

    def job_start(self, job_env: dict[str, str], cwd: str | None) -> None:
        """The environment and working directory a cold rank of this call would start with (the caller's now)."""
        os.environ.clear()
        os.environ.update(job_env)  # the whole environment the caller gives a rank of this call
        if cwd:
            with contextlib.suppress(OSError):
                os.chdir(cwd)

    def restore(self) -> list[str]:
        """Put back what the call changed; returns why the ranks must be replaced (empty: they may serve again)."""
        replace: list[str] = []
        for name, stream in zip(("stdin", "stdout", "stderr"), self.streams, strict=True):
            if getattr(sys, name) is not stream:
                setattr(sys, name, stream)
            if stream.closed:
                replace.append(f"sys.{name} was closed")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        try:
            os.chdir(self.cwd)
        except OSError as e:
            replace.append(f"its working directory {self.cwd} is gone ({e.strerror})")
        sys.path[:] = self.path
        sys.argv[:] = self.argv
        os.umask(self.umask)
        for s, handler in self.signals.items():
            if handler is None:
                continue  # installed outside Python: nothing to put back from here
            with contextlib.suppress(OSError, ValueError, TypeError):
                if signal.getsignal(s) is not handler:
                    signal.signal(s, handler)
        for r, limits in self.rlimits.items():
            try:
                if resource.getrlimit(r) != limits:
                    resource.setrlimit(r, limits)
            except (OSError, ValueError):
                replace.append(f"a resource limit ({r}) was lowered for good")
        _restore_torch_settings(self.torch)
        replace += _restore_attributes(self.attributes)
        replace += self._threads_left()
        replace += _stop_children()
        return replace

    def _threads_left(self) -> list[str]:
        deadline = time.monotonic() + THREAD_GRACE_S
        left = []
        for t in threading.enumerate():
            if t in self.threads or not t.is_alive():
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                left.append(t)
        if not left:
            return []
        names = ", ".join(sorted(t.name for t in left))
        return [f"the call left {len(left)} thread(s) running ({names})"]


def _stop_children() -> list[str]:
    """Stop the processes the call started (and left); a reason to replace the ranks if there were any."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001
        return []
    if not children:
        return []
    from ...proctree import stop_tree

    stop_tree([c.pid for c in children], 1.0)
    for c in children:
        with contextlib.suppress(Exception):
            os.waitpid(c.pid, os.WNOHANG)  # reap the direct ones
    return [f"the call left {len(children)} child process(es) running (stopped now)"]


# ------------------------------------------------------------------ torch


def _torch_settings() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    s: dict[str, Any] = {
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    with contextlib.suppress(Exception):
        s["device"] = torch.get_default_device()
    with contextlib.suppress(Exception):
        s["cuda_tf32"] = torch.backends.cuda.matmul.allow_tf32
        s["cudnn"] = (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                      torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)  # fmt: skip
    return s


def _reseed() -> None:
    """Random generators seeded afresh, as in a new process (a call's ``manual_seed`` is not the next call's)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def _restore_torch_settings(s: dict[str, Any]) -> None:
    _reseed()
    torch = sys.modules.get("torch")
    if torch is None or not s:
        return
    with contextlib.suppress(Exception):
        if torch.get_default_dtype() != s["dtype"]:
            torch.set_default_dtype(s["dtype"])
    with contextlib.suppress(Exception):
        if torch.get_num_threads() != s["threads"]:
            torch.set_num_threads(s["threads"])
    with contextlib.suppress(Exception):
        torch.set_grad_enabled(s["grad"])
        torch.set_anomaly_enabled(s["anomaly"])
    with contextlib.suppress(Exception):
        if torch.are_deterministic_algorithms_enabled() != s["deterministic"]:
            torch.use_deterministic_algorithms(s["deterministic"])
    with contextlib.suppress(Exception):
        torch.set_float32_matmul_precision(s["matmul_precision"])
    with contextlib.suppress(Exception):
        torch.default_generator.seed()  # a cold rank's generators start from a random seed, not the last call's
        if torch.cuda.is_initialized():
            torch.cuda.seed_all()
    with contextlib.suppress(Exception):
        if "device" in s and torch.get_default_device() != s["device"]:
            torch.set_default_device(None)
    with contextlib.suppress(Exception):
        if "cudnn" in s:
            torch.backends.cuda.matmul.allow_tf32 = s["cuda_tf32"]
            cudnn = torch.backends.cudnn
            cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = s["cudnn"]


#: The torch modules whose functions and classes are put back after each call (those user code
#: patches; every module of torch would cost tens of milliseconds per call).
WATCHED_MODULES = (
    "torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.autograd", "torch.cuda", "torch.optim",
    "torch.distributed", "torch.distributed.distributed_c10d", "torch.utils.data", "torch.utils.checkpoint",
    "torch.serialization", "torch.random", "torch.backends",
)  # fmt: skip


def _torch_attributes() -> list[tuple[Any, Any, str, Any]]:
    """(owner, its __dict__, name, value) of every function/class of :data:`WATCHED_MODULES`, and of two classes' dicts."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for name in WATCHED_MODULES:
        module = sys.modules.get(name)
        d = getattr(module, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for key, value in list(d.items()):
            kind = type(value)  # not isinstance(): it reads __class__, which some deprecated objects warn about
            if kind is types.FunctionType or kind is types.BuiltinFunctionType or issubclass(kind, type):
                found.append((module, d, key, value))
    for cls in (torch.Tensor, torch.nn.Module):
        for key, value in list(vars(cls).items()):
            found.append((cls, vars(cls), key, value))
        found.append((cls, vars(cls), "", frozenset(vars(cls))))  # its own names: one a call adds goes again
    return found


def _restore_attributes(attributes: list[tuple[Any, Any, str, Any]]) -> list[str]:
    failed = []
    for owner, d, key, value in attributes:
        if not key:  # a class's names before the call: what the call added is deleted (Tensor.add over TensorBase's)
            for added in set(d) - value:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(owner, added)
            continue
        if d.get(key, _MISSING) is value:
            continue
        try:
            setattr(owner, key, value)
        except (AttributeError, TypeError) as e:
            failed.append(f"{getattr(owner, '__name__', owner)}.{key} was replaced and cannot be put back ({e})")
    return failed
