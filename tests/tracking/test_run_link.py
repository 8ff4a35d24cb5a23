"""The MLflow run of a call or workload is shown when it starts (id and link); run names; call secrets."""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.errors import LaunchConfigError
from gpufleet.secrets import SecretError
from gpufleet.tracking.links import run_link, ui_command

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def test_links_name_the_server_page_or_the_command_that_serves_the_store() -> None:
    assert run_link("https://user:pw@mlflow.example.com:8443/", "r1", "7") == (
        "https://mlflow.example.com:8443/#/experiments/7/runs/r1"
    )
    assert run_link("http://10.0.0.5:5000", "r1") == "http://10.0.0.5:5000/#/runs/r1"
    assert run_link("sqlite:////tmp/my store/mlflow.db", "r1", "3") == (
        "`mlflow ui --backend-store-uri 'sqlite:////tmp/my store/mlflow.db'`, then "
        "http://127.0.0.1:5000/#/experiments/3/runs/r1"
    )
    assert ui_command("/data/mlruns") == "mlflow ui --backend-store-uri /data/mlruns"
    assert ui_command("databricks") is None and "databricks" in run_link("databricks", "r1")


def _token_call() -> dict:
    import hashlib
    import os

    token = os.environ["MY_TOKEN"]
    print(f"rank {os.environ['RANK']} token {token}", flush=True)
    return {"sha": hashlib.sha256(token.encode()).hexdigest(), "names": os.environ["GPUFLEET_SECRETS"]}


def test_a_call_prints_its_mlflow_run_takes_a_run_name_and_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    value = "gf-call-" + uuid.uuid4().hex
    monkeypatch.setenv("GF_CALL_SECRET", value)
    experiment = f"test-{uuid.uuid4().hex[:10]}"
    f = distributed(
        _token_call, gpus=2, gpu_type="cpu", log_ranks="all", experiment_name=experiment, run_name="my-call",
        secrets={"MY_TOKEN": {"env": "GF_CALL_SECRET"}}, runs_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    handle = f.submit()
    results = handle.result(timeout=120)
    assert [r["sha"] for r in results] == [hashlib.sha256(value.encode()).hexdigest()] * 2
    assert results[0]["names"] == "MY_TOKEN"
    out, err = capfd.readouterr()
    (line,) = [ln for ln in err.splitlines() if ln.startswith("gpufleet: MLflow run ")]
    assert f"gpufleet: MLflow run {handle.mlflow_run_id} in experiment {experiment}: " in line
    assert re.search(r"`mlflow ui --backend-store-uri \S+`, then http://127\.0\.0\.1:5000/#/experiments/\d+/runs/", line)
    assert "[rank 1] rank 1 token ***" in out and value not in out + err
    logs = list((tmp_path / "runs").rglob("rank-*.log"))
    assert logs and all(value.encode() not in p.read_bytes() for p in logs)
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(handle.mlflow_run_id)
    assert run.info.run_name == "my-call"
    assert run.data.tags.get("gpufleet.git.commit")  # this test file is in a git checkout
    assert value not in str(run.data.params) + str(run.data.tags)


def test_call_secrets_are_checked_and_read_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchConfigError, match="a secret's source is"):
        distributed(_token_call, gpu_type="cpu", gpus=1, secrets={"MY_TOKEN": "plain"})
    f = distributed(_token_call, gpu_type="cpu", gpus=1, tracking=False, secrets={"MY_TOKEN": {"env": "GF_UNSET_X"}})
    monkeypatch.delenv("GF_UNSET_X", raising=False)
    with pytest.raises(SecretError, match="GF_UNSET_X is not set"):
        f.distributed()
    with pytest.warns(UserWarning, match="looks like a secret"):
        distributed(_token_call, gpu_type="cpu", gpus=1, env={"WANDB_API_KEY": "x"})


def _one() -> int:
    return 1


def test_later_calls_say_where_their_run_is_in_one_short_line(capfd: pytest.CaptureFixture[str]) -> None:
    f = distributed(_one, gpus=1, gpu_type="cpu", experiment_name=f"test-{uuid.uuid4().hex[:10]}", stream_logs=False)
    first = f.submit()
    first.result(timeout=120)
    second = f.submit()
    second.result(timeout=120)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("gpufleet: MLflow run ")]
    assert len(lines) == 2 and first.mlflow_run_id in lines[0] and "mlflow ui --backend-store-uri" in lines[0]
    assert lines[1] == f"gpufleet: MLflow run {second.mlflow_run_id} (experiment {f.options.experiment_name}, as above)"
    assert len(lines[1]) < 100
