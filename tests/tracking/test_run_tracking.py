"""One tracking callback for both kinds of run, against a fake MLflow run (no MLflow, no processes).

The controller drives scripted groups; ``start_tracked_run`` and ``attach_tracked_run`` are replaced
by a fake that records what each run was given.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.launch.controller import Controller
from gpufleet.launch.policy import RetryPolicy
from gpufleet.runs.recorder import RunRecorder
from gpufleet.runs.records import RunRecord
from gpufleet.runs.store import RunStore
from gpufleet.states import FAILED, RUNNING
from gpufleet.tracking import launch as tracking_launch
from gpufleet.tracking import runs as tracking_runs
from gpufleet.tracking.launch import CallTracking, RunTracking
from gpufleet.workload.attempts import WorkloadKind, WorkloadTracking
from gpufleet.workload.schema import WorkloadConfig
from tests.unit.test_controller import FakeClock, FakeGroup, exited, ok

FAIL = [[exited(0, 3, t=1.0), exited(1, 3, t=1.0)]]
WIN = [[ok(0, "a"), ok(1, "b")]]


class FakeRun:
    """What one MLflow run was given."""

    def __init__(self, run_id: str, name: str | None, tags: dict[str, Any], how: str) -> None:
        self.run_id, self.name, self.tags, self.how = run_id, name, dict(tags), how
        self.enabled = True
        self.tracking_uri, self.experiment_id, self.experiment_name = "sqlite:///fake.db", "1", "exp"
        self.params: dict[str, Any] = {}
        self.artifacts: list[str] = []
        self.texts: dict[str, str] = {}
        self.configs: list[str] = []
        self.sampling = False
        self.status: str | None = None

    def env(self) -> dict[str, str]:
        return {"MLFLOW_RUN_ID": self.run_id}

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_config(self, config: Any, artifact_file: str = "config.yaml") -> None:
        self.configs.append(artifact_file)

    def log_artifacts(self, paths: Any, artifact_path: str | None = "logs") -> None:
        self.artifacts += [Path(p).name for p in paths]

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text

    def start_system_metrics(self) -> None:
        self.sampling = True

    def end(self, status: str | None = None) -> None:
        self.status = status


@pytest.fixture
def mlflow(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    made: list[FakeRun] = []

    def start(experiment: str | None, name: str | None, system_metrics: bool = True, tags: Any = None,
              active_run: Any = None) -> FakeRun:  # fmt: skip
        made.append(FakeRun(f"m{len(made) + 1}", name, tags or {}, "opened"))
        return made[-1]

    def attach(run_id: str, uri: str, experiment_id: Any = None, experiment_name: Any = None,
               system_metrics: bool = True) -> FakeRun:  # fmt: skip
        made.append(FakeRun(run_id, None, {}, "attached"))
        return made[-1]

    monkeypatch.setattr(tracking_launch, "start_tracked_run", start)
    monkeypatch.setattr(tracking_runs, "attach_tracked_run", attach)
    monkeypatch.setattr(tracking_launch, "_say_where", lambda tracked: None)
    return made


def _run(tmp_path: Path, callbacks: list, policy: RetryPolicy, late_env: bool = False) -> list[FakeGroup]:
    clock = FakeClock()
    groups: list[FakeGroup] = []
    scripts = [FAIL, WIN]

    def make_group(attempt: int) -> FakeGroup:
        group = FakeGroup(tmp_path, clock, scripts[attempt - 1])
        group.takes_late_env = late_env
        for rank in range(2):
            group.log_path(rank).write_text(f"rank {rank} of attempt {attempt}\n")
        groups.append(group)
        return group

    c = Controller(make_group, timeout_s=None, policy=policy, callbacks=callbacks, clock=clock, poll_s=0.02)
    assert c.run() == ["a", "b"]
    return groups


def test_a_calls_attempts_each_get_a_run_with_their_number_logs_and_error(tmp_path: Path, mlflow: list[FakeRun]) -> None:
    profile = CallTracking(launcher="local", function_name="train", gpus=2, gpu_type="cpu", experiment_name="exp",
                           max_retries=1, timeout=None, arguments={"args.lr": 0.1}, run_name="sft")  # fmt: skip
    groups = _run(tmp_path, [RunTracking(profile)], RetryPolicy.for_call(1), late_env=True)
    first, second = mlflow
    assert [(r.name, r.how) for r in mlflow] == [("sft", "opened"), ("sft-attempt-2", "opened")]
    for number, run in enumerate(mlflow, 1):
        assert run.params["gpufleet.attempt"] == number and run.tags["gpufleet.attempt"] == str(number)
        assert run.params["args.lr"] == 0.1 and run.params["gpufleet.world_size"] == 2 and run.sampling
    assert (first.status, second.status) == (FAILED, "SUCCESS")
    assert "WorkerExitError" in first.texts["error.txt"] and "error.txt" not in second.texts
    assert first.artifacts == ["rank-0.log", "rank-1.log"]
    # the ranks got the run's environment late, through the run folder
    assert [json.loads(g.run_dir.late_env.read_text()) for g in groups] == [{"MLFLOW_RUN_ID": "m1"}, {"MLFLOW_RUN_ID": "m2"}]


def test_a_workloads_first_run_is_attached_and_each_run_gets_the_stored_status(tmp_path: Path, mlflow: list[FakeRun]) -> None:
    store = RunStore(tmp_path / "home")
    run = RunRecord(id="20260101-000000-wl-aaaaaa", experiment="wl", state=RUNNING, created_at=time.time(),
                    config={}, run_dir=str(tmp_path), num_nodes=1, world_size=2, max_attempts=2)  # fmt: skip
    store.create_run(run)
    config = WorkloadConfig.model_validate({"experiment_name": "wl", "command": "true", "parameters": {"lr": 0.1},
                                            "compute": {"accelerator_type": "CPU_2", "num_accelerators": 2}})  # fmt: skip
    log = io.StringIO()
    recorder = RunRecorder(WorkloadKind(None), store, run_id=run.id, log=log, max_attempts=2)
    handed = [{"run_id": "opened-by-gpufleet-run", "tracking_uri": "sqlite:///fake.db"}]
    profile = WorkloadTracking(config, run, log, system_metrics=True, ends=recorder.ends,
                               handed_over=lambda: handed.pop() if handed else None)  # fmt: skip
    groups = _run(tmp_path, [recorder, RunTracking(profile)], RetryPolicy.for_workload(2))
    first, second = mlflow
    assert (first.how, first.run_id, second.how) == ("attached", "opened-by-gpufleet-run", "opened")
    assert second.name == f"{run.id}-attempt-2" and second.tags["gpufleet.attempt"] == 2
    assert [r.params["gpufleet.attempt"] for r in mlflow] == [1, 2] and first.params["lr"] == 0.1
    assert [r.configs for r in mlflow] == [["workload.yaml"], ["workload.yaml"]]
    assert (first.status, second.status) == (FAILED, "SUCCESS")  # the stored ends
    assert groups[0].spec.env["MLFLOW_RUN_ID"] == "opened-by-gpufleet-run"  # at once, before the nodes started
    assert [a.mlflow_run_id for a in store.get(run.id).attempts] == ["opened-by-gpufleet-run", "m2"]
