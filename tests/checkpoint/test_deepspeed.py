"""A DeepSpeed engine is checkpointed behind the same manager and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpufleet import distributed
from gpufleet.checkpoint import list_checkpoints, load_model_state_dict
from tests.checkpoint.training import train_deepspeed
from tests.proc import leftover_worker_processes

pytest.importorskip("deepspeed")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # three launches, the first one compiling
def test_deepspeed_engine_saves_resumes_and_exports(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = distributed(gpus=2, gpu_type="cpu", timeout=600, tracking=False)(train_deepspeed)  # the first start compiles an op

    first = run.distributed(str(ckpt), 2, 4)
    [info] = list_checkpoints(ckpt)
    assert info.complete and info.step == 2 and info.marker["format"] == "deepspeed"

    second = run.distributed(str(ckpt), 99, 4)
    assert [r["resumed"] for r in second] == [2, 2]
    for rank in range(2):
        assert second[rank]["losses"] == {s: first[rank]["losses"][s] for s in (3, 4)}
        assert second[rank]["lr"] == first[rank]["lr"]

    # the ZeRO partitions consolidate into the full weights the engine had at step 2
    exported = load_model_state_dict(info.path)
    for name, value in first[0]["saved_params"].items():
        assert torch.equal(exported[name].to(value.dtype), value), name


@pytest.mark.slow
@pytest.mark.timeout(1200)  # three launches, the first one compiling
def test_deepspeed_resume_skips_a_checkpoint_with_a_missing_zero_partition(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = distributed(gpus=2, gpu_type="cpu", timeout=600, tracking=False)(train_deepspeed)  # the first start compiles an op

    first = run.distributed(str(ckpt), 2, 4)  # saves step 2
    run.distributed(str(ckpt), 4, 4)  # resumes from 2, saves step 4
    assert [c.step for c in list_checkpoints(ckpt) if c.complete] == [2, 4]
    partition = ckpt / "step-4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    partition.unlink()

    third = run.distributed(str(ckpt), 99, 4)
    assert [r["resumed"] for r in third] == [2, 2]
    for rank in range(2):
        [(step, reason)] = third[rank]["skipped"]
        assert step == 4 and f"{partition.name} is missing" in reason, reason
        # resumed exactly from step 2: the same losses and learning rate as the first run
        assert third[rank]["losses"] == {s: first[rank]["losses"][s] for s in (3, 4)}
        assert third[rank]["lr"] == first[rank]["lr"]
    assert not leftover_worker_processes(wait_s=10.0)
