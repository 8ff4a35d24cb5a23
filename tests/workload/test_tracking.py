"""MLflow for workloads: a run per attempt with parameters, metrics from the command, logs."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from gpufleet.runs.store import RunStore
from tests.workload.helpers import cli, write_workload

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import mlflow
    attempt = int(os.environ["GPUFLEET_ATTEMPT"])
    run_id = os.environ["MLFLOW_RUN_ID"]
    mlflow.log_metric("loss", 1.0 / attempt, step=attempt)  # logs into $MLFLOW_RUN_ID
    print(f"attempt {attempt} logged into {run_id}", flush=True)
    sys.exit(0 if attempt == 2 else 5)
    """
)


@pytest.mark.slow
def test_each_attempt_is_an_mlflow_run_with_params_metrics_and_logs(
    tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    (tmp_path / "log_metric.py").write_text(SCRIPT)
    wl = write_workload(
        tmp_path,
        experiment_name="workload-tracking",
        code_source={"root_path": "."},
        command="python log_metric.py",
        parameters={"lr": 0.01, "optim": {"name": "adamw"}},
        max_retries=1,
    )
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch")
    assert rc == 0, err
    run = store.get(out.splitlines()[0])
    ids = run.mlflow_run_ids()
    assert len(ids) == 2 and ids[0] != ids[1]
    assert f"attempt 2 logged into {ids[1]}" in out
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    first, second = (client.get_run(i) for i in ids)
    assert first.info.status == "FAILED" and second.info.status == "FINISHED"
    assert client.get_experiment(second.info.experiment_id).name == "workload-tracking"
    assert second.data.params["lr"] == "0.01" and second.data.params["optim.name"] == "adamw"
    assert second.data.metrics["loss"] == 0.5
    assert second.data.tags["gpufleet.run_id"] == run.id
    # the attempt's number: a tag and a parameter, as a call's (tests/tracking/test_decorator.py)
    assert [(r.data.tags["gpufleet.attempt"], r.data.params["gpufleet.attempt"]) for r in (first, second)] == [
        ("1", "1"), ("2", "2")]  # fmt: skip
    artifacts = {a.path for a in client.list_artifacts(ids[1], "logs")}
    assert "logs/node-0.log" in artifacts
    assert any(a.path == "workload.yaml" for a in client.list_artifacts(ids[1]))


def test_no_tracking_leaves_mlflow_out(tmp_path: Path, store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path, command='echo "run=${MLFLOW_RUN_ID:-none}"')
    rc, out, err = cli(capsys, "run", "-f", str(wl), "--watch", "--no-tracking")
    assert rc == 0, err
    assert "[node 0] run=none" in out
    assert store.get(out.splitlines()[0]).mlflow_run_ids() == []


def test_an_interrupted_submission_ends_canceled_and_runs_nothing(
    tmp_path: Path, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while `gpufleet run` opens the MLflow run: the supervisor already started, the command never runs."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from gpufleet.workload import handoff
    from gpufleet.workload.submit import submit_run
    from tests.workload.helpers import wait_state

    def interrupted(proc, handoff):  # the pipe closes before the handoff is written
        proc.stdin.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(handoff, "hand_over", interrupted)
    marker = tmp_path / "ran"
    wl = write_workload(tmp_path, experiment_name="interrupted", command=f"touch {marker}")
    with pytest.raises(KeyboardInterrupt):
        submit_run(wl, home=store.home)
    (run,) = [r for r in store.list(states=None) if r.experiment == "interrupted"]
    done = wait_state(store, run.id)
    assert done.state == "CANCELED" and "ended before it handed the run over" in (done.message or ""), done
    assert not marker.exists()
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    (mlflow_run,) = client.search_runs(
        [client.get_experiment_by_name("interrupted").experiment_id], filter_string=f"tags.`gpufleet.run_id` = '{run.id}'"
    )
    assert mlflow_run.info.status == "KILLED"  # not left RUNNING
