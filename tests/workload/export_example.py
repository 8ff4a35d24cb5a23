"""A module-level @distributed function, exported as source by tests/workload/test_export.py."""

from __future__ import annotations

from gpufleet import distributed, runtime


@distributed(gpus=2, gpu_type="cpu", tracking=False, stream_logs=False)
def rank_sum(base: int, *, scale: float = 1.0) -> dict:
    import torch
    import torch.distributed as dist

    runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": runtime.get_global_rank(), "world": runtime.get_world_size(), "value": base + scale * t.item()}
