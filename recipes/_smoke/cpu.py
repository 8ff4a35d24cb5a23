"""Switches that let GPU-only framework paths run on CPU workers in smoke tests.

Each one is applied only when no GPU is present; on GPUs the frameworks run untouched.
"""

from __future__ import annotations


def accelerate_multi_process_on_cpu() -> None:
    """Make Accelerate see a multi-process CPU run (gloo) when a DeepSpeed config is given.

    Accelerate 1.15 only counts processes for DeepSpeed on accelerators; on CPU it would see a
    single process (``num_processes == 1``, backend ``None``) while DeepSpeed itself runs on two,
    and its metric gathers then fail. Reporting the gloo multi-CPU backend fixes the count;
    the ``DEEPSPEED`` distributed type is still set afterwards, so the engine is DeepSpeed's.
    """
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available():
        return

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):  # noqa: ANN001, ANN202
        return "gloo", DistributedType.MULTI_CPU

    PartialState._prepare_backend = _prepare_backend
