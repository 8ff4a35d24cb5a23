"""A rank killed in the middle of a save leaves a torn checkpoint; resume skips it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.checkpoint import list_checkpoints
from gpufleet.errors import WorkerSignalError
from tests.checkpoint.helpers import TOTAL, assert_same_as_straight, train_on_2
from tests.checkpoint.training import train_and_die_in_save

die_on_2 = distributed(gpus=2, gpu_type="cpu", timeout=240, tracking=False)(train_and_die_in_save)


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_a_torn_checkpoint_that_resume_skips(
    tmp_path: Path, data_dir: Path, straight: list[dict]
) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(WorkerSignalError) as err:
        die_on_2.distributed(str(ckpt), str(data_dir), TOTAL, save_every=2, die_at_step=4, tag="torn")
    assert err.value.rank == 1 and "SIGKILL" in str(err.value)

    found = {c.step: c for c in list_checkpoints(ckpt)}
    assert sorted(found) == [2, 4]
    assert found[2].complete and not found[4].complete
    torn = found[4].path
    assert list(torn.glob("*.distcp")), "the dying rank wrote its shard before being killed"
    assert not (torn / ".metadata").exists() and not (torn / "COMPLETE.json").exists()

    after = train_on_2.distributed(str(ckpt), str(data_dir), TOTAL, save_every=2, tag="after-torn")
    assert [r["resumed"] for r in after] == [2, 2]
    # from step 2 on, the run is the uninterrupted one: same data, losses and final weights
    assert_same_as_straight(straight, [[], []], after, first_step=3)
    # the torn step-4 folder was replaced by a complete one when step 4 was saved again
    complete = [c.step for c in list_checkpoints(ckpt) if c.complete]
    assert complete == [TOTAL - 4, TOTAL - 2, TOTAL]  # keep_last=3
