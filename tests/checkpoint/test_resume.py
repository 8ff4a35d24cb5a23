"""Exact resume across a SIGKILL of every rank, on 2 CPU ranks through gpufleet's launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.checkpoint import list_checkpoints
from gpufleet.errors import WorkerSignalError
from tests.checkpoint.helpers import TOTAL, N, assert_same_as_straight, train_on_2


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(
    tmp_path: Path, data_dir: Path, straight: list[dict], async_save: bool
) -> None:
    ckpt, records = tmp_path / "ckpt", tmp_path / "records"
    records.mkdir()
    with pytest.raises(WorkerSignalError) as err:
        train_on_2.distributed(
            str(ckpt), str(data_dir), TOTAL, save_every=2, stop_after=N, kill_after_stop=True,
            async_save=async_save, record_dir=str(records), tag="first",
        )
    assert "SIGKILL" in str(err.value)
    before = [json.loads((records / f"first-rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in before[0]] == list(range(1, N + 1))
    assert [c.step for c in list_checkpoints(ckpt) if c.complete][-1] == N

    after = train_on_2.distributed(str(ckpt), str(data_dir), TOTAL, async_save=async_save, tag="second")
    assert [r["resumed"] for r in after] == [N, N]
    assert_same_as_straight(straight, before, after)
    # the straight run's data crossed an epoch boundary, so the loader's epoch was resumed too
    seen = [i for r in straight[0]["records"] + straight[1]["records"] for i in r["ids"]]
    assert len(seen) > len(set(seen))


@pytest.mark.slow
def test_max_retries_relaunches_and_resumes_from_the_newest_checkpoint(
    tmp_path: Path, data_dir: Path, straight: list[dict]
) -> None:
    ckpt, records = tmp_path / "ckpt", tmp_path / "records"
    records.mkdir()
    retrying = train_on_2.with_overrides(max_retries=1)
    after = retrying.distributed(
        str(ckpt), str(data_dir), TOTAL, save_every=2, stop_after=N, kill_after_stop=True,
        kill_only_on_attempt="1", record_dir=str(records), tag="retry",
    )
    assert [r["attempt"] for r in after] == ["2", "2"]
    assert [r["resumed"] for r in after] == [N, N]
    before = [json.loads((records / f"retry-rank{r}.json").read_text()) for r in range(2)]
    assert_same_as_straight(straight, before, after)
