"""A workload's MLflow runs are shown as they start (id and link), named by ``mlflow_run_name``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, cli_json, wait_state, write_workload

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def test_a_workload_prints_its_mlflow_run_at_submission_and_get_links_every_attempt(
    tmp_path: Path, home: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(
        tmp_path, experiment_name="links", mlflow_run_name="sft-try", max_retries=1,
        command='[ "$GPUFLEET_ATTEMPT" = 2 ] || exit 3',
    )  # fmt: skip
    rc, out, err = cli(capsys, "run", "-f", str(wl))
    assert rc == 0, err
    run_id = out.strip()
    (line,) = [ln for ln in err.splitlines() if ln.startswith("gpufleet: MLflow run ")]
    first = line.split()[3]
    assert " in experiment links: `mlflow ui --backend-store-uri " in line
    assert wait_state(store, run_id).state == "SUCCESS"
    run = cli_json(capsys, "get", run_id)
    assert run["mlflow_run_ids"][0] == first  # the first attempt logged into the run shown at submission
    assert [m["attempt"] for m in run["mlflow_runs"]] == [1, 2]
    assert all(m["run_id"] in m["link"] for m in run["mlflow_runs"])
    rc, text, _ = cli(capsys, "get", run_id)
    assert text.count("  mlflow: `mlflow ui --backend-store-uri ") == 2
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    one, two = (client.get_run(i) for i in run["mlflow_run_ids"])
    assert (one.info.run_name, one.info.status) == ("sft-try", "FAILED")
    assert (two.info.run_name, two.info.status) == ("sft-try-attempt-2", "FINISHED")
    assert one.data.tags["gpufleet.attempt"] == "1" and two.data.tags["gpufleet.attempt"] == "2"
    # watching shows each attempt's run as it starts
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch")
    assert rc == 0, err
    watched = cli_json(capsys, "get", out.splitlines()[0])
    assert f"gpufleet: attempt 2: MLflow run {watched['mlflow_run_ids'][1]}: " in err


def test_a_workload_canceled_before_it_starts_ends_its_mlflow_run(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path, command="sleep 30")
    rc, out, err = cli(capsys, "run", "-f", str(wl))
    first = [ln for ln in err.splitlines() if ln.startswith("gpufleet: MLflow run ")][0].split()[3]
    rc, _, _ = cli(capsys, "cancel", out.strip())
    assert wait_state(store, out.strip()).state == "CANCELED"
    status = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(first).info.status
    assert status == "KILLED"
