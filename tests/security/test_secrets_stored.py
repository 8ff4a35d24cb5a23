"""Item: a secret quoted by a failing run's exception is masked where gpufleet stores the error; `.env` stays home."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.runs.store import RunStore
from gpufleet.workload.snapshot import scan


def _refused() -> None:
    import os

    raise PermissionError(f"401 for {os.environ['MY_TOKEN']}")


def test_a_secret_in_a_calls_exception_is_masked_in_the_store_and_mlflow(tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    token = "gf-secret-" + secrets.token_hex(12)
    monkeypatch.setenv("GF_SECURITY_TOKEN", token)
    monkeypatch.delenv("GPUFLEET_TRACKING", raising=False)
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    f = distributed(_refused, gpus=1, gpu_type="cpu", stream_logs=False, experiment_name="masked",
                    secrets={"MY_TOKEN": {"env": "GF_SECURITY_TOKEN"}})  # fmt: skip
    with pytest.raises(PermissionError) as info:
        f.distributed()
    assert token in str(info.value)  # the caller's own exception is the caller's
    (run,) = RunStore(tmp_path / "home").list(states=None, limit=None)
    assert run.message == "PermissionError: 401 for ***", run.message
    (tracked,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("masked").experiment_id])
    error = mlflow.artifacts.load_text(f"{tracked.info.artifact_uri}/error.txt")
    assert "PermissionError: 401 for ***" in error and token not in error
    for log in Path(run.run_dir).glob("rank-*.log"):
        assert token not in log.read_text()


def test_a_secret_in_a_workload_attempts_error_is_masked_in_what_is_stored(tmp_path):
    from gpufleet.launch.spec import LaunchSpec
    from gpufleet.secrets import secret_env
    from gpufleet.states import FAILED
    from gpufleet.workload.attempts import attempt_end
    from tests.unit.test_controller import FakeClock, FakeGroup

    token = "gf-secret-" + secrets.token_hex(12)
    group = FakeGroup(tmp_path, FakeClock(), [])
    group.spec = LaunchSpec(group.run_id, 1, env=secret_env({"MY_TOKEN": token}))
    end = attempt_end(group, FAILED, RuntimeError(f"the registry said 401 for {token}"), None, "canceled")
    assert end.message == "run failed: the registry said 401 for ***"


def test_a_dotenv_file_is_not_copied_into_the_snapshot_unless_named(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / ".env").write_text("HF_TOKEN=hf_secret\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / ".env.local").write_text("WANDB_API_KEY=x\n")
    (tmp_path / "conf" / "env.yaml").write_text("a: 1\n")
    assert [e.rel for e in scan(tmp_path)] == ["conf/env.yaml", "train.py"]
    assert [e.rel for e in scan(tmp_path, ["train.py", ".env"])] == [".env", "train.py"]  # named: copied
    # gpufleet run copies what scan() lists (workload/submit.py)
