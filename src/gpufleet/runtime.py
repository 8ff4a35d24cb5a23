"""Who am I: rank helpers and process-group setup, usable inside workers.

This is the one module that reads the torchrun rendezvous environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). Outside a launched worker every helper returns single-process values.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, NoReturn

from .launch.node import envcontract

__all__ = [
    "get_global_rank",
    "get_local_rank",
    "get_world_size",
    "get_local_world_size",
    "get_node_rank",
    "get_num_nodes",
    "get_master_addr",
    "get_master_port",
    "is_main_process",
    "is_distributed_env",
    "setup",
    "finish",
    "barrier",
    "device",
    "report_step",
    "section",
    "set_total_steps",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def get_global_rank() -> int:
    """This process's rank among all ranks (``RANK``; 0 outside a run)."""
    return _env_int(envcontract.RANK, 0)


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 outside a run)."""
    return _env_int(envcontract.LOCAL_RANK, 0)


def get_world_size() -> int:
    """Number of ranks in the run (``WORLD_SIZE``; 1 outside a run)."""
    return _env_int(envcontract.WORLD_SIZE, 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (``LOCAL_WORLD_SIZE``; 1 outside a run)."""
    return _env_int(envcontract.LOCAL_WORLD_SIZE, 1)


def get_node_rank() -> int:
    """Index of this node (``NODE_RANK``, else ``GROUP_RANK``; 0 outside a run)."""
    return _env_int(envcontract.NODE_RANK, _env_int(envcontract.GROUP_RANK, 0))


