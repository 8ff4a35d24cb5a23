"""Whether the scheduler asked the job to stop soon: Slurm's signal before its time limit, or a preemption.

Every rank of a Slurm workload has ``GPUFLEET_PREEMPT_FILE``: a file in the attempt's folder that
means "checkpoint now, the job ends soon" once it exists (:mod:`gpufleet.launch.engines.slurm.job`). Two
things write it:

- the job's batch step, on ``SIGUSR1`` (``--signal=B:USR1@N``: the time limit is near, or a
  preemption where the site sends the user's signal);
- a rank itself, on ``SIGTERM``, once :func:`watch_termination` runs in it (every
  :class:`~gpufleet.checkpoint.CheckpointManager` does): that is how Slurm starts a preemption's
  grace time. The rank does not die of that signal: it checkpoints at its next step and ends.
  A ``SIGTERM`` sent when gpufleet itself ends the job (cancel, timeout, hang: the attempt's
  ``canceled.json`` exists) ends the rank at once, as it would without the handler.

:func:`preemption_requested` reads it and, in a process group, lets every rank agree (one tiny
``all_reduce``), so that all of them checkpoint at the same step. Without that variable (local
runs, Ray) it is False at once, with no collective, and no signal handler is installed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import runtime
from ..launch.engines.slurm.job import CANCELED_FILE
from ..launch.node import envcontract

__all__ = ["preemption_requested", "watch_termination"]

logger = logging.getLogger(__name__)

#: When this process got the scheduler's SIGTERM (None: not yet).
_terminated_at: float | None = None
# The last flag collective's work, kept until the next one: freed by the training thread, never by
# gloo's. Gloo's worker thread marks a collective done, then drops its reference to the work and
# its tensors; when that reference is the last one, dropping it takes the GIL, and a thread that
# takes the GIL while the interpreter exits is ended by Python, which aborts the rank
# ("terminate called without an active exception", SIGABRT) after a run that trained to its end.
_last_work: Any = None


def _on_sigterm(signum: int, _frame: object) -> None:
    global _terminated_at
    path = Path(os.environ.get(envcontract.PREEMPT_FILE, ""))
    if (path.parent / CANCELED_FILE).exists():  # gpufleet ends the attempt: end now, as without a handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _terminated_at is not None:  # the launcher passing the same signal on (torchrun does)
        return
    _terminated_at = time.time()
    rank = runtime.rank_text("?")
    if not path.exists():
        from ..results import write_atomic

        try:
            record = {"time": _terminated_at, "job": os.environ.get("SLURM_JOB_ID"), "signal": "TERM", "rank": rank}
            write_atomic(path, json.dumps(record).encode())
        except OSError:
            pass  # this rank still checkpoints: the flag above is its own
    print(f"gpufleet: rank {rank} got SIGTERM from the scheduler (a preemption, or the job is being ended); "
          "it checkpoints at its next step and ends", file=sys.stderr, flush=True)  # fmt: skip


def watch_termination() -> bool:
    """Make the scheduler's ``SIGTERM`` a request to checkpoint in this rank (Slurm workloads only).

    Installs a handler when ``GPUFLEET_PREEMPT_FILE`` is set, this is the main thread, and ``SIGTERM``
    has its default action (a handler of the training code's own is left alone). Returns whether
    ``SIGTERM`` is now watched.
    """
    if not os.environ.get(envcontract.PREEMPT_FILE) or threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    if current not in (signal.SIG_DFL, None):
        logger.debug("SIGTERM has a handler of its own (%r); a preemption's SIGTERM is left to it", current)
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def preemption_requested(process_group: Any = None) -> bool:
    """True once the scheduler announced this job's end, agreed by every rank of ``process_group``.

    Call it on every rank at the same point of each step (it is a collective under Slurm).
    """
    path = os.environ.get(envcontract.PREEMPT_FILE)
    if not path:
        return False
    here = _terminated_at is not None or os.path.exists(path)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return here
    import torch

    flag = torch.tensor([1 if here else 0], dtype=torch.int32)
    backend = str(dist.get_backend(process_group))
    if "gloo" not in backend and torch.cuda.is_available():
        flag = flag.cuda()
    global _last_work
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group, async_op=True)
    work.wait()
    _last_work = work  # see _last_work
    return bool(flag.item())
