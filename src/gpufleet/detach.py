"""``submit(..., detach=True)``: a call that runs on under a supervisor process of its own, like a workload.

The caller stores the call as a PENDING run of kind ``call`` (one id for all its attempts), pickles
the function, its settings and its arguments into the run's private folder (``job.pkl``) and
starts its supervisor (``python -m gpufleet.detached_run RUN_ID``, :mod:`gpufleet.detached_run`)
in a new session, the way ``gpufleet run`` starts a workload's. The supervisor runs the call
through the same controller as ``.distributed()`` (it leases its GPUs, retries, times out, has a
heartbeat, and is canceled with ``gpufleet cancel`` like a workload run), streams its ranks'
output into ``supervisor.log`` and writes the result (or the error) into ``result.pkl``. The
caller returns a :class:`StoredRunHandle` once the first attempt started (a setting the
supervisor refuses is raised here), and may then exit: the run goes on, ``gpufleet logs RUN_ID
--follow`` follows it, and ``gpufleet.run_handle(RUN_ID)`` finds it again from any process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
from typing import Any

from .detached_run import JOB_FILE
from .handles import StoredRunHandle

#: Seconds the caller waits for the supervisor to start the first attempt (its GPUs may be busy: it then
#: returns while the run waits for them, as soon as the attempt is recorded).
START_WAIT_S = 120.0


def submit_detached(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StoredRunHandle:
    """Hand the call to a detached supervisor; returns once its first attempt started."""
    import cloudpickle

    from .errors import GpufleetError
    from .private import private_file_opener
    from .results import RunDir, new_run_id
    from .runs.calls import CallKind, call_origin
    from .runs.liveness import process_start_time
    from .runs.store import RunStore
    from .runs.supervisor import LOG_FILE, start_supervisor
    from .states import FAILED

    function._bind(args, kwargs)
    try:
        job = cloudpickle.dumps({"func": function.func, "options": function.options, "args": args, "kwargs": kwargs,
                                 "sys_path": [p for p in sys.path if p], "cwd": os.getcwd()},
                                protocol=pickle.HIGHEST_PROTOCOL)  # fmt: skip
    except Exception:
        function._pickle_call(args, kwargs)  # names what cannot be pickled
        raise
    opts = function.options
    launcher = "slurm" if opts.remote == "slurm" else "ray" if opts.remote else "local"
    kind = CallKind(function, launcher, one_run=True)
    run_id = new_run_id(kind.name)
    run_dir = RunDir.create(opts.runs_dir, run_id).path
    with open(run_dir / JOB_FILE, "wb", opener=private_file_opener) as f:
        f.write(job)
    store = RunStore()
    store.create_run(kind.stored_run(run_id, run_dir, {**call_origin(), "detached_from": os.getpid()}))
    try:
        proc = start_supervisor("gpufleet.detached_run", run_id, store.home, run_dir)
    except BaseException as e:
        store.finish_run(run_id, FAILED, message=f"could not start the run: {e}")
        raise
    with contextlib.suppress(Exception):  # it already exited: the liveness check sees that
        store.update_run(run_id, supervisor_pid=proc.pid, supervisor_started=process_start_time(proc.pid))
    handle = StoredRunHandle(run_id, store.home)
    handle._popen = proc  # reaped by its handle; the run does not need the caller
    deadline = time.monotonic() + START_WAIT_S
    while not handle._started():
        if proc.poll() is not None or time.monotonic() > deadline:
            if handle.done():
                handle.result(0)  # raises why it could not start
            tail = (run_dir / LOG_FILE).read_text(errors="replace")[-2000:]
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            raise GpufleetError(f"the detached supervisor of the call did not start it; its log ({run_dir / LOG_FILE}) "
                                f"ends with:\n{tail}")  # fmt: skip
        time.sleep(0.05)
    print(f"gpufleet: run {run_id} runs detached (supervisor pid {proc.pid}); follow it with "
          f"`gpufleet logs {run_id} --follow`, wait for it with `handle.result()`", file=sys.stderr, flush=True)
    return handle
