"""Constants and assertions shared by the checkpoint tests."""

from __future__ import annotations

from gpufleet import distributed
from tests.checkpoint.training import train

N = 5  # steps before the interruption; 2 ranks read ~8 batches per epoch, so runs cross an epoch
TOTAL = 2 * N + 6

train_on_2 = distributed(gpus=2, gpu_type="cpu", timeout=240, tracking=False)(train)


def assert_same_as_straight(straight: list[dict], before: list[list[dict]], after: list[dict], first_step: int = 1) -> None:
    """The interrupted run's records (``before`` per rank, then ``after``) equal the reference."""
    for rank in range(2):
        resumed = before[rank] + after[rank]["records"]
        reference = [r for r in straight[rank]["records"] if r["step"] >= first_step]
        assert [r["step"] for r in resumed] == [r["step"] for r in reference]
        assert [r["ids"] for r in resumed] == [r["ids"] for r in reference], f"rank {rank}: data order differs"
        assert [r["loss"] for r in resumed] == [r["loss"] for r in reference], f"rank {rank}: losses differ"
        for name, value in straight[rank]["params"].items():
            got = after[rank]["params"][name]
            assert got.dtype == value.dtype and torch_equal(got, value), f"rank {rank}: {name} differs"


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]
