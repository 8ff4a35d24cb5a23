"""@distributed with tracking: one MLflow run per call/attempt, filled by the ranks (2 CPU workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from gpufleet import distributed
from gpufleet.errors import DistributedTimeoutError, RunCanceledError
from gpufleet.tracking import runs as runs_module

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

CPU = {"gpus": 2, "gpu_type": "cpu", "stream_logs": False}


def _experiment() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client() -> MlflowClient:
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def _runs(client: MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"])


def train(steps: int) -> dict:
    import os

    env = {k: os.environ.get(k) for k in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    print(f"hello from rank {os.environ['RANK']}")
    if os.environ["RANK"] == "0":
        import mlflow

        for step in range(steps):
            mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
        from gpufleet.tracking import log_data_wait

        log_data_wait(0.125, step=0)
    return env


def test_call_logs_params_rank0_metrics_system_metrics_and_logs(client: MlflowClient) -> None:
    exp = _experiment()
    f = distributed(train, experiment_name=exp, **CPU)
    handle = f.submit(3)
    envs = handle.result(timeout=120)
    run_id = handle.mlflow_run_id
    assert run_id and all(e["MLFLOW_RUN_ID"] == run_id for e in envs)
    assert all(e["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"] for e in envs)

    (run,) = _runs(client, exp)
    assert run.info.run_id == run_id and run.info.run_name == handle.run_id
    assert run.info.status == "FINISHED"
    assert run.info.experiment_id == envs[0]["MLFLOW_EXPERIMENT_ID"]
    params = run.data.params
    assert params["gpufleet.function"] == "train"
    assert params["gpufleet.world_size"] == "2" and params["gpufleet.gpus"] == "2"
    assert params["gpufleet.gpu_type"] == "cpu" and params["gpufleet.attempt"] == "1"
    assert run.data.tags["gpufleet.run_id"] == handle.run_id
    assert run.data.tags["gpufleet.status"] == "SUCCESS"
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    assert client.get_metric_history(run_id, "data/wait_seconds")[0].value == 0.125
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    logs = sorted(a.path for a in client.list_artifacts(run_id, "logs"))
    assert logs == ["logs/rank-0.log", "logs/rank-1.log"]
    text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/logs/rank-1.log")
    assert "hello from rank 1" in text


def log_a_metric_in_the_background() -> int:
    import os
    import time

    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    if os.environ["RANK"] == "0":
        write = SqlAlchemyStore.log_batch

        def slow(self, *args, **kwargs):  # a tracking store that takes its time (a loaded machine, a far server)
            time.sleep(2.0)
            return write(self, *args, **kwargs)

        SqlAlchemyStore.log_batch = slow
        mlflow.log_metric("late", 1.0, step=0, synchronous=False)
    return 0


def test_what_a_rank_logged_in_the_background_is_in_mlflow_when_the_result_returns(client: MlflowClient) -> None:
    handle = distributed(log_a_metric_in_the_background, experiment_name=_experiment(), **CPU).submit()
    assert handle.result(timeout=120) == [0, 0]
    assert [m.value for m in client.get_metric_history(handle.mlflow_run_id, "late")] == [1.0]


def test_failed_attempt_and_retry_each_get_a_run(client: MlflowClient) -> None:
    def flaky() -> int:
        import os

        if os.environ["GPUFLEET_ATTEMPT"] == "1" and os.environ["RANK"] == "1":
            raise RuntimeError("first attempt breaks on rank 1")
        return 7

    exp = _experiment()
    f = distributed(flaky, experiment_name=exp, max_retries=1, grace_period_s=1.0, **CPU)
    assert f.distributed() == [7, 7]
    first, second = _runs(client, exp)
    assert (first.info.status, first.data.tags["gpufleet.status"]) == ("FAILED", "FAILED")
    assert first.data.params["gpufleet.attempt"] == "1" and second.data.params["gpufleet.attempt"] == "2"
    assert first.data.tags["gpufleet.attempt"] == "1" and second.data.tags["gpufleet.attempt"] == "2"  # as a workload's
    assert second.info.status == "FINISHED"
    error = mlflow.artifacts.load_text(f"{first.info.artifact_uri}/error.txt")
    assert "RuntimeError: first attempt breaks on rank 1" in error and "raised on rank 1" in error
    assert sorted(a.path for a in client.list_artifacts(first.info.run_id, "logs")) == [
        "logs/rank-0.log",
        "logs/rank-1.log",
    ]


def test_timeout_marks_the_run_timed_out(client: MlflowClient) -> None:
    def hang() -> None:
        import time

        time.sleep(120)

    exp = _experiment()
    f = distributed(hang, experiment_name=exp, timeout=3, grace_period_s=0.5, **CPU)
    with pytest.raises(DistributedTimeoutError):
        f.distributed()
    (run,) = _runs(client, exp)
    assert run.info.status == "FAILED" and run.data.tags["gpufleet.status"] == "TIMEDOUT"


def test_two_calls_at_once_one_canceled_each_recorded(client: MlflowClient) -> None:
    def nap(seconds: float) -> str:
        import time

        time.sleep(seconds)
        return "done"

    exp = _experiment()
    f = distributed(nap, experiment_name=exp, grace_period_s=0.5, **CPU)
    slow, quick = f.submit(600), f.submit(0.5)  # slow ends only when canceled, however long quick takes
    # each call's MLflow run opens while its ranks start (the call never waits for it): wait for both
    deadline = time.monotonic() + 120
    while slow.mlflow_run_id is None or quick.mlflow_run_id is None:
        assert time.monotonic() < deadline, "the calls' MLflow runs did not open"
        time.sleep(0.1)
    assert slow.mlflow_run_id != quick.mlflow_run_id
    assert quick.result(timeout=120) == ["done", "done"]
    slow.cancel()
    with pytest.raises(RunCanceledError):
        slow.result(timeout=60)
    got_slow, got_quick = client.get_run(slow.mlflow_run_id), client.get_run(quick.mlflow_run_id)
    assert (got_slow.info.status, got_slow.data.tags["gpufleet.status"]) == ("KILLED", "CANCELED")
    assert (got_quick.info.status, got_quick.data.tags["gpufleet.status"]) == ("FINISHED", "SUCCESS")
    assert "error.txt" not in [a.path for a in client.list_artifacts(slow.mlflow_run_id)]


def test_call_is_nested_under_the_callers_active_run(client: MlflowClient) -> None:
    uri = os.environ["MLFLOW_TRACKING_URI"]
    exp = _experiment()
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment(exp)
        with mlflow.start_run() as parent:
            handle = distributed(train, **CPU).submit(1)
            handle.result(timeout=120)
    finally:
        mlflow.set_tracking_uri(None)  # also drops $MLFLOW_TRACKING_URI: put it back
        os.environ["MLFLOW_TRACKING_URI"] = uri
        mlflow.tracking.fluent._active_experiment_id = None
    child = client.get_run(handle.mlflow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert "loss" in child.data.metrics and "loss" not in client.get_run(parent.info.run_id).data.metrics


def test_missing_mlflow_warns_and_the_call_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError here
    monkeypatch.setattr(runs_module, "_warned_missing", False)

    def rank_env() -> str | None:
        import os

        return os.environ.get("MLFLOW_RUN_ID")

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with pytest.warns(RuntimeWarning, match=r"pip install 'gpufleet\[mlflow\]'"):
        handle = distributed(rank_env, **CPU).submit()
        assert handle.result(timeout=120) == [None, None]
    assert handle.mlflow_run_id is None


DISABLED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from gpufleet import distributed

    def rank_env():
        import os
        return os.environ.get("MLFLOW_RUN_ID")

    out = {"off": distributed(rank_env, gpus=2, gpu_type="cpu", tracking=False).distributed()}
    os.environ["GPUFLEET_TRACKING"] = "0"
    out["env_off"] = distributed(rank_env, gpus=2, gpu_type="cpu").distributed()
    out["mlflow_imported"] = "mlflow" in sys.modules
    print(json.dumps(out))
    """
)


