"""The one worker entry point: every launcher runs each rank through :func:`main`.

Run as ``python -m gpufleet.launch.worker RUN_DIR RANK`` by the local launcher. It loads the
cloudpickled call from the run directory, runs it, and writes the rank's outcome file
atomically (``ok`` with the pickled return value, or ``error`` with the exception, its type and
its traceback).
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import runtime
from ..results import ERROR, OK, RunDir, write_outcome
from .node import envcontract
from .spec import LATE_ENV_VAR, PARENT_PID_ENV, Payload
from .tracebacks import format_exception, register_sources


def _watch_parent(parent_pid: int, on_orphan: Any = None) -> None:
    """Kill this rank's process group and descendants if the launching process dies (no orphans).

    Descendants that left the group (a helper that called ``setsid``) are killed first, while
    they are still this rank's; ``on_orphan()`` runs before (a warm rank removes its control folder).
    """

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                try:
                    if on_orphan is not None:
                        with contextlib.suppress(Exception):
                            on_orphan()
                    with contextlib.suppress(Exception):
                        import psutil

                        for child in psutil.Process().children(recursive=True):
                            with contextlib.suppress(psutil.Error):
                                child.kill()
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                finally:
                    os._exit(137)

    threading.Thread(target=loop, name="gpufleet-parent-watch", daemon=True).start()


def _adopt_orphans() -> None:
    """Become the subreaper of what the call starts, and stop it at exit (see :mod:`gpufleet.launch.node.adopted`).

    Registered first, the exit handler runs last: after the call's own handlers shut their
    helpers down (compile workers, data loaders), what is still running is stopped.
    """
    import atexit

    from .node.adopted import become_subreaper, stop_descendants

    if become_subreaper():
        atexit.register(stop_descendants)


def _describe_exception(exc: BaseException) -> dict[str, Any]:
    import cloudpickle

    exc_bytes: bytes | None
    try:
        exc_bytes = cloudpickle.dumps(exc)
        cloudpickle.loads(exc_bytes)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        exc_bytes = None
    exc_type = type(exc)
    return {
        "exc_type": exc_type.__name__,
        "exc_qualname": f"{exc_type.__module__}.{exc_type.__qualname__}",
        "message": str(exc),
        "traceback": format_exception(exc),  # the user's source lines; gpufleet's frames one line
        "exc_bytes": exc_bytes,
    }


#: A warm worker keeps its process group between calls (see :mod:`gpufleet.launch.engines.local.warm_worker`).
KEEP_PROCESS_GROUP = False


def _destroy_process_group() -> None:
    if KEEP_PROCESS_GROUP:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _write(outcome_path: Path, status: str, rank: int, **fields: Any) -> bool:
    """Write the rank's outcome; on failure (a full disk) say so on stderr, where the caller's error shows it."""
    from ..live import feed
    from . import progress

    progress.flush(rank)  # the last step and metrics, for the live view's summary
    feed.flush()
    try:
        write_outcome(outcome_path, status, rank, **fields)
        return True
    except OSError as e:
        print(
            f"gpufleet: rank {rank} could not write its outcome to {outcome_path.parent}: {e}",
            file=sys.stderr, flush=True,
        )
        return False


def load_call(call_bytes: bytes, rank: int, outcome_path: Path) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """Unpickle ``(func, args, kwargs)``; None (with an error outcome written) when that fails."""
    import cloudpickle

    try:
        return cloudpickle.loads(call_bytes)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        info = _describe_exception(exc)
        info["message"] = f"the function could not be loaded in the worker: {info['message']}"
        _write(outcome_path, ERROR, rank, **info)
        return None


def run_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rank: int, outcome_path: Path) -> bool:
    """Run the call as ``rank`` and write its outcome. Returns True on success.

    With ``recovery="replace"``, a peer's death that the launcher answers with a replacement runs
    the function again in this process, in the group's next generation (:mod:`gpufleet.launch.replace`).
    """
    import cloudpickle

    from . import replace

    while True:
        notice = None
        try:
            value = func(*args, **kwargs)
            break
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the caller must hear of it
            notice = replace.verdict_after(exc)
            if notice is None or notice.action != "replace":
                _flush_tracking()
                _write(outcome_path, ERROR, rank, **_describe_exception(exc))
                _destroy_process_group()
                return False
            replace.forget(exc)  # its frames hold the old model and group
        replace.next_generation(notice)  # outside the except block: nothing holds the old group now
        print(f"gpufleet: rank {rank} lost its peer rank {notice.rank} ({notice.cause}); going on in place",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        value_bytes = cloudpickle.dumps(value)
    except Exception as exc:
        import pickle

        err = pickle.PicklingError(
            f"the return value of rank {rank} (type {type(value).__module__}.{type(value).__qualname__}) "
            f"cannot be pickled, so it cannot be sent back: {exc}. Return plain data (numbers, "
            "lists, dicts, tensors, numpy arrays) instead, or save it to a file and return the path."
        )
        _write(outcome_path, ERROR, rank, **_describe_exception(err))
        _destroy_process_group()
        return False
    del value
    _flush_tracking()
    ok = _write(outcome_path, OK, rank, value=value_bytes)
    _last_barrier()
    _destroy_process_group()
    return ok


def _flush_tracking(timeout_s: float = 10.0) -> None:
    """Write what the function logged to MLflow in the background before its outcome; at most ``timeout_s``.

    A caller that reads the run in MLflow once it has the result then finds every metric the
    ranks logged (``synchronous=False``, gpufleet's data-wait window), as it would after a rank's
    exit; a slow tracking server delays the result by the bound at most, and never fails it.
    Nothing happens in a rank that logged nothing in the background (no store is opened for it).
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    data_wait = sys.modules.get("gpufleet.tracking.data_wait")  # loaded only when the rank used it
    queued = any(t.name == "MLflowAsyncLoggingLoop" for t in threading.enumerate())  # MLflow's async logging is on
    if data_wait is None and not queued:
        return

    def flush() -> None:
        try:
            if data_wait is not None:
                data_wait.flush_data_wait()  # its window, and MLflow's queue when it logged
            if queued:
                mlflow.flush_async_logging()
        except Exception:  # noqa: BLE001 - tracking never fails a call
            pass

    thread = threading.Thread(target=flush, name="gpufleet-flush-tracking", daemon=True)
    thread.start()
    thread.join(timeout_s)


def _last_barrier(timeout_s: float = 60.0) -> None:
    """On a gloo process group, wait (up to ``timeout_s``) until every rank has returned.

    A rank's return also tears down what its function built (DDP reducer, gloo pairs, loader
    threads) in C++ destructors; a peer that already left makes that teardown wait for ever, so
    a rank that finishes first stays until the others have finished theirs. NCCL groups skip it
    (a barrier there needs the rank's device set).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
            return
        import datetime

        dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:  # a peer that failed or left: the launcher reports it, nothing to add here
        pass


#: Set by the local launcher: rank 0 hosts the rendezvous store on the loopback interface.
LOOPBACK_STORE_ENV = envcontract.LOOPBACK_STORE
_store: Any = None  # the store rank 0 hosts, kept for the life of the process


def _host_loopback_store() -> None:
    """Host the run's rendezvous store on ``127.0.0.1:MASTER_PORT`` (rank 0 of a one-machine run;
    :mod:`gpufleet.launch.store` says why it is bound to loopback)."""
    global _store
    from . import store

    _store = store.host(runtime.required_int(envcontract.MASTER_PORT), runtime.required_int(envcontract.WORLD_SIZE))


@contextlib.contextmanager
def _import_slot(run_dir: RunDir, rank: int, late_env: str, must: bool) -> Iterator[bool]:
    """While their environment is deferred, at most (cores - 1) ranks import at once.

    The caller opens the MLflow run meanwhile (about 2 CPU-seconds of imports) and every rank
    waits for it: on a machine with few cores, ranks importing torch side by side would slow
    that opening, which is what they all wait for. One core is left to it; with more cores
    than ranks nothing waits. A rank that ``must`` import (rank 0, for the store) waits for its
    slot; another gives up waiting once the environment is there, and yields False.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    fd = os.open(run_dir.path / f"import-slot-{rank % max(1, cores - 1)}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if must else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if os.path.exists(late_env):
                    yield False
                    return
                time.sleep(0.01)
        yield True
    finally:
        os.close(fd)  # releases the lock


def take_late_env(path: str) -> None:
    """Wait for the environment the launcher hands over after the start (the file ``path``), and
    add it to ``os.environ``.

    The rank's caller writes it whole, on success or failure; a caller that dies first ends the
    rank through the parent watch.
    """
    import json

    delay = 0.002
    while True:
        try:
            data = Path(path).read_bytes()
            break
        except FileNotFoundError:
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    os.environ.update({str(k): str(v) for k, v in json.loads(data).items()})


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m gpufleet.launch.worker RUN_DIR RANK``.

    A warm spare (``GPUFLEET_SPARE``; its RANK argument is only a number for its files) does what a
    rank does up to loading the call, then waits until it takes a dead rank's place
    (:func:`gpufleet.launch.replace.take_rank`) and runs the call as that rank.
    """
    argv = sys.argv[1:] if argv is None else argv
    run_dir, rank = RunDir(Path(argv[0])), int(argv[1])
    spare = os.environ.get(envcontract.SPARE)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _watch_parent(int(parent))
    _adopt_orphans()
    faulthandler.enable()  # a segfault prints the Python stack into the rank's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump into the log at a timeout
    from . import progress

    if spare is None:
        progress.start(rank)  # faults to rehearse; progress and stacks when the hang watchdog is on

    late_env = os.environ.pop(LATE_ENV_VAR, None)  # part of the environment comes after the start
    hosts_store = os.environ.get(LOOPBACK_STORE_ENV) == "1" and runtime.rank_text() == "0"
    with _import_slot(run_dir, rank, late_env, hosts_store) if late_env else contextlib.nullcontext(True) as slot:
        if hosts_store:
            try:
                _host_loopback_store()
            except ImportError:  # no torch here: the function cannot rendezvous through torch either
                pass
        elif late_env and slot and not os.path.exists(late_env):
            # Meanwhile, what nearly every call imports first (rank 0 has it already, for the store).
            with contextlib.suppress(ImportError):
                import torch.distributed  # noqa: F401
    payload = Payload.read(run_dir.payload)
    for entry in payload.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    register_sources(payload.sources)  # tracebacks show the lines of code sent by value
    if late_env:
        take_late_env(late_env)  # before the call is loaded: its modules may read the environment on import
    fast = payload.fast_exit
    call = load_call(payload.call, rank, run_dir.outcome(rank))
    del payload  # the call's bytes go: a large argument is held once, as the object it is
    if spare is not None:
        from . import replace

        if call is None:
            return 1  # a spare that cannot load the call takes no rank: the launcher starts a cold one then
        taken = replace.take_rank(int(spare))
        if taken is None:
            return 0
        rank = taken
        progress.start(rank)
    ok = call is not None and run_call(*call, rank, run_dir.outcome(rank))
    code = 0 if ok else 1
    if fast:
        from ..runtime import exit_without_teardown

        exit_without_teardown(code)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
