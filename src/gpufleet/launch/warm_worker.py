"""A warm rank: one interpreter that runs call after call, keeping imports, CUDA context and process group.

Run as ``python -m gpufleet.launch.warm_worker CONTROL_DIR RANK`` by :mod:`gpufleet.launch.warm`.
Each line on stdin is a job: ``{"run_dir": ..., "env": {...}}``. The rank takes that call's
environment (run id, run folder, attempt, tracking, faults), runs the payload in the run folder
through the same steps as a cold worker (:func:`gpufleet.launch.worker.load_call` and
``run_call``), writes the outcome there, frees what the call left (garbage, cached GPU memory),
and prints an end-of-job mark on stdout and stderr so the caller knows the call's output is
complete. The function's globals are fresh for every call (cloudpickle rebuilds them); imported
modules stay. The process group stays up between calls: ``init_process_group`` when one is
already up and ``destroy_process_group`` of the default group are no-ops here.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ..results import RunDir
from . import worker
from .spec import PARENT_PID_ENV, Payload
from .tracebacks import register_sources

#: Printed alone on a line of stdout and of stderr after each job.
JOB_END = "\x1egpufleet-job-end"


def _keep_the_process_group() -> None:
    """Make the user's own init/destroy of the default group harmless while it is kept warm."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or getattr(dist, "_gpufleet_warm", False):
        return
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if dist.is_initialized():
            return None  # the warm group is already up
        return init(*args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            return  # kept for the next call
        destroy(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    dist._gpufleet_warm = True


def _free_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # a warm idle rank holds its CUDA context, not the call's tensors


def _end_of_job() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.write(JOB_END + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - the caller's pipe closed: it is going away
            pass


def serve(control_dir: Path, rank: int) -> int:
    """Run jobs from stdin until it closes; returns the exit code."""
    from . import progress

    worker.KEEP_PROCESS_GROUP = True
    try:  # before the first call: its own destroy_process_group() must not end the kept group
        import torch.distributed  # noqa: F401

        _keep_the_process_group()
    except ImportError:
        pass
    previous: dict[str, str] = {}
    started = False
    for line in sys.stdin:
        job = json.loads(line)
        env: dict[str, str] = job["env"]
        for name in set(previous) - set(env):
            os.environ.pop(name, None)
        os.environ.update(env)
        previous = env
        run_dir = RunDir(Path(job["run_dir"]))
        if not started:
            if os.environ.get(worker.LOOPBACK_STORE_ENV) == "1" and rank == 0:
                try:
                    worker._host_loopback_store()
                except ImportError:
                    pass
            progress.start(rank, stacks_dir=str(control_dir))
            started = True
        else:
            from .. import faults

            progress.reset()
            faults.arm(rank)
        payload = Payload.read(run_dir.payload)
        for entry in payload.sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        register_sources(payload.sources)  # tracebacks show the lines of code sent by value
        call = worker.load_call(payload.call, rank, run_dir.outcome(rank))
        del payload
        if call is not None:
            worker.run_call(*call, rank, run_dir.outcome(rank))
        del call
        _free_memory()
        _end_of_job()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m gpufleet.launch.warm_worker CONTROL_DIR RANK``."""
    argv = sys.argv[1:] if argv is None else argv
    control_dir, rank = Path(argv[0]), int(argv[1])
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        worker._watch_parent(int(parent))
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = serve(control_dir, rank)
    worker.fast_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
