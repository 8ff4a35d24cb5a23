"""A DeepSpeed engine is checkpointed behind the same manager and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpufleet import distributed
from gpufleet.checkpoint import list_checkpoints, load_model_state_dict
from tests.checkpoint.training import train_deepspeed

pytest.importorskip("deepspeed")


@pytest.mark.slow
def test_deepspeed_engine_saves_resumes_and_exports(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = distributed(gpus=2, gpu_type="cpu", timeout=300, tracking=False)(train_deepspeed)

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
