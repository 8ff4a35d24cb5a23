"""Rehearsing a failure on purpose: a rank killed at step 30 of 40, one retry, nothing lost."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gpufleet import distributed
from tests.checkpoint.helpers import torch_equal, train_on_2
from tests.checkpoint.training import train


@pytest.mark.slow
def test_kill_rank_1_at_step_30_resumes_from_the_last_checkpoint_and_ends_bit_identical(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    reference = train_on_2.distributed(str(tmp_path / "reference"), str(data_dir), 40, save_every=10)

    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    experiment = f"rehearsal-{uuid.uuid4().hex[:8]}"
    rehearsed = distributed(
        train, gpus=2, gpu_type="cpu", timeout=240, max_retries=1, experiment_name=experiment,
        faults=["kill:rank=1:step=30"],  # batch 30 is taken, then rank 1 is SIGKILLed
    )
    after = rehearsed.distributed(str(tmp_path / "ckpt"), str(data_dir), 40, save_every=10)

    assert [r["attempt"] for r in after] == ["2", "2"]  # the retry (attempt 2) finished the run
    assert [r["resumed"] for r in after] == [20, 20]  # the newest complete checkpoint before the kill
    assert [r["step"] for r in after[0]["records"]] == list(range(21, 41))
    for rank in range(2):
        for name, value in reference[rank]["params"].items():
            assert torch_equal(after[rank]["params"][name], value), f"rank {rank}: {name} differs"
        assert [r["loss"] for r in after[rank]["records"]] == [
            r["loss"] for r in reference[rank]["records"] if r["step"] > 20
        ]

    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"])
    assert [r.data.params["gpufleet.attempt"] for r in runs] == ["1", "2"]
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
