"""Checkpoints load onto another number of ranks and across DDP, FSDP2 and a plain module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpufleet import distributed
from tests.checkpoint.training import train_fixed_batches


def _assert_states_equal(got: dict, expected: dict) -> None:
    assert got["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert got["optim"].keys() == expected["optim"].keys() and expected["optim"]
    for name, state in expected["optim"].items():
        for key, value in state.items():
            assert torch.equal(got["optim"][name][key], value), (name, key)
    assert got["lr"] == expected["lr"]


@pytest.mark.slow
def test_save_on_2_ranks_load_on_3_and_on_1_across_ddp_fsdp2_and_plain(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run = distributed(gpu_type="cpu", timeout=240, tracking=False)(train_fixed_batches)

    on_2 = run.with_overrides(gpus=2).distributed(ckpt, "ddp", 2)
    assert [r["resumed"] for r in on_2] == [0, 0]
    # each DDP rank handed DCP (and would stage) only its share of the replicated state
    full = on_2[0]["full_state_bytes"]
    shares = [r["tensor_bytes"] for r in on_2]
    assert sum(shares) == full and max(shares) <= 0.6 * full, (shares, full)

    on_3 = run.with_overrides(gpus=3).distributed(ckpt, "fsdp2", 1)  # DDP (2 ranks) -> FSDP2 (3 ranks)
    assert [r["resumed"] for r in on_3] == [2, 2, 2]
    for rank in range(3):
        _assert_states_equal(on_3[rank]["loaded"], on_2[0]["final"])
    assert not torch.equal(on_3[0]["final"]["params"]["0.weight"], on_2[0]["final"]["params"]["0.weight"])

    on_1 = run.with_overrides(gpus=1).distributed(ckpt, "none", 1)  # FSDP2 (3 ranks) -> a plain module
    assert on_1[0]["resumed"] == 3
    _assert_states_equal(on_1[0]["loaded"], on_3[0]["final"])