def get_num_nodes() -> int:
    """Number of nodes (``NUM_NODES``, else world size / local world size)."""
    return _env_int(envcontract.NUM_NODES, max(1, get_world_size() // max(1, get_local_world_size())))


def get_master_addr() -> str:
    """Address of rank 0's rendezvous store (``MASTER_ADDR``)."""
    return os.environ.get(envcontract.MASTER_ADDR, "127.0.0.1")


def get_master_port() -> int:
    """Port of rank 0's rendezvous store (``MASTER_PORT``)."""
    return _env_int(envcontract.MASTER_PORT, 29500)


def is_main_process() -> bool:
    """True on global rank 0 (and outside a run)."""
    return get_global_rank() == 0


def is_distributed_env() -> bool:
    """True when the rendezvous environment of a launcher is present."""
    return envcontract.RANK in os.environ and envcontract.WORLD_SIZE in os.environ


def rank_text(default: str | None = None) -> str | None:
    """``RANK`` as it is written, unchecked, or ``default`` when it is unset: for gpufleet's own
    code that only compares it with ``"0"`` or writes it down (where :func:`get_global_rank` would
    raise on a value that is no integer)."""
    return os.environ.get(envcontract.RANK, default)


def required_int(name: str) -> int:
    """The torchrun variable ``name`` (``envcontract.MASTER_PORT``, ``WORLD_SIZE``, ...) of a
    launched rank, which must be set: ``KeyError`` when it is not, ``ValueError`` when it is no
    integer (no default as the ``get_*`` helpers have outside a run)."""
    return int(os.environ[name])


def device() -> Any:
    """The ``torch.device`` this rank should use: ``cuda:LOCAL_RANK`` on GPUs, else CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def setup(backend: str | None = None, timeout_s: float | None = None) -> Any:
    """Select this rank's device and initialise the default process group.

    Args:
        backend: ``None`` picks ``nccl`` when CUDA is available and ``gloo`` otherwise.
            Pass ``"cpu:gloo,cuda:nccl"`` when CPU collectives are needed beside NCCL
            (asynchronous checkpoints), or any backend string torch accepts. On CPU workers
            the ``cuda:`` part of such a string is dropped, so the same code runs there.
        timeout_s: collective timeout in seconds (torch's default when ``None``).

    Returns:
        The ``torch.device`` of this rank. Calling it again returns the same device.
        Outside a launched run it initialises a one-rank group, so the same code also
        runs as a plain single process.
    """
    import datetime

    import torch
    import torch.distributed as dist

    from .launch import progress

    progress.start(get_global_rank())  # a workload's ranks too: faults, and progress for the watchdog
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_available() and dist.is_initialized():
        return dev
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    elif dev.type != "cuda" and ":" in backend:
        # "cpu:gloo,cuda:nccl" written for GPUs: on CPU workers only the CPU part applies
        cpu_parts = [part for part in backend.split(",") if not part.strip().startswith("cuda:")]
        backend = ",".join(cpu_parts) or "gloo"
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if dev.type == "cuda" and "nccl" in backend:
        kwargs["device_id"] = dev  # eager NCCL init: the first collective does not stall
    from .launch import replace

    joining = replace.init_arguments() if is_distributed_env() else None
    with replace.group_sockets():  # with recovery="replace": the connections a survivor shuts when a peer dies
        if joining is not None:  # a later generation of a group that replaced a rank in place
            dist.init_process_group(**kwargs, **joining)
        elif is_distributed_env():
            dist.init_process_group(**kwargs, init_method="env://")
        else:
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs, store=dist.HashStore(), rank=0, world_size=1)
    _end_gloo_group_at_exit()
    return dev


_end_registered = False


def _end_gloo_group_at_exit() -> None:
    """End the group :func:`setup` started when the rank's Python exits, if the rank's code did not.

    A gloo group left to the interpreter's teardown can abort a rank that trained and returned
    (SIGABRT, "terminate called without an active exception": gloo's threads are still alive while
    Python tears down), and torchrun then fails the attempt. An NCCL group is left alone: its own
    destructor aborts its communicators, where ending it here could wait on a lost peer.
    """
    global _end_registered
    if not _end_registered:
        atexit.register(_end_gloo_group)
        _end_registered = True


def _end_gloo_group() -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend()):
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the rank is ending; nothing to add to how it ends
        pass


def finish(code: int = 0) -> NoReturn:
    """End this rank's process with ``code``, without the interpreter's teardown.

    Call it last in a training script that torchrun starts::

        if __name__ == "__main__":
            main()
            runtime.finish()

    It ends a gloo process group, then does what :func:`exit_without_teardown` says. Ending the
    group is not enough on its own: a library that keeps a sub-group (DeepSpeed, Accelerate) keeps
    that group's gloo threads alive, and a thread that frees a finished collective's tensors while
    Python tears down is ended by Python inside a C++ destructor. The rank then aborts (SIGABRT,
    "terminate called without an active exception") after it trained to its end, and torchrun
    fails the attempt. Exiting without the teardown leaves no such moment. An NCCL group is not
    ended here (ending it could wait on a lost peer); the process's exit releases it.
    """
    _end_gloo_group()
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit without tearing down every module (about 0.5 s once torch is loaded).

    Does what matters of a normal shutdown first: joins non-daemon threads (an async
    checkpoint writer, say), runs atexit handlers (logging, MLflow, Hugging Face) and flushes
    stdio. Module finalisation and garbage collection at exit are skipped.
    """
    shutdown = getattr(threading, "_shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
                pass
        os._exit(code)


def barrier() -> None:
    """Wait for every rank (a no-op when no process group is initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        import torch

        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def report_step(step: int | None = None) -> None:
    """Tell gpufleet this rank made a step (the next one, or ``step``).

    gpufleet counts steps itself in its data loader and ``prepare()``'s optimizer step; a loop
    that uses neither reports them here, so the hang watchdog sees progress in loops without
    collectives and faults given ``step=N`` fire. Cheap, and a no-op outside a launched rank.
    """
    from .launch.progress import note_reported_step

    note_reported_step(step)


def section(name: str, limit_s: float | None = None) -> Any:
    """Mark a long phase of this rank (evaluation, a model export) so that the hang watchdog waits it out.

    ``with runtime.section("eval"): evaluate(model)``. While any rank is inside a section, the
    watchdog's fast path is off (a rank that the others wait for is not declared hung after
    the limit learned from the steps); the run is judged hung only once nothing moved for
    ``limit_s`` seconds (default: the call's ``hang_timeout``). Sections nest; cheap, and a
    no-op outside a launched rank. gpufleet marks ``CheckpointManager`` saves and resumes itself.
    """
    from .launch.progress import section as _section

    return _section(name, limit_s)


def set_total_steps(total: int | None) -> None:
    """Tell gpufleet how many steps this rank's loop will make (``None``: unknown again).

    The live view (the panel in a notebook cell, the status line in a terminal) then shows
    ``step/total`` and an ETA. Steps are the ones gpufleet counts (its data loader,
    ``prepare()``'s optimizer step, :func:`report_step`). Cheap, and a no-op outside a launched rank.

    Raises:
        ValueError: ``total`` is not a positive integer or None.
    """
    from .launch.progress import set_total_steps as _set

    _set(total)