def test_tracking_off_creates_nothing_and_never_imports_mlflow(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["GPUFLEET_HOME"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", DISABLED_SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"off": [None, None], "env_off": [None, None], "mlflow_imported": False}
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("runs.db"))  # the run store records calls
    assert names == ["runs"]  # no mlflow.db, no mlartifacts


def test_bad_tracking_options_are_refused() -> None:
    from gpufleet.errors import LaunchConfigError

    with pytest.raises(LaunchConfigError, match="tracking must be True or False"):
        distributed(train, tracking="yes")
    with pytest.raises(LaunchConfigError, match="experiment_name must be a non-empty string"):
        distributed(train, experiment_name="  ")


def _train_with_a_slow_loader() -> int:
    import time

    from gpufleet import TimedDataLoader

    class Slow:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            time.sleep(0.03)  # a slow share: every sample keeps the step waiting
            return i

    loader = TimedDataLoader(Slow(), batch_size=2, num_workers=0)
    return sum(len(batch) for batch in loader)


def test_the_data_loader_reports_its_wait_to_the_call_run(client: MlflowClient) -> None:
    exp = _experiment()
    handle = distributed(_train_with_a_slow_loader, experiment_name=exp, **CPU).submit()
    assert handle.result(timeout=120) == [8, 8]
    history = client.get_metric_history(handle.mlflow_run_id, "data/wait_seconds")
    assert history, "rank 0's loader logged no data/wait_seconds"
    assert all(m.value >= 0.05 for m in history)  # 2 samples x 30 ms per batch


class Blob:
    """An argument MLflow cannot show: logged as its type."""


def configured(steps: int, lr: float = 1e-3, cfg: dict | None = None, data: object = None, **extra: object) -> int:
    return steps


def test_the_calls_arguments_are_the_runs_parameters(client: MlflowClient) -> None:
    exp = _experiment()
    f = distributed(configured, experiment_name=exp, **CPU)
    handle = f.submit(5, cfg={"layers": 2, "name": "tiny"}, data=Blob(), note="first try")
    assert handle.result(timeout=120) == [5, 5]
    params = _runs(client, exp)[0].data.params
    assert params["args.steps"] == "5" and params["args.lr"] == "0.001"  # defaults too
    assert params["args.cfg.layers"] == "2" and params["args.cfg.name"] == "tiny"
    assert params["args.data"] == "<tests.tracking.test_decorator.Blob>"
    assert params["args.note"] == "first try"  # **kwargs by their own names


def test_call_parameters_keep_small_values_and_name_the_type_of_the_rest() -> None:
    import inspect
    from pathlib import Path

    from gpufleet.tracking.launch import call_parameters

    def fn(path, sizes, *rest, big=None):
        return None

    got = call_parameters(inspect.signature(fn), (Path("/data/x"), (1, 2), "a"), {"big": list(range(1000))})
    assert got == {"args.path": "/data/x", "args.sizes": [1, 2], "args.rest": ["a"], "args.big": "<builtins.list>"}


def test_secret_looking_arguments_never_reach_the_tracking_store(client: MlflowClient) -> None:
    exp = _experiment()
    f = distributed(configured, experiment_name=exp, **CPU)
    secrets = {"api_key": "s3cr3t-api-value-91", "cfg": {"db_password": "hunter2-xyz-77", "layers": 3}}
    assert f.distributed(2, **secrets) == [2, 2]
    params = _runs(client, exp)[0].data.params
    assert params["args.api_key"] == "***" and params["args.cfg.db_password"] == "***"
    assert params["args.cfg.layers"] == "3" and params["args.steps"] == "2"  # the rest as it was
    store = os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")
    data = open(store, "rb").read()
    assert b"s3cr3t-api-value-91" not in data and b"hunter2-xyz-77" not in data


def test_redact_masks_secret_names_and_every_env_variable() -> None:
    from gpufleet.tracking.runs import looks_secret, redact

    config = {"env_variables": {"HF_HOME": "/tmp/hf"}, "parameters": {"lr": 0.1, "wandb_token": "t"},
              "credentials": {"user": "u", "pass": "p"}}  # fmt: skip
    assert redact(config) == {"env_variables": {"HF_HOME": "***"}, "parameters": {"lr": 0.1, "wandb_token": "***"},
                              "credentials": "***"}  # fmt: skip
    assert [n for n in ("HF_TOKEN", "apiKey", "max_steps", "tokenizer", "monkey") if looks_secret(n)] == ["HF_TOKEN", "apiKey"]


def _started_and_env() -> dict:
    import os
    import time

    import psutil

    return {"started": psutil.Process().create_time(), "entered": time.time(), "run": os.environ.get("MLFLOW_RUN_ID")}


def test_the_mlflow_run_opens_while_the_ranks_start_and_the_call_sees_it(
    client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpufleet.tracking import launch

    real = launch.start_tracked_run
    opened: dict[str, float] = {}

    def slow_open(*args, **kwargs):
        # A slow store (or a slow MLflow import): the ranks must not wait for it to start. It opens
        # only once both rank processes of this call exist (args[1], the run's name, is its run id,
        # which the workers' command lines name), however slow the machine; ranks that waited for
        # the opening never appear, and the opening then goes on after 120 s and the test fails.
        import psutil

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ranks = []
            for child in psutil.Process().children():
                try:
                    if any(str(args[1]) in part for part in child.cmdline()):
                        ranks.append(child)
                except psutil.Error:
                    pass
            if len(ranks) >= 2:
                break
            time.sleep(0.05)
        time.sleep(3.0)  # well past the ranks' start times (psutil reads them to within a second)
        run = real(*args, **kwargs)
        opened["at"] = time.time()
        return run

    monkeypatch.setattr(launch, "start_tracked_run", slow_open)
    f = distributed(_started_and_env, experiment_name=_experiment(), **CPU)
    handle = f.submit()
    seen = handle.result(timeout=120)
    assert handle.mlflow_run_id and [s["run"] for s in seen] == [handle.mlflow_run_id] * 2
    assert all(s["started"] < opened["at"] for s in seen), (seen, opened)  # started during the opening
    assert all(s["entered"] >= opened["at"] - 0.05 for s in seen), (seen, opened)  # the call waited for it
    assert client.get_run(handle.mlflow_run_id).info.status == "FINISHED"


def test_a_failing_mlflow_opening_releases_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.tracking import launch

    def broken_open(*args, **kwargs):
        raise RuntimeError("the tracking store is on fire")

    monkeypatch.setattr(launch, "start_tracked_run", broken_open)
    f = distributed(_started_and_env, experiment_name=_experiment(), **CPU)
    with pytest.warns(RuntimeWarning, match="the tracking store is on fire"):
        handle = f.submit()
        seen = handle.result(timeout=60)
    assert [s["run"] for s in seen] == [None, None] and handle.mlflow_run_id is None


def _visible_gpus() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_call_on_every_free_gpu_logs_the_number_it_was_leased(
    client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpufleet.launch.leasing.leases import GpuRequest, Holder, acquire

    monkeypatch.setenv("GPUFLEET_FAKE_GPUS", "2")  # the lease code of real GPUs, on two fake ones
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with acquire(GpuRequest(named=(0,), wait_s=0), Holder("another-run", "call")):  # GPU 0 is taken
        f = distributed(_visible_gpus, experiment_name=_experiment(), gpus=None, stream_logs=False)
        handle = f.submit()
        seen = handle.result(timeout=120)
    assert seen == ["1"]  # one rank, on the free GPU
    params = client.get_run(handle.mlflow_run_id).data.params
    assert params["gpufleet.world_size"] == "1" and params["gpufleet.num_nodes"] == "1", params


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_the_run_registry_shows_a_running_calls_mlflow_run(client: MlflowClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.runs.store import RunStore
    from gpufleet.tracking import launch

    real = launch.start_tracked_run

    def slow_open(*args, **kwargs):
        time.sleep(2.0)  # MLflow's first import: the ranks are running (and recorded) before the run opens
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "start_tracked_run", slow_open)
    handle = distributed(_sleep, experiment_name=_experiment(), **CPU).submit(8.0)
    store = RunStore()
    deadline = time.time() + 60
    while time.time() < deadline and not handle.done():
        if handle.mlflow_run_id and store.get(handle.run_id).mlflow_run_ids() == [handle.mlflow_run_id]:
            break
        time.sleep(0.2)
    assert not handle.done(), "the call ended before `gpufleet get` could show its MLflow run"
    handle.result(timeout=60)
    assert store.get(handle.run_id).mlflow_run_ids() == [handle.mlflow_run_id]
