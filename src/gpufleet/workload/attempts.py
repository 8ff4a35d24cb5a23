"""What the supervisor does around each attempt: the run store's records and the MLflow run.

The records are written by the run model's one recorder (:class:`~gpufleet.runs.recorder.RunRecorder`)
with :class:`WorkloadKind`; :func:`attempt_end` turns the controller's view of an attempt (its
end state and error) into what the run store shows: the state, the exit code and a message such
as ``node 1 exited with code 3; see `gpufleet logs RUN --node 1```. What each attempt's MLflow
run holds is :class:`WorkloadTracking`, the workload's profile of the one tracking callback
(:class:`~gpufleet.tracking.launch.RunTracking`). Both join the controller as hooks, so the
controller that runs the attempts stays free of workload concerns.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..errors import EXIT, SIGNAL, DistributedHangError, WorkerGroupError
from ..launch.group import GroupStartCanceled, WorkerGroup
from ..runs.records import AttemptEnd, RunRecord
from ..states import CANCEL_REASON, CANCELED, FAILED, RUNNING, SUCCESS, TIMEDOUT, RunState
from .nodes import WorkloadNodeGroup, failed_line
from .schema import WorkloadConfig

#: Keys ``gpufleet run`` adds to the stored config of a run (not workload fields): the code
#: version (:func:`gpufleet.codeversion.code_version`) and where its MLflow runs are.
CODE_VERSION_KEY = "code_version"
MLFLOW_KEY = "mlflow_tracking"


def workload_document(stored: dict[str, Any]) -> dict[str, Any]:
    """The workload of a stored run config (without the keys ``gpufleet run`` added)."""
    return {k: v for k, v in stored.items() if k not in (CODE_VERSION_KEY, MLFLOW_KEY)}


def attempt_run_name(config: WorkloadConfig, run_id: str, attempt: int) -> str:
    """The MLflow run name of an attempt: ``mlflow_run_name`` (``-attempt-<n>`` after the first), else ``<run id>-attempt-<n>``."""
    if config.mlflow_run_name:
        return config.mlflow_run_name if attempt == 1 else f"{config.mlflow_run_name}-attempt-{attempt}"
    return f"{run_id}-attempt-{attempt}"


def open_attempt_run(
    config: WorkloadConfig, run_id: str, attempt: int, code_version: dict[str, Any] | None, system_metrics: bool
) -> Any:
    """Open the MLflow run of one attempt (a disabled one when tracking is off or MLflow is missing)."""
    from ..codeversion import mlflow_tags
    from ..tracking import start_tracked_run

    return start_tracked_run(
        experiment_name=config.experiment_name,
        run_name=attempt_run_name(config, run_id, attempt),
        params={**config.parameters, "gpufleet.attempt": attempt},  # a parameter and a tag, as a call's
        enabled=True,
        tags={"gpufleet.run_id": run_id, "gpufleet.attempt": attempt, "gpufleet.source": "workload",
              **mlflow_tags(code_version)},  # fmt: skip
        system_metrics=system_metrics,
    )


def attempt_end(
    group: WorkerGroup,
    state: RunState,
    error: BaseException | None,
    timeout_minutes: float | None,
    cancel_reason: str,
) -> AttemptEnd:
    """The stored outcome of an attempt that the controller ended in ``state`` with ``error`` (secrets masked)."""
    from ..secrets import mask_env_secrets

    end = _attempt_end(group, state, error, timeout_minutes, cancel_reason)
    if end.message:
        end = AttemptEnd(end.state, end.exit_code, mask_env_secrets(end.message, group.spec.env))
    return end


def _attempt_end(
    group: WorkerGroup,
    state: RunState,
    error: BaseException | None,
    timeout_minutes: float | None,
    cancel_reason: str,
) -> AttemptEnd:
    start_canceled = getattr(group, "start_canceled", None)
    if isinstance(error, GroupStartCanceled) or start_canceled:
        return AttemptEnd(CANCELED, None, f"{cancel_reason} ({start_canceled or error})")
    if state == SUCCESS:
        return AttemptEnd(SUCCESS, 0)
    if state == CANCELED:
        return AttemptEnd(CANCELED, None, cancel_reason)
    if isinstance(error, DistributedHangError):  # the watchdog's diagnosis: the lines above its root cause
        lines = str(error).splitlines()
        head = [x for x in itertools.takewhile(lambda x: not x.startswith("root cause:"), lines)]
        return AttemptEnd(TIMEDOUT, None, "\n".join(head or lines[:1]))
    if state == TIMEDOUT:
        return AttemptEnd(
            TIMEDOUT, None, f"the attempt ran longer than timeout_minutes={timeout_minutes or 0:g} and was stopped"
        )
    preempted = getattr(group, "preempted", None)
    if preempted:
        return AttemptEnd(FAILED, None, f"{preempted}; resubmitted as the next attempt, which resumes from the newest checkpoint")
    lost = getattr(group, "lost", None)
    if lost:
        return AttemptEnd(FAILED, None, f"{lost}; see `gpufleet logs {group.run_id}`")
    root = error.root_cause if isinstance(error, WorkerGroupError) else None
    if root is not None and root.kind in (EXIT, SIGNAL) and root.exit_code is not None:
        rank, code = root.rank, root.exit_code
        where = ""
        if root.kind == EXIT and isinstance(group, WorkloadNodeGroup):
            line = failed_line(group.log_path(rank), group.command)
            if line is not None:
                where = f" at line {line[0]} of the command" + (f": `{line[1]}`" if line[1] else "")
        return AttemptEnd(
            FAILED, code, f"node {rank} exited with code {code}{where}; see `gpufleet logs {group.run_id} --node {rank}`"
        )
    cause = error.__cause__ if isinstance(error, WorkerGroupError) and error.__cause__ is not None else error
    return AttemptEnd(FAILED, None, f"run failed: {cause}")


class WorkloadKind:
    """A workload's attempts: rows of the one run its supervisor made, RUNNING from the start."""

    run_per_attempt = False
    attempt_start_state = RUNNING
    watches_cancel = False  # the supervisor gets a signal, and reads the stored request itself
    records_ranks = False  # its node group describes its nodes as they start

    def __init__(self, timeout_minutes: float | None) -> None:
        self.timeout_minutes = timeout_minutes

    def new_run(self, group: WorkerGroup, attempt: int, first_run_id: str) -> RunRecord:
        raise AssertionError("a workload's run is made by `gpufleet run`, not per attempt")

    def end_of(self, group: WorkerGroup, state: RunState, error: BaseException | None,
               cancel_reason: str | None) -> AttemptEnd:  # fmt: skip
        return attempt_end(group, state, error, self.timeout_minutes, cancel_reason or CANCEL_REASON)


