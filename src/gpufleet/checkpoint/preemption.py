"""Whether the scheduler asked the job to stop soon: Slurm's signal before its time limit or a preemption.

A Slurm attempt's batch step turns ``SIGUSR1`` (``--signal=B:USR1@N``) into a file whose path every
rank has in ``GPUFLEET_PREEMPT_FILE`` (:mod:`gpufleet.launch.slurm_job`). :func:`preemption_requested`
reads it and, in a process group, lets every rank agree (one tiny ``all_reduce``), so that all of them
checkpoint at the same step. Without that variable (local runs, Ray) it is False at once, with no
collective.
"""

from __future__ import annotations

import os
from typing import Any

from ..launch.slurm_job import PREEMPT_FILE_ENV


def preemption_requested(process_group: Any = None) -> bool:
    """True once the scheduler announced this job's end, agreed by every rank of ``process_group``.

    Call it on every rank at the same point of each step (it is a collective under Slurm).
    """
    path = os.environ.get(PREEMPT_FILE_ENV)
    if not path:
        return False
    here = os.path.exists(path)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return here
    import torch

    flag = torch.tensor([1 if here else 0], dtype=torch.int32)
    backend = str(dist.get_backend(process_group))
    if "gloo" not in backend and torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    return bool(flag.item())
