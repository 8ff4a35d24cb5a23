"""A warm rank: one interpreter that runs call after call, keeping imports, CUDA context and process group.

Run as ``python -m gpufleet.launch.engines.local.warm_worker CONTROL_DIR RANK`` by :mod:`gpufleet.launch.engines.local.warm`.
Each line of the job pipe (stdin when it starts; the call's own stdin is ``/dev/null``) is a
job: ``{"run_dir": ..., "env": {...}}``. The rank takes that call's environment (run id, run
folder, attempt, tracking, faults), runs the payload in the run folder through the same steps as
a cold worker (:func:`gpufleet.launch.worker.load_call` and ``run_call``), writes the outcome
there, puts back the process state the call changed (:mod:`gpufleet.launch.engines.local.warm_state`), frees
what the call left (garbage, cached GPU memory), and writes an end-of-job mark on its stdout and
stderr descriptors so the caller knows the call's output is complete; the mark says when the
rank must be replaced instead of serving again. The function's globals are fresh for every call
(cloudpickle rebuilds them); imported modules stay. The process group stays up between calls: ``init_process_group`` when one is
already up and ``destroy_process_group`` of the default group are no-ops here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import gc
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ....results import RunDir
from ....runtime import exit_without_teardown
from ... import worker
from ...spec import PARENT_PID_ENV, Payload
from ...tracebacks import register_sources

#: Printed at the end of a line of stdout and of stderr after each job...
JOB_END = "\x1egpufleet-job-end"
#: ...followed by this when the rank cannot serve another call (its state could not be put back).
REPLACE_SUFFIX = "-replace"


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


def _end_of_job(replace: list[str]) -> None:
    """Mark the end of the job on stdout and stderr (at the descriptors: the call may have replaced the streams)."""
    for reason in replace:
        print(f"gpufleet: this warm rank is replaced for the next call: {reason}", file=sys.stderr, flush=True)
    mark = (JOB_END + (REPLACE_SUFFIX if replace else "") + "\n").encode()
    for fd in (1, 2):
        try:
            os.write(fd, mark)
        except OSError:  # the caller's pipe closed: it is going away
            pass


def serve(control_dir: Path, rank: int) -> int:
    """Run jobs from the job pipe until it closes; returns the exit code."""
    from .... import faults
    from ... import progress
    from .warm_state import ColdState, devnull_stdin

    jobs = os.fdopen(devnull_stdin(), "r")  # the call's stdin reads /dev/null, as a cold rank's does
    worker.KEEP_PROCESS_GROUP = True
    try:  # before the first call: its own destroy_process_group() must not end the kept group
        import torch.distributed  # noqa: F401

        _keep_the_process_group()
    except ImportError:
        pass
    cold: ColdState | None = None
    for line in jobs:
        job = json.loads(line)
        run_dir = RunDir(Path(job["run_dir"]))
        if cold is None:
            os.environ.clear()
            os.environ.update(job["env"])
            if os.environ.get(worker.LOOPBACK_STORE_ENV) == "1" and rank == 0:
                try:
                    worker._host_loopback_store()
                except ImportError:
                    pass
            progress.start(rank, stacks_dir=str(control_dir))
            cold = ColdState()  # the store's and the progress reporter's threads and handlers belong to the rank
        else:
            cold.job_start(job["env"], job.get("cwd"))
            progress.reset()
            faults.arm(rank)
        cold.before_call()
        payload = Payload.read(run_dir.payload)
        for entry in payload.sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        register_sources(payload.sources)  # tracebacks show the lines of code sent by value
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a cancel interrupts the call, not the rank
        try:
            call = worker.load_call(payload.call, rank, run_dir.outcome(rank))
            del payload
            if call is not None:
                worker.run_call(*call, rank, run_dir.outcome(rank))
        except KeyboardInterrupt:  # a cancel that came while the outcome was being written
            pass
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        call = None
        faults.disarm()  # a fault timer of this call never fires in the next one
        replace = cold.restore()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # idle: a late cancel must not end the rank
        _free_memory()
        _end_of_job(replace)
    return 0


#: The file in a warm pool's control folder that its caller holds an exclusive ``flock`` on while it lives.
OWNER_LOCK = "owner.lock"


def remove_control_dir_if_orphaned(control_dir: Path, parent_pid: int | None, wait_s: float = 2.0) -> bool:
    """After the job pipe closed: remove the control folder when the caller is gone (True if removed).

    A caller that stops its ranks keeps holding ``owner.lock`` (it removes the folder itself once
    they are gone, and stops them with SIGTERM right after closing the pipe); a caller that died
    (a kernel killed with SIGKILL) holds nothing, and its ranks saw the pipe close before their
    parent watch would have noticed. The kernel drops the lock and closes the pipe in the same
    exit, in an order of its own, so this looks for up to ``wait_s`` (a stop's SIGTERM, sent right
    after the pipe closes, ends the rank sooner: the wait never delays a stop).
    """
    deadline = time.monotonic() + wait_s
    while True:
        gone = parent_pid is not None and os.getppid() != parent_pid
        if not gone:
            try:
                fd = os.open(control_dir / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return False  # the caller removed it: a normal stop
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    gone = True
                except OSError:
                    pass
                finally:
                    os.close(fd)
        if gone:
            shutil.rmtree(control_dir, ignore_errors=True)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m gpufleet.launch.engines.local.warm_worker CONTROL_DIR RANK``."""
    argv = sys.argv[1:] if argv is None else argv
    control_dir, rank = Path(argv[0]), int(argv[1])
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:  # a caller that dies leaves neither ranks, their helpers, nor their control folder
        worker._watch_parent(int(parent), on_orphan=lambda: shutil.rmtree(control_dir, ignore_errors=True))
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = serve(control_dir, rank)
    with contextlib.suppress(Exception):
        remove_control_dir_if_orphaned(control_dir, int(parent) if parent else None)
    exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