class WorkloadTracking:
    """What a workload attempt's MLflow run holds (a profile of :class:`~gpufleet.tracking.launch.RunTracking`).

    Its parameters (``parameters`` of the workload), the workload as the artifact ``workload.yaml``,
    the tags ``gpufleet.run_id``, ``gpufleet.attempt`` and ``gpufleet.source``, every node's log,
    and the status the run store shows for the attempt. The first attempt's run is the one
    ``gpufleet run`` opened (``handed_over``). Problems are lines of the supervisor log.
    """

    nests = False

    def __init__(self, config: WorkloadConfig, run: RunRecord, log: IO[str], system_metrics: bool,
                 ends: dict[int, AttemptEnd], handed_over: Callable[[], dict[str, Any] | None] = lambda: None) -> None:  # fmt: skip
        self.config = config
        self.run = run
        self.log = log
        self.metrics = system_metrics
        self.ends = ends  # the recorder's: how each attempt ended, as the run store shows it
        self._handed_over = handed_over
        self.experiment_name = config.experiment_name

    def run_name(self, group: WorkerGroup, attempt: int) -> str:
        return attempt_run_name(self.config, self.run.id, attempt)

    def params(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        return {**self.config.parameters, "gpufleet.attempt": attempt}  # a parameter and a tag, as a call's

    def tags(self, group: WorkerGroup, attempt: int) -> dict[str, Any]:
        from ..codeversion import mlflow_tags

        return {"gpufleet.run_id": self.run.id, "gpufleet.attempt": attempt, "gpufleet.source": "workload",
                **mlflow_tags(self.run.config.get(CODE_VERSION_KEY))}  # fmt: skip

    def handed_over(self, attempt: int) -> dict[str, Any] | None:
        return self._handed_over() if attempt == 1 else None

    def system_metrics(self, group: WorkerGroup) -> bool:
        return self.metrics

    def opened(self, tracked: Any, group: WorkerGroup, attempt: int) -> None:
        tracked.log_config(workload_document(self.run.config), artifact_file="workload.yaml")

    def started(self, tracked: Any, group: WorkerGroup, attempt: int) -> None:
        pass

    def ended(self, tracked: Any, group: WorkerGroup, attempt: int, state: str, error: BaseException | None) -> str:
        logs: list[Path] = [group.log_path(rank) for rank in range(group.num_ranks)]
        tracked.log_artifacts([str(p) for p in logs if p.exists()])
        end = self.ends.get(attempt)
        return end.state if end is not None else state

    def warn(self, text: str) -> None:
        self.log.write(f"gpufleet: {text}\n")
        self.log.flush()
