"""The launch core on real GPUs (NCCL). Skipped where no NVIDIA GPU is visible."""

from __future__ import annotations

import pytest

from gpufleet import distributed, runtime
from gpufleet.errors import GPUUnavailableError
from gpufleet.launch.gpus import list_gpus

GPUS = list_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 NVIDIA GPUs"),
]


def _hello():
    import torch
    import torch.distributed as dist

    dev = runtime.setup()
    t = torch.tensor([float(runtime.get_global_rank() + 1)], device=dev)
    dist.all_reduce(t)
    return {
        "rank": runtime.get_global_rank(),
        "backend": dist.get_backend(),
        "device": str(dev),
        "name": torch.cuda.get_device_name(dev),
        "sum": t.item(),
    }


def test_every_gpu_gets_a_rank_and_nccl_all_reduce_works():
    import sys

    out = distributed(gpus=2, tracking=False)(_hello).distributed()
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["backend"] == "nccl" and r["sum"] == 3.0 for r in out)
    assert [r["device"] for r in out] == ["cuda:0", "cuda:1"]
    # the caller never touched CUDA (GPU discovery goes through NVML)
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()


def test_gpu_type_is_checked_against_the_real_devices():
    short = "H200" if "H200" in GPUS[0].name else GPUS[0].name.split()[-1]
    assert distributed(gpus=2, gpu_type=short.lower(), tracking=False)(_hello).distributed()[1]["sum"] == 3.0
    with pytest.raises(GPUUnavailableError, match=r"gpu_type='B200' was asked for, but this machine has"):
        distributed(gpus=1, gpu_type="B200", tracking=False)(_hello).distributed()
    with pytest.raises(GPUUnavailableError, match=rf"gpus={len(GPUS) + 1} was asked for"):
        distributed(gpus=len(GPUS) + 1, tracking=False)(_hello).distributed()


def test_a_caller_that_already_uses_cuda_still_launches_on_every_gpu():
    """A notebook kernel that already put tensors on a GPU (CUDA initialised) can still launch.

    Workers are fresh interpreters, so the caller's CUDA context is not inherited (a forked child of an
    initialised CUDA process would fail with "Cannot re-initialize CUDA in forked subprocess").
    """
    import torch

    held = torch.ones(1024, 1024, device="cuda:0")  # the caller's own GPU work, kept alive
    assert torch.cuda.is_initialized()
    out = distributed(gpus=2, tracking=False)(_hello).distributed()
    assert [r["device"] for r in out] == ["cuda:0", "cuda:1"]
    assert all(r["sum"] == 3.0 for r in out)
    assert held.sum().item() == 1024 * 1024
