"""start_tracked_run in this process: store, experiment, params, config, status, nesting, fallbacks."""

from __future__ import annotations

import os
import sys
import uuid
import warnings

import pytest

from gpufleet.tracking import (
    DATA_WAIT_METRIC,
    data_wait,
    default_tracking_uri,
    flatten_params,
    flush_data_wait,
    log_data_wait,
    start_tracked_run,
)
from gpufleet.tracking import runs as runs_module

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def _experiment() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client() -> MlflowClient:
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def test_flatten_params_nests_stringifies_and_truncates() -> None:
    flat = flatten_params(
        {"optim": {"lr": 0.001, "betas": [0.9, 0.95]}, "name": "x" * 7000, "bad name!": None, "empty": {}}
    )
    assert flat["optim.lr"] == "0.001"
    assert flat["optim.betas"] == "[0.9, 0.95]"
    assert len(flat["name"]) == 6000
    assert flat["bad name_"] == "None"
    assert flat["empty"] == "{}"


def test_run_has_params_config_tags_and_env(client: MlflowClient) -> None:
    exp = _experiment()
    config = {"compute": {"num_accelerators": 2}, "parameters": {"lr": 2e-5, "steps": [1, 2]}}
    with start_tracked_run(exp, "attempt-0", {"gpus": 2}, tags={"gpufleet.run_id": "r1"}) as run:
        run.log_config(config)
        env = run.env()
    assert env["MLFLOW_RUN_ID"] == run.run_id
    assert env["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]
    assert env["MLFLOW_EXPERIMENT_ID"] == client.get_experiment_by_name(exp).experiment_id
    got = client.get_run(run.run_id)
    assert got.info.run_name == "attempt-0"
    assert got.info.status == "FINISHED"
    assert got.data.params == {
        "gpus": "2",
        "compute.num_accelerators": "2",
        "parameters.lr": "2e-05",
        "parameters.steps": "[1, 2]",
    }
    assert got.data.tags["gpufleet.run_id"] == "r1"
    assert got.data.tags["gpufleet.status"] == "SUCCESS"
    assert "mlflow.parentRunId" not in got.data.tags
    text = mlflow.artifacts.load_text(f"{got.info.artifact_uri}/config.yaml")
    assert "num_accelerators: 2" in text and "lr: 2.0e-05" in text


@pytest.mark.parametrize(
    ("status", "mlflow_status"),
    [("FAILED", "FAILED"), ("CANCELED", "KILLED"), ("TIMEDOUT", "FAILED")],
)
def test_final_status_is_mapped(client: MlflowClient, status: str, mlflow_status: str) -> None:
    with start_tracked_run(_experiment(), "r", {}, system_metrics=False) as run:
        run.set_status(status)
    got = client.get_run(run.run_id)
    assert got.info.status == mlflow_status
    assert got.data.tags["gpufleet.status"] == status


def test_an_exception_marks_the_run_failed_and_bad_status_is_refused(client: MlflowClient) -> None:
    with pytest.raises(ZeroDivisionError):
        with start_tracked_run(_experiment(), "r", {}, system_metrics=False) as run:
            with pytest.raises(ValueError, match="SUCCESS, FAILED, CANCELED, TIMEDOUT"):
                run.set_status("DONE")
            1 / 0  # noqa: B018
    assert client.get_run(run.run_id).info.status == "FAILED"


def test_nested_under_the_active_run(client: MlflowClient) -> None:
    uri = os.environ["MLFLOW_TRACKING_URI"]
    mlflow.set_tracking_uri(uri)
    exp_id = client.create_experiment(_experiment())
    try:
        with mlflow.start_run(experiment_id=exp_id) as parent:
            with start_tracked_run(None, "child", {}, system_metrics=False) as run:
                pass
            assert mlflow.active_run().info.run_id == parent.info.run_id  # caller's run untouched
    finally:
        mlflow.set_tracking_uri(None)  # this also drops $MLFLOW_TRACKING_URI: put it back
        os.environ["MLFLOW_TRACKING_URI"] = uri
    got = client.get_run(run.run_id)
    assert got.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert got.info.experiment_id == exp_id


def test_system_metrics_are_logged_even_for_a_short_run(client: MlflowClient) -> None:
    memory = "system/system_memory_usage_megabytes"
    with start_tracked_run(_experiment(), "r", {}, system_metrics_interval_s=0.2) as run:
        import time

        deadline = time.monotonic() + 60  # a periodic sample is in (however slow the machine)
        while not client.get_metric_history(run.run_id, memory) and time.monotonic() < deadline:
            time.sleep(0.1)
    metrics = client.get_run(run.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0
    history = client.get_metric_history(run.run_id, memory)
    assert len(history) >= 2  # periodic samples plus the last one


def test_data_wait_logs_window_means_on_rank_0_only(
    client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_wait, "LOG_INTERVAL_S", 3600.0)
    with start_tracked_run(_experiment(), "r", {}, system_metrics=False) as run:
        monkeypatch.setenv("MLFLOW_RUN_ID", run.run_id)
        monkeypatch.setenv("RANK", "1")
        log_data_wait(9.0, step=1)  # not rank 0: ignored
        monkeypatch.setenv("RANK", "0")
        log_data_wait(0.25, step=1)  # the first call logs at once
        log_data_wait(0.5, step=2)  # these two wait for the window (or the flush)
        log_data_wait(1.5, step=3)
        flush_data_wait()
    history = client.get_metric_history(run.run_id, DATA_WAIT_METRIC)
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (3, 1.0)]


def test_data_wait_is_cheap(client: MlflowClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call per batch costs no MLflow request: 2000 calls within one window make two, the first
    call's and the flush's (counted, not timed: the cost of a call is measured in benchmarks/)."""
    monkeypatch.setattr(data_wait, "LOG_INTERVAL_S", 3600.0)
    requests: list[int] = []
    log_metric = MlflowClient.log_metric

    def counted(self, run_id, key, value, *args, **kwargs):
        if key == DATA_WAIT_METRIC:
            requests.append(kwargs.get("step"))
        return log_metric(self, run_id, key, value, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_metric", counted)
    with start_tracked_run(_experiment(), "r", {}, system_metrics=False) as run:
        monkeypatch.setenv("MLFLOW_RUN_ID", run.run_id)
        monkeypatch.setenv("RANK", "0")
        for step in range(0, 2001):
            log_data_wait(0.1, step=step)
        flush_data_wait()
    assert requests == [0, 2000]  # the first call logs at once; the other 2000 wait for the flush
    history = client.get_metric_history(run.run_id, DATA_WAIT_METRIC)
    assert [(m.step, round(m.value, 6)) for m in history] == [(0, 0.1), (2000, 0.1)]


def test_data_wait_without_a_run_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setitem(data_wait._state, "run_id", None)
    log_data_wait(1.0, step=0)  # no run, no error
    assert data_wait._state["count"] == 0


def test_disabled_runs_create_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = "sqlite:///" + str(tmp_path / "never.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    off = start_tracked_run("x", "r", {"a": 1}, enabled=False)
    monkeypatch.setenv("GPUFLEET_TRACKING", "0")
    off_env = start_tracked_run("x", "r", {"a": 1})
    for run in (off, off_env):
        assert run.run_id is None and not run.enabled and run.env() == {}
        run.log_config({"a": 1})
        run.log_artifacts([tmp_path])
        run.set_status("FAILED")
        run.end()
    assert not (tmp_path / "never.db").exists()


def test_missing_mlflow_warns_once_and_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    monkeypatch.setattr(runs_module, "_warned_missing", False)
    with pytest.warns(RuntimeWarning, match=r"pip install 'gpufleet\[mlflow\]'"):
        run = start_tracked_run("x", "r", {"a": 1})
    assert run.run_id is None and run.env() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert start_tracked_run("x", "r", {}).run_id is None  # no second warning
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc")
    log_data_wait(1.0, step=0)  # silently nothing


def test_unreachable_store_warns_and_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unknown-scheme://nowhere")
    with pytest.warns(RuntimeWarning, match="could not open a run"):
        run = start_tracked_run("x", "r", {})
    assert run.run_id is None


def test_default_store_is_sqlite_under_gpufleet_home(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MLFLOW_TRACKING_URI: sqlite:///$GPUFLEET_HOME/mlflow.db, artifacts in mlartifacts."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with start_tracked_run("exp", "r", {"a": 1}, system_metrics=False) as run:
        run.log_config({"a": 1})
    assert run.tracking_uri == default_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    assert run.env()["MLFLOW_TRACKING_URI"] == run.tracking_uri
    assert (tmp_path / "mlflow.db").exists()
    artifacts = list((tmp_path / "mlartifacts").rglob("config.yaml"))
    assert len(artifacts) == 1 and run.run_id in str(artifacts[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlartifacts", "mlflow.db"]  # nothing in the cwd
    got = MlflowClient(run.tracking_uri).get_run(run.run_id)
    assert got.data.params == {"a": "1"}


def test_default_tracking_uri_follows_gpufleet_home(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path))
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"


def test_a_sqlite_store_of_the_users_keeps_artifacts_beside_the_database(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_TRACKING_URI=sqlite:///...: no ./mlruns folder in whatever directory the run started from."""
    store, cwd = tmp_path / "store", tmp_path / "notebooks"
    store.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/runs.db")
    monkeypatch.chdir(cwd)
    with start_tracked_run(_experiment(), "r", {"a": 1}, system_metrics=False) as run:
        run.log_config({"a": 1})
    artifacts = list((store / "mlartifacts").rglob("config.yaml"))
    assert len(artifacts) == 1 and run.run_id in str(artifacts[0])
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("uri", "hosts", "warned"),
    [
        ("sqlite:////home/me/.gpufleet/mlflow.db", ["10.0.0.1", "10.0.0.2"], True),
        ("file:///tmp/mlruns", ["10.0.0.1", "10.0.0.2"], True),
        ("/tmp/mlruns", ["10.0.0.1", "10.0.0.2"], True),
        ("sqlite:////home/me/.gpufleet/mlflow.db", ["10.0.0.1"], False),  # several raylets, one host
        ("http://mlflow.internal:5000", ["10.0.0.1", "10.0.0.2"], False),
        ("databricks", ["10.0.0.1", "10.0.0.2"], False),
    ],
)
def test_a_file_store_is_flagged_for_a_ray_cluster_of_several_hosts(uri: str, hosts: list[str], warned: bool) -> None:
    from gpufleet.tracking.launch import local_store_warning

    message = local_store_warning(uri, hosts)
    assert (message is not None) == warned
    if warned:
        assert uri in message and "10.0.0.2" in message and "MLFLOW_TRACKING_URI" in message
