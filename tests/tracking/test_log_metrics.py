"""gpufleet.tracking.log_metrics: rank 0's training metrics into the call's MLflow run, a no-op elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from mlflow import MlflowClient

from gpufleet import distributed

REPO = Path(__file__).resolve().parents[2]
CPU = {"gpus": 2, "gpu_type": "cpu"}


def three_steps() -> list[bool]:
    import torch

    from gpufleet.tracking import log_metrics

    logged = [log_metrics({"loss": torch.tensor([1.0 / (step + 1)]), "lr": 0.1}, step=step) for step in range(3)]
    logged.append(log_metrics({"seen": 7}, step=2, all_ranks=True))
    return logged


def test_rank_0_logs_into_the_call_run_and_other_ranks_only_when_asked() -> None:
    exp = f"test-log-metrics-{uuid.uuid4().hex[:8]}"
    handle = distributed(three_steps, experiment_name=exp, **CPU).submit()
    assert handle.result(timeout=120) == [[True, True, True, True], [False, False, False, True]]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    history = client.get_metric_history(handle.mlflow_run_id, "loss")
    assert [(m.step, round(m.value, 3)) for m in history] == [(0, 1.0), (1, 0.5), (2, 0.333)]
    metrics = client.get_run(handle.mlflow_run_id).data.metrics
    assert metrics["lr"] == 0.1 and metrics["rank0/seen"] == 7 and metrics["rank1/seen"] == 7


def test_a_no_op_outside_a_tracked_run_without_importing_mlflow() -> None:
    code = (
        "import sys; from gpufleet.tracking import log_metrics; "
        "print(log_metrics({'loss': 1.0}, step=1), 'mlflow' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_RUN")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "False"]
    env["MLFLOW_RUN_ID"], env["GPUFLEET_TRACKING"] = "0123", "0"  # tracking switched off
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_store_that_refuses_warns_once_and_training_goes_on() -> None:
    code = (
        "from gpufleet.tracking import log_metrics; "
        "print([log_metrics({'loss': 1.0}, step=s) for s in range(3)])"
    )
    env = {**os.environ, "MLFLOW_RUN_ID": "no-such-run"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[False, False, False]"
    assert done.stderr.count("could not log metrics") == 1, done.stderr


def test_the_mlp_recipe_logs_its_loss_and_says_where_everything_is(tmp_path: Path) -> None:
    env = {**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")}
    env.pop("MLFLOW_TRACKING_URI")  # the default store in GPUFLEET_HOME, as for a new user
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "pytorch-ddp-mlp" / "train.py"), "--cpu", "--epochs", "3"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    run_id = re.search(r"^run id: +(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    run_dir = tmp_path / "home" / "runs" / run_id
    assert f"run folder: {run_dir}\n" in out
    assert f"rank 0 log: {run_dir / 'rank-0.log'}\nrank 1 log: {run_dir / 'rank-1.log'}\n" in out
    assert (run_dir / "rank-1.log").exists()
    uri = f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    assert f"  {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {uri}\n" in out  # runs unactivated
    mlflow_run = re.search(r"^MLflow run: (\w+)", out, re.M).group(1)  # type: ignore[union-attr]
    history = MlflowClient(uri).get_metric_history(mlflow_run, "loss")
    assert [m.step for m in history] == [0, 1, 2] and history[-1].value < history[0].value
